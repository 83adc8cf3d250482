"""fuse(stages): run a connected group as one kernel, or as one fused collective (CoCoNeT's FusedAllReduce) when
it holds reduce_scatter -> computations on slices -> all_gather. Recorded as a `Group('fuse', ...)` annotation:
the program's values do not change; the lowering turns the group into one step."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from cocosync.dsl.ir import Group, Node, Program
from cocosync.dsl.registry import OPS, names
from cocosync.schedule._rewrite import Ref, connected, graph, outside_path, resolve
from cocosync.schedule.endpoints import between, fused_collective_closure
from cocosync.schedule.errors import ScheduleError
from cocosync.schedule.reorder import reorder
from cocosync.schedule.split import split

#: computations a fused kernel may hold (matmul stays its own kernel; scatter is a local slice, no communication)
#: ops besides the elementwise ones that a fuse group may hold
FUSABLE = names(lambda d: d.fusable and not d.elementwise)


def group_members(program: Program, stages: Sequence[Ref], directive: str, *, min_size: int = 1) -> list[Node]:
    """Resolve, de-duplicate and order the stages of a group; check they are not in another group already."""
    if isinstance(stages, (str, Node)):
        stages = [stages]
    members: list[Node] = []
    for ref in stages:
        s = resolve(program, ref, directive)
        if s.op == "input":
            raise ScheduleError(directive, s.name, "is a program input, not a stage")
        if all(s is not x for x in members):
            members.append(s)
    if len(members) < min_size:
        raise ScheduleError(directive, members[0].name if members else None,
                            f"a group needs at least {min_size} stages, got {[m.name for m in members]}")
    mine = {m.name for m in members}
    for g in program.groups:
        if not mine & set(g.stages) or _nests(directive, g, mine):
            continue
        m = next(m for m in members if m.name in g.stages)
        raise ScheduleError(directive, m.name, f"is already in group {g.kind}({', '.join(g.stages)}); a stage "
                            "belongs to at most one group, except a whole fuse group inside an overlapped chain "
                            "(fuse first, then overlap, as CoCoNeT's ol_MM_fuse_RS_C_AG)")
    order = {id(s): i for i, s in enumerate(program.stages)}
    members.sort(key=lambda s: order[id(s)])
    return members


def _nests(directive: str, g: Group, mine: set[str]) -> bool:
    """A fuse group nests inside an overlap chain (CoCoNeT's ol_MM_fuse_RS_C_AG): one unit of the pipeline."""
    if directive == "overlap" and g.kind == "fuse":
        return set(g.stages) <= mine
    if directive == "fuse" and g.kind == "overlap":
        return mine <= set(g.stages)
    return False


def check_convex(program: Program, members: list[Node], directive: str) -> None:
    args, users = graph(program)
    names = [m.name for m in members]
    parts = connected(names, args)
    if len(parts) > 1:
        raise ScheduleError(directive, sorted(parts[1])[0], f"is not connected to {sorted(parts[0])[0]!r}; a group "
                            f"must be connected (components: {[sorted(p) for p in parts]})")
    hit = outside_path(names, args, users)
    if hit is not None:
        a, x, b = hit
        raise ScheduleError(directive, x, f"reads {a!r} and is read by {b!r} but is outside the group: fusing "
                            f"would form a cycle (add {x!r} to the group, or fuse less)")


def fuse(program: Program, stages: Sequence[Ref]) -> Program:
    """The named stages and those between them (schedule/endpoints.py) as one group."""
    if isinstance(stages, (str, Node)):
        stages = [stages]
    named = [resolve(program, ref, "fuse").name for ref in stages]
    reductions = [n for n in named if program.stage(n).op == "all_reduce"]
    if len(reductions) == 1 and len(named) > 1:
        program, named = _split_for_fuse(program, reductions[0], named)
    stages = fused_collective_closure(program, between(program, named))
    members = group_members(program, stages, "fuse", min_size=2)
    check_convex(program, members, "fuse")
    comm = [m for m in members if OPS[m.op].communicates]
    for m in members:
        if not (OPS[m.op].fusable or OPS[m.op].communicates):
            raise ScheduleError("fuse", m.name, f"is a {m.op}; a fused kernel holds elementwise computations "
                                f"(and {', '.join(FUSABLE)})")
    kind = "kernel"
    if comm:
        rs = [m for m in comm if m.op == "reduce_scatter"]
        ag = [m for m in comm if m.op == "all_gather"]
        bad = [m for m in comm if m.op not in ("reduce_scatter", "all_gather")]
        if bad or len(rs) != 1 or len(ag) != 1:
            who = (bad or comm)[0]
            raise ScheduleError("fuse", who.name, f"is a {who.op}; a fused group holds computations only, or exactly "
                                "one reduce_scatter -> computations on slices -> one all_gather (a FusedAllReduce); "
                                f"got communication {[f'{m.name}: {m.op}' for m in comm]}")
        rs, ag = rs[0], ag[0]
        for m in members:
            if m is not rs and m.layout.is_local:
                raise ScheduleError("fuse", m.name, f"is Local; the computations of fused collective {rs.name!r} -> "
                                    f"{ag.name!r} run on slices")
        for m in members:
            if m.op != "update" and any(ag is a for a in m.args):
                raise ScheduleError("fuse", m.name, f"reads all_gather {ag.name!r} inside the group; the all_gather "
                                    "ends a fused collective (only updates may write its result)")
        kind = "collective"
    group = Group("fuse", tuple(m.name for m in members), (("kind", kind),))
    return dataclasses.replace(program, groups=(*program.groups, group))


def _split_for_fuse(program: Program, reduction: str, named: list[str]) -> tuple[Program, list[str]]:
    """fuse of an all_reduce with computations (CoCoNeT allows it): split it, move the named computations that read
    it onto slices (reorder), and fuse reduce_scatter -> those -> all_gather, a fused all-reduce."""
    program, rs, ag = split(program, reduction)
    readers = [n for n in named if n != reduction]
    try:
        program = reorder(program, readers, ag)
    except ScheduleError as e:
        raise ScheduleError("fuse", reduction, f"is an all_reduce fused with computations, which splits it and moves "
                            f"them onto slices; that move failed: {e}") from None
    gathers = [st.name for st in program.stages if st.op == "all_gather" and st.name != ag]
    return program, [rs, *readers, *gathers]
