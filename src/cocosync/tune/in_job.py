"""schedule="auto" for cocosync.optim: an optimizer's update program tuned inside the job, at construction.

The candidates are the tuner's schedule space (space.py) restricted to those that keep the optimizer's state
sliced (the optimizer holds one slice of m, v, ... per rank, ZeRO-1); each is compiled for the optimizer's group and
timed round-robin on scratch tensors of its local shapes (the real parameters and state are not touched); the ranks
take the candidate whose slowest rank's median is least (one all-reduce), so every rank runs the same plan. The
choice is written to the tuner's cache (same key as `cocosync tune`: program listing, world, nodes, torch, machine,
kernels), so the next job with the same model and world reads it instead of timing; `cocosync tune FILE.py` of the
same program fills the same entry.

Every candidate computes what the program as written computes (each directive is checked against the reference
interpreter by the schedule tests; the tuner's oracle prunes at small sizes), so the choice changes speed only.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cocosync.dsl.ir import Program
from cocosync.lower import lower
from cocosync.runtime.executor import compile_plan
from cocosync.runtime.reference.stage import local_shape
from cocosync.schedule.schedule import Schedule
from cocosync.timing import time_interleaved
from cocosync.tune.choice_cache import entry_path, read_agreed, save_entry
from cocosync.tune.space import Candidate, schedule_space

__all__ = ["Choice", "choose_update_schedule"]


@dataclass(frozen=True)
class Choice:
    candidate: Candidate
    compiled: Any  # its CompiledPlan for the group
    medians: dict[str, float]  # candidate name -> the slowest rank's median seconds (empty when cached)
    cached: bool
    reason: str


def _keeps_sliced(program: Program, candidate: Candidate, state: tuple[str, ...]) -> bool:
    scheduled = Schedule(program, candidate.directives).program
    layouts = {n.name: n.layout for n in scheduled.inputs}
    return all(layouts[s].is_sliced for s in state if s in layouts)


def _scratch(compiled: Any, scalars: dict[str, float]) -> dict[str, Any]:
    """Inputs of the compiled plan's local shapes (plain tensors: the fused candidate copies its gradient into the
    workspace, a cost the optimizer's arena gradients avoid, so the timing errs against it). Every candidate keeps
    the same state sliced, so one set serves them all."""
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for n in compiled.program.inputs:
        if n.attr("kind") != "tensor":
            out[n.name] = float(scalars.get(n.name, 0.5))
        else:  # uniform [0, 1): second moments stay non-negative
            out[n.name] = torch.rand(local_shape(n, compiled.comm.group_size), generator=gen).to(n.dtype)
    return out


def choose_update_schedule(program: Program, state: tuple[str, ...], group: dist.ProcessGroup | None,
                           scalars: dict[str, float], *, donate: tuple[str, ...] = (), repeats: int = 5,
                           use_cache: bool = True) -> Choice | None:
    """The fastest schedule of an optimizer's update `program` on `group` among those keeping `state` sliced (None
    when the schedule space has none: the caller keeps its standard schedule). Collective over `group` (every rank
    reads the same cache entry or times the same candidates)."""
    world = dist.get_world_size(group)
    candidates = [c for c in schedule_space(program, state, world=world) if _keeps_sliced(program, c, state)]
    if not candidates:  # the same on every rank: the space depends on the program and world only
        return None
    compiled: dict[str, Any] = {}

    def plan(c: Candidate) -> Any:  # compiled when needed: a cached choice compiles one candidate only
        if c.name not in compiled:
            compiled[c.name] = compile_plan(lower(Schedule(program, c.directives).program), group, donate=donate)
        return compiled[c.name]

    shm = plan(candidates[-1]).comm.shm  # None where the group's collectives are torch's (then: one node)
    path = entry_path(str(program), world, shm.nnodes if shm is not None else 1)
    names = [c.name for c in candidates]
    hit = read_agreed(path, group, lambda e: names.index(e["chosen"]) if e["chosen"] in names else None, use_cache)
    if hit is not None:
        return Choice(candidates[hit], plan(candidates[hit]), {}, True, f"cached in {path}")
    args = _scratch(plan(candidates[-1]), scalars)
    cases = {c.name: (lambda p=plan(c): p(**args)) for c in candidates}
    samples = time_interleaved(cases, repeats, warmup=2, before=lambda: dist.barrier(group))
    medians = torch.tensor([statistics.median(samples[c.name]) for c in candidates], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's: the same on every rank
    best = candidates[int(torch.argmin(medians))]
    times = {c.name: float(m) for c, m in zip(candidates, medians)}
    reason = (f"fastest slowest-rank median of {len(candidates)} schedules keeping {', '.join(state) or 'no state'} "
              f"sliced ({repeats} round-robin repeats on {world} ranks): {times[best.name] * 1e3:.3f} ms")
    rows = [{"name": c.name, "schedule": c.listing, "measured_s": times[c.name]} for c in candidates]
    save_entry(path, {"workload": program.name, "world": world, "candidates": rows, "chosen": best.name,
                      "reason": reason, "model": {}, "model_error": None}, group)
    return Choice(best, plan(best), times, False, reason)
