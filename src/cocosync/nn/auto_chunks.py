"""chunks="auto": a tensor-parallel layer picks its overlap chunk count by measurement, inside the job, on first use
of each input shape (issue 17's schedule="auto" for cocosync.nn).

Each candidate (1, 2, 4 chunks: `tp_schedule` gives the program as written, or split + reorder, or the overlapped
chain) is compiled for the layer's group and timed round-robin on random inputs of the program's local shapes; the
ranks take the candidate whose slowest rank's median is least (one all-reduce), so every rank runs the same plan.
It costs a few calls of each candidate once per shape; the choice is kept in the layer's PlanCache (`chosen`)."""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch
import torch.distributed as dist

from cocosync.bench.common import time_interleaved
from cocosync.runtime.reference.stage import local_shape

__all__ = ["AUTO_CHUNKS", "choose_chunks"]

AUTO_CHUNKS = (1, 2, 4)


def _inputs(plan: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for n in plan.program.inputs:
        if n.attr("kind") != "tensor":
            out[n.name] = 0.5
        else:
            out[n.name] = torch.rand(local_shape(n, plan.comm.group_size), generator=gen).to(n.dtype)
    return out


def choose_chunks(compile_for: Callable[[int], Any], group: dist.ProcessGroup | None,
                  repeats: int = 5) -> tuple[int, Any, dict[int, float]]:
    """(chunks, its compiled plan, median seconds per candidate) for `compile_for(chunks) -> compiled plan`.
    Collective over `group`."""
    plans, seen = {}, {}
    for c in AUTO_CHUNKS:
        plan = compile_for(c)
        listing = str(plan.plan)
        if listing not in seen:  # e.g. rows not divisible: every chunk count gives the program as written
            seen[listing] = c
            plans[c] = plan
    cases = {c: (lambda p=p, a=_inputs(p): p(**a)) for c, p in plans.items()}
    samples = time_interleaved(cases, repeats, warmup=1, before=lambda: dist.barrier(group))
    medians = torch.tensor([statistics.median(samples[c]) for c in plans], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's: the same on every rank
    best = list(plans)[int(torch.argmin(medians))]
    return best, plans[best], {c: float(m) for c, m in zip(plans, medians)}
