"""The chaining `Schedule` API and its directives.

    s = Schedule(program)
    rs, ag = s.split("g1")             # handles are stage names: they survive later passes
    s.reorder([...], ag)
    s.as_slice(["m", "v"])
    s.fuse([...])
    s.program                          # the transformed Program
    s.directives                       # frozen, printable directives; replay(program, s.directives) == s.program

Stages may be given as names or as the user's nodes (resolved through the program they were built into).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from cocosync.dsl.ir import Node, Program
from cocosync.dsl.registry import OPS
from cocosync.schedule._rewrite import Ref, resolve
from cocosync.schedule.as_slice import as_slice
from cocosync.schedule.dce import dce
from cocosync.schedule.fuse import fuse
from cocosync.schedule.overlap import overlap
from cocosync.schedule.reorder import reorder
from cocosync.schedule.split import split

__all__ = ["Schedule", "Directive", "Split", "Reorder", "AsSlice", "Fuse", "Overlap", "Dce", "replay"]


def _names(xs: Sequence[str]) -> str:
    return "[" + ", ".join(xs) + "]"


class Directive:
    """One schedule step; `apply(program) -> (program, result)`."""

    def apply(self, program: Program) -> tuple[Program, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class Split(Directive):
    """all_reduce -> reduce_scatter + all_gather along `dim`."""
    stage: str
    dim: int | str = 0

    def apply(self, program):
        p, rs, ag = split(program, self.stage, dim=self.dim)
        return p, (rs, ag)

    def __str__(self):
        return f"split({self.stage}{'' if self.dim == 0 else f', dim={self.dim!r}'})"


@dataclass(frozen=True)
class Reorder(Directive):
    """Move the computations that read `all_gather` onto its slices, before it."""
    computations: tuple[str, ...]
    all_gather: str

    def apply(self, program):
        return reorder(program, self.computations, self.all_gather), None

    def __str__(self):
        return f"reorder({_names(self.computations)}, {self.all_gather})"


@dataclass(frozen=True)
class AsSlice(Directive):
    """Keep Replicated state tensors Sliced."""
    tensors: tuple[str, ...]

    def apply(self, program):
        return as_slice(program, self.tensors), None

    def __str__(self):
        return f"as_slice({_names(self.tensors)})"


@dataclass(frozen=True)
class Fuse(Directive):
    """Run a connected group as one kernel or one fused collective."""
    stages: tuple[str, ...]

    def apply(self, program):
        return fuse(program, self.stages), None

    def __str__(self):
        return f"fuse({_names(self.stages)})"


@dataclass(frozen=True)
class Overlap(Directive):
    """Pipeline a producer/consumer chain by `chunks`."""
    stages: tuple[str, ...]
    chunks: int = 4

    def apply(self, program):
        return overlap(program, self.stages, chunks=self.chunks), None

    def __str__(self):
        return f"overlap({_names(self.stages)}, chunks={self.chunks})"


@dataclass(frozen=True)
class Dce(Directive):
    """Dead-stage elimination (keeping only the outputs `keep`, when given)."""
    keep: tuple[str, ...] | None = None

    def apply(self, program):
        return dce(program, self.keep), None

    def __str__(self):
        return "dce()" if self.keep is None else f"dce(keep={_names(self.keep)})"


def replay(program: Program, directives: Sequence[Directive]) -> Program:
    """Apply `directives` in order to `program`."""
    for d in directives:
        program, _ = d.apply(program)
    return program


class Schedule:
    """A program and the directives applied to it so far (each method applies one and records it)."""

    def __init__(self, program: Program, directives: Sequence[Directive] = ()):
        self.original = program
        self.program = program
        self.directives: list[Directive] = []
        for d in directives:
            self._apply(d)

    def _apply(self, d: Directive) -> Any:
        self.program, result = d.apply(self.program)
        self.directives.append(d)
        return result

    def _name(self, ref: Ref, directive: str) -> str:
        return ref if isinstance(ref, str) else resolve(self.program, ref, directive).name

    def _names(self, refs: Sequence[Ref] | Ref, directive: str) -> tuple[str, ...]:
        if isinstance(refs, (str, Node)):
            refs = [refs]
        return tuple(self._name(r, directive) for r in refs)

    def split(self, stage: Ref, *, dim: int | str = 0) -> tuple[str, str]:
        """Returns the names of the new (reduce_scatter, all_gather); dim=FLAT slices flat."""
        return self._apply(Split(self._name(stage, "split"), dim))

    def reorder(self, computations: Sequence[Ref], all_gather: Ref) -> "Schedule":
        return self._apply(Reorder(self._names(computations, "reorder"), self._name(all_gather, "reorder"))) or self

    def as_slice(self, tensors: Sequence[Ref] | Ref) -> "Schedule":
        return self._apply(AsSlice(self._names(tensors, "as_slice"))) or self

    def fuse(self, stages: Sequence[Ref]) -> "Schedule":
        return self._apply(Fuse(self._names(stages, "fuse"))) or self

    def overlap(self, stages: Sequence[Ref], *, chunks: int = 4) -> "Schedule":
        return self._apply(Overlap(self._names(stages, "overlap"), chunks)) or self

    def dce(self, keep: Sequence[str] | None = None) -> "Schedule":
        return self._apply(Dce(None if keep is None else tuple(keep))) or self

    def stages(self, *, after: str | None = None, ops: Sequence[str] | None = None) -> list[str]:
        """Names of the current program's stages (optionally only those with op in `ops`, or after stage `after`)."""
        names = [s.name for s in self.program.stages if ops is None or s.op in ops]
        if after is not None:
            order = [s.name for s in self.program.stages]
            names = [n for n in names if order.index(n) > order.index(after)]
        return names

    def movable(self, all_gather: Ref) -> list[str]:
        """The computations `reorder` can move before `all_gather`: every elementwise/norm/reduce_tensor/update/send
        stage that reads it (transitively), plus the Replicated tensor computations that only they read and that
        depend on inputs alone (like `beta1 * m`, or LAMB's per-tensor norms of w), so state tensors end up read
        only through slices."""
        p = self.program
        ag = resolve(p, all_gather, "reorder")
        ok = lambda s: OPS[s.op].movable  # noqa: E731
        down: set[int] = {id(ag)}
        for s in p.stages:
            if ok(s) and any(id(a) in down for a in s.args):
                down.add(id(s))
        pure: set[int] = set()  # Replicated tensor computations of inputs only
        for s in p.stages:
            if (OPS[s.op].elementwise or s.op == "segment_norm") and s.layout.is_replicated and all(
                    a.is_leaf and not a.layout.is_local or id(a) in pure for a in s.args):
                pure.add(id(s))
        users = p.users()
        extra: set[int] = set()
        for s in reversed(p.stages):
            if id(s) in pure and s.ndim and users[s.name] and all(
                    id(u) in down or id(u) in extra for u in users[s.name]) and not any(
                    o is s for o in p.outputs):
                extra.add(id(s))
        return [s.name for s in p.stages if (id(s) in down or id(s) in extra) and s is not ag]

    def chain(self, reduce_scatter: Ref, *, producer: bool = False) -> list[str] | None:
        """The stages an overlap pipelines: `reduce_scatter`, its only reader, that one's only reader, ... up to the
        first all_gather; None where the path branches or ends before one. `producer=True`: a matmul whose only
        reader is the reduce_scatter leads the chain (Megatron: the GEMM overlaps the communication)."""
        p = self.program
        rs = resolve(p, reduce_scatter, "overlap")
        users, chain = p.users(), [rs.name]
        src = rs.args[0]
        if producer and src.op == "matmul" and len(users.get(src.name, [])) == 1:
            chain.insert(0, src.name)
        while p.stage(chain[-1]).op != "all_gather":
            nxt = users.get(chain[-1], [])
            if len(nxt) != 1:
                return None
            chain.append(nxt[0].name)
        return chain

    def __str__(self) -> str:
        head = f"schedule of {self.original.name} ({len(self.directives)} directives)"
        return "\n".join([head, *(f"  {d}" for d in self.directives)])

    def __repr__(self) -> str:
        return f"Schedule({self.original.name!r}, {self.directives!r})"
