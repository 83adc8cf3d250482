"""chunks="auto": a tensor-parallel layer picks its overlap chunk count by measurement, inside the job, on first use
of each input shape (the tuner's schedule="auto" for cocosync.nn).

Each candidate (1, 2, 4 chunks: `tp_schedule` gives the program as written, or split + reorder, or the overlapped
chain) is compiled for the layer's group and timed round-robin on random inputs of the program's local shapes; the
ranks take the candidate whose slowest rank's median is least (one all-reduce), so every rank runs the same plan.
It costs a few calls of each candidate once per shape; the choice is kept in the layer's PlanCache (`chosen`) and in
the tuner's cache on disk (per plan, world, nodes, torch version, machine), so a later job reads it."""

from __future__ import annotations

import statistics
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from cocosync.runtime.reference.stage import local_shape
from cocosync.timing import time_interleaved
from cocosync.tune.choice_cache import entry_path, read_agreed, save_entry

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


def choose_chunks(compile_for: Callable[[int], Any], group: dist.ProcessGroup | None, repeats: int = 5,
                  use_cache: bool = True) -> tuple[int, Any, dict[int, float]]:
    """(chunks, its compiled plan, median seconds per candidate; empty when the choice came from the cache) for
    `compile_for(chunks) -> compiled plan`. Collective over `group`."""
    plans, seen = {}, {}
    for c in AUTO_CHUNKS:
        plan = compile_for(c)
        listing = str(plan.plan)
        if listing not in seen:  # e.g. rows not divisible: every chunk count gives the program as written
            seen[listing] = c
            plans[c] = plan
    first = plans[AUTO_CHUNKS[0]]
    shm = first.comm.shm
    path = entry_path("chunks=auto\n" + str(first.plan), dist.get_world_size(group),
                      shm.nnodes if shm is not None else 1)
    order = list(plans)
    hit = read_agreed(path, group, lambda e: order.index(e["chunks"]) if e["chunks"] in order else None, use_cache)
    if hit is not None:
        return order[hit], plans[order[hit]], {}
    cases = {c: (lambda p=p, a=_inputs(p): p(**a)) for c, p in plans.items()}
    samples = time_interleaved(cases, repeats, warmup=1, before=lambda: dist.barrier(group))
    medians = torch.tensor([statistics.median(samples[c]) for c in plans], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's: the same on every rank
    best = order[int(torch.argmin(medians))]
    times = {c: float(m) for c, m in zip(plans, medians)}
    reason = (f"fastest slowest-rank median of chunks {order} ({repeats} round-robin repeats): "
              + ", ".join(f"{c}: {t * 1e3:.3f} ms" for c, t in times.items()))
    save_entry(path, {"workload": first.program.name, "chunks": best, "reason": reason,
                      "medians_s": {str(c): t for c, t in times.items()}}, group)
    if dist.get_rank(group) == 0:
        print(f"cocosync: {first.program.name} chunks='auto' runs {best}: {reason}", file=sys.stderr)
    return best, plans[best], times
