"""Pruning by the oracle: a candidate schedule must compute what the program as written computes, under the
reference interpreter, on small random inputs, on every rank (a state the schedule keeps sliced is compared with
the rank's slice of the reference)."""

from __future__ import annotations

import torch

from cocosync.dsl.types import part_of
from cocosync.interp import interpret
from cocosync.schedule.schedule import replay
from cocosync.tune.space import Candidate
from cocosync.tune.workloads import Workload, global_inputs

__all__ = ["agrees"]


def agrees(work: Workload, candidate: Candidate, world: int, seed: int = 0) -> str | None:
    """None when the candidate matches the program on `world` ranks; else why not (the first difference)."""
    program = work.small()
    scheduled = replay(program, candidate.directives)
    inputs = global_inputs(program, world, work.scalars, seed)
    want, got = interpret(program, world, inputs), interpret(scheduled, world, inputs)
    layouts = dict(zip(scheduled.output_names, scheduled.outputs))
    for rank, (w, g) in enumerate(zip(want, got)):
        for name, ref in w.items():
            out = layouts[name]
            if out.layout.is_sliced and tuple(g[name].shape) != tuple(ref.shape):
                ref = part_of(ref, out.layout, world, rank)
            if not torch.allclose(g[name].float(), ref.float(), rtol=1e-4, atol=1e-5):
                diff = float((g[name].float() - ref.float()).abs().max())
                return f"output {name!r} on rank {rank} differs from the program as written by {diff:.3g}"
    return None
