"""overlap(stages, chunks): pipeline a producer/consumer chain by chunks, so communication of chunk i overlaps
computation (or other communication) of chunk i+1: matmul -> all_reduce/reduce_scatter -> epilogue, or send ->
all_reduce. Recorded as a `Group('overlap', ..., chunks=k)`; values do not change."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from cocosync.dsl.ir import Group, Node, Program
from cocosync.dsl.registry import OPS, names
from cocosync.schedule._rewrite import Ref, resolve
from cocosync.schedule.errors import ScheduleError
from cocosync.schedule.fuse import check_convex, group_members

#: ops that cannot be cut into chunks (they reduce a whole tensor to a scalar)
UNCHUNKABLE = names(lambda d: not d.chunkable)


def overlap(program: Program, stages: Sequence[Ref], *, chunks: int = 4) -> Program:
    """A chain of stages, or of whole fuse groups (naming one stage of a fuse group takes all of it: CoCoNeT's
    overlap(matmul, fuse(rs, c, ag))), each reading the one before, as one pipelined group."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ScheduleError("overlap", None, f"chunks must be a positive int, got {chunks!r}")
    if isinstance(stages, (str, Node)):
        stages = [stages]
    named = [resolve(program, ref, "overlap").name for ref in stages]
    fused = [g.stages for g in program.groups if g.kind == "fuse" and set(g.stages) & set(named)]
    members = group_members(program, [*named, *(n for g in fused for n in g)], "overlap", min_size=2)
    units = chain_units(program, members, fused)
    for prev, cur in zip(units, units[1:]):
        if not any(a.name in prev for n in cur for a in program.stage(n).args):
            raise ScheduleError("overlap", cur[0], f"does not read {prev[-1]!r}; overlap pipelines a "
                                "producer/consumer chain, each stage (or fuse group) reading the one before")
    for m in members:
        if not OPS[m.op].chunkable:
            raise ScheduleError("overlap", m.name, f"is a {m.op} (a whole-tensor reduction); it cannot run by chunks")
    if not any(OPS[m.op].communicates for m in members):
        raise ScheduleError("overlap", members[0].name, "the chain has no communication; overlap hides "
                            "communication behind computation (use fuse for computations)")
    check_convex(program, members, "overlap")
    group = Group("overlap", tuple(n for u in units for n in u), (("chunks", chunks),))
    return dataclasses.replace(program, groups=(*program.groups, group))


def chain_units(program: Program, members: list[Node], fused: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The chain's units in pipeline order: each fuse group is one unit (its stages in program order), every other
    stage its own. A unit's place is its first stage that reads another unit (a fuse group's scatter of an input may
    come first in program order, but the group starts where it reads the chain)."""
    pos = {s.name: i for i, s in enumerate(program.stages)}
    unit_of = {n: tuple(sorted(g, key=pos.__getitem__)) for g in fused for n in g}
    units = list(dict.fromkeys(unit_of.get(m.name, (m.name,)) for m in members))
    inside = {m.name for m in members}

    def entry(u: tuple[str, ...]) -> int:
        reads = [pos[n] for n in u if any(a.name in inside and a.name not in u for a in program.stage(n).args)]
        return min(reads) if reads else pos[u[0]]
    return sorted(units, key=entry)
