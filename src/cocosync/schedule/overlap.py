"""overlap(stages, chunks): pipeline a producer/consumer chain by chunks, so communication of chunk i overlaps
computation (or other communication) of chunk i+1: matmul -> all_reduce/reduce_scatter -> epilogue, or send ->
all_reduce. Recorded as a `Group('overlap', ..., chunks=k)`; values do not change."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from cocosync.dsl.ir import Group, Program
from cocosync.dsl.registry import OPS, names
from cocosync.schedule._rewrite import Ref
from cocosync.schedule.errors import ScheduleError
from cocosync.schedule.fuse import check_convex, group_members

#: ops that cannot be cut into chunks (they reduce a whole tensor to a scalar)
UNCHUNKABLE = names(lambda d: not d.chunkable)


def overlap(program: Program, stages: Sequence[Ref], *, chunks: int = 4) -> Program:
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ScheduleError("overlap", None, f"chunks must be a positive int, got {chunks!r}")
    members = group_members(program, stages, "overlap", min_size=2)
    for prev, cur in zip(members, members[1:]):
        if all(a is not prev for a in cur.args):
            raise ScheduleError("overlap", cur.name, f"does not read {prev.name!r}; overlap pipelines a "
                                "producer/consumer chain, each stage reading the one before")
    for m in members:
        if not OPS[m.op].chunkable:
            raise ScheduleError("overlap", m.name, f"is a {m.op} (a whole-tensor reduction); it cannot run by chunks")
    if not any(OPS[m.op].communicates for m in members):
        raise ScheduleError("overlap", members[0].name, "the chain has no communication; overlap hides "
                            "communication behind computation (use fuse for computations)")
    check_convex(program, members, "overlap")
    group = Group("overlap", tuple(m.name for m in members), (("chunks", chunks),))
    return dataclasses.replace(program, groups=(*program.groups, group))
