"""A Plan: the ordered steps a rank runs. Each step owns its stages and has `run(env, comm)`, which computes their
values into `env` (id(node) -> this rank's tensor). These reference implementations run the stages one by one
through the executor's per-stage runner (correct, not fast); the runtime replaces them with fused kernels,
fused shared-memory collectives and chunked pipelines behind the same interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cocosync.dsl.ir import Node, Program

if TYPE_CHECKING:
    from cocosync.runtime.executor import _Comm


def _names(stages: tuple[Node, ...]) -> str:
    return ", ".join(s.name for s in stages)


def _run_all(stages: tuple[Node, ...], env: dict, comm: "_Comm") -> None:
    from cocosync.runtime.executor import run_stage

    for s in stages:
        run_stage(s, env, comm)


class Step:
    stages: tuple[Node, ...]

    def run(self, env: dict, comm: "_Comm") -> None:
        _run_all(self.stages, env, comm)


@dataclass(frozen=True, eq=False)
class Kernel(Step):
    """Local computations run as one kernel (no communication)."""
    stages: tuple[Node, ...]

    def __str__(self):
        return f"kernel({_names(self.stages)})"


@dataclass(frozen=True, eq=False)
class Collective(Step):
    """One communication stage."""
    stage: Node

    @property
    def stages(self) -> tuple[Node, ...]:
        return (self.stage,)

    def __str__(self):
        return f"collective({self.stage.name} = {self.stage.op})"


@dataclass(frozen=True, eq=False)
class FusedCollective(Step):
    """reduce_scatter -> computations on slices -> all_gather, as one collective (CoCoNeT's FusedAllReduce).
    `compute` lists the stages in program order (some may precede the reduce_scatter, e.g. scatters of state)."""
    rs: Node
    compute: tuple[Node, ...]
    ag: Node
    order: tuple[Node, ...]  # all stages in a valid order

    @property
    def stages(self) -> tuple[Node, ...]:
        return self.order

    def __str__(self):
        return f"fused_collective({self.rs.name} -> [{_names(self.compute)}] -> {self.ag.name})"


@dataclass(frozen=True, eq=False)
class Overlap(Step):
    """A producer/consumer chain run pipelined by `chunks`."""
    stages: tuple[Node, ...]
    chunks: int

    def __str__(self):
        return f"overlap({_names(self.stages)}, chunks={self.chunks})"


@dataclass(frozen=True, eq=False)
class Plan:
    program: Program
    steps: tuple[Step, ...]

    def __str__(self) -> str:
        lines = [f"plan {self.program.name} ({len(self.steps)} steps)"]
        lines += [f"  {i:>2}: {s}" for i, s in enumerate(self.steps)]
        return "\n".join(lines)
