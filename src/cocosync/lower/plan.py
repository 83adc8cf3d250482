"""A Plan: the ordered steps a rank runs, as plain data. Each step names its stages; runtime.executor runs a plan,
each step in its fast form where one applies (runtime.steps) and otherwise stage by stage (runtime.reference.stage)."""

from __future__ import annotations

from dataclasses import dataclass

from cocosync.dsl.ir import Node, Program

__all__ = ["Step", "Kernel", "Collective", "FusedCollective", "Overlap", "Plan"]


def _names(stages: tuple[Node, ...]) -> str:
    return ", ".join(s.name for s in stages)


class Step:
    """Base of the step kinds: `stages` in an order that runs them correctly one by one."""

    stages: tuple[Node, ...]


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
    """A producer/consumer chain run pipelined by `chunks`. `inner`: the fuse groups inside the chain (a fused
    collective runs as one communication unit per chunk: CoCoNeT's ol_MM_fuse_RS_C_AG)."""
    stages: tuple[Node, ...]
    chunks: int
    inner: tuple[Step, ...] = ()

    def __str__(self):
        parts, shown = [], set()
        for s in self.stages:
            step = next((i for i in self.inner if any(s is x for x in i.stages)), None)
            if step is None:
                parts.append(s.name)
            elif id(step) not in shown:
                shown.add(id(step))
                parts.append(str(step))
        return f"overlap({', '.join(parts)}, chunks={self.chunks})"


@dataclass(frozen=True, eq=False)
class Plan:
    program: Program
    steps: tuple[Step, ...]

    def __str__(self) -> str:
        lines = [f"plan {self.program.name} ({len(self.steps)} steps)"]
        lines += [f"  {i:>2}: {s}" for i, s in enumerate(self.steps)]
        return "\n".join(lines)
