"""Program -> Plan, as one function listing the passes in order (`dump=True` prints the state after each)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cocosync.dsl.check import check_program
from cocosync.dsl.ir import Node, Program
from cocosync.dsl.registry import OPS
from cocosync.lower.plan import Collective, FusedCollective, Kernel, Overlap, Plan, Step
from cocosync.schedule.dce import dce


@dataclass
class Unit:
    """A step being formed: kind is 'fuse:kernel', 'fuse:collective', 'overlap', 'comm' or 'compute'."""
    kind: str
    stages: list[Node]
    attrs: dict = field(default_factory=dict)

    def __str__(self):
        return f"{self.kind}({', '.join(s.name for s in self.stages)})"


def lower(program: Program | Any, dump: bool = False) -> Plan:
    """Lower a Program, or a Schedule's rewritten program (anything with `.program`). The passes, in order:
    1. check           the program is well-formed
    2. dce             dead stages and scatter(all_gather(x)) disappear
    3. form_units      each fuse/overlap group is one unit, every other stage its own
    4. order_units     units in a topological order of the unit graph (stable: earliest first stage first)
    5. merge_kernels   adjacent local units merge into one kernel (after a matmul: its epilogue)
    6. to_steps        units become Kernel / Collective / FusedCollective / Overlap steps
    """
    def show(name: str, what) -> None:
        if dump:
            print(f"--- after {name} ---")
            print(what if not isinstance(what, list) else "\n".join(f"  {u}" for u in what))

    program = getattr(program, "program", program)
    check_program(program)
    show("check", program)
    program = dce(program)
    show("dce", program)
    units = form_units(program)
    show("form_units", units)
    units = order_units(program, units)
    show("order_units", units)
    units = merge_kernels(units)
    show("merge_kernels", units)
    plan = Plan(program, tuple(to_steps(u) for u in units))
    show("to_steps", plan)
    return plan


def form_units(program: Program) -> list[Unit]:
    """One unit per group (a fuse group inside an overlapped chain is part of the overlap unit: `attrs['inner']`,
    its stages made contiguous in the chain), one per other stage."""
    by_name = {s.name: s for s in program.stages}
    units, grouped = [], set()
    overlaps = [g for g in program.groups if g.kind == "overlap"]
    nested = {g.stages: o.stages for g in program.groups if g.kind == "fuse"
              for o in overlaps if set(g.stages) <= set(o.stages)}
    for g in program.groups:
        attrs = dict(g.attrs)
        if g.kind == "fuse" and g.stages in nested:
            continue
        if g.kind == "overlap":
            inner = [Unit(f"fuse:{dict(f.attrs).get('kind', 'kernel')}", [by_name[n] for n in f.stages])
                     for f in program.groups if nested.get(f.stages) == g.stages]
            order: list[Node] = []
            for n in g.stages:  # chain order; each inner group whole where its first stage is
                u = next((u for u in inner if any(s.name == n for s in u.stages)), None)
                for s in (u.stages if u else [by_name[n]]):
                    if all(s is not o for o in order):
                        order.append(s)
            attrs["inner"] = [to_steps(u) for u in inner]
            units.append(Unit("overlap", order, attrs))
        else:
            kind = f"fuse:{attrs.get('kind', 'kernel')}" if g.kind == "fuse" else g.kind
            units.append(Unit(kind, [by_name[n] for n in g.stages], attrs))
        grouped.update(g.stages)
    for s in program.stages:
        if s.name not in grouped:
            units.append(Unit("comm" if OPS[s.op].communicates else "compute", [s]))
    return units


def order_units(program: Program, units: list[Unit]) -> list[Unit]:
    pos = {id(s): i for i, s in enumerate(program.stages)}
    owner = {id(s): k for k, u in enumerate(units) for s in u.stages}
    for u in units:
        if u.kind != "overlap":  # an overlap unit keeps its chain order (a valid order, checked by overlap())
            u.stages.sort(key=lambda s: pos[id(s)])
    deps = {k: {owner[id(a)] for s in u.stages for a in s.args if id(a) in owner} - {k} for k, u in enumerate(units)}
    done: list[int] = []
    left = set(range(len(units)))
    while left:
        ready = [k for k in left if not deps[k] - set(done)]
        if not ready:  # groups are checked acyclic when made; this guards hand-built programs
            raise ValueError(f"lower: the groups of {program.name!r} form a cycle: {[str(units[k]) for k in left]}")
        k = min(ready, key=lambda k: pos[id(units[k].stages[0])])
        done.append(k)
        left.remove(k)
    return [units[k] for k in done]


def merge_kernels(units: list[Unit]) -> list[Unit]:
    """Adjacent local units merge into one kernel; a matmul starts a new one and takes what follows as its
    epilogue (bias, activation: folded into the GEMM call at run time)."""
    out: list[Unit] = []
    for u in units:
        simple = u.kind == "compute" and u.stages[0].op != "matmul"
        if simple and out and out[-1].kind == "compute":
            out[-1].stages.extend(u.stages)
        else:
            out.append(Unit(u.kind, list(u.stages), dict(u.attrs)))
    return out


def to_steps(u: Unit) -> Step:
    if u.kind == "comm":
        return Collective(u.stages[0])
    if u.kind == "overlap":
        return Overlap(tuple(u.stages), int(u.attrs.get("chunks", 4)), tuple(u.attrs.get("inner", ())))
    if u.kind == "fuse:collective":
        rs = next(s for s in u.stages if s.op == "reduce_scatter")
        ag = next(s for s in u.stages if s.op == "all_gather")
        compute = tuple(s for s in u.stages if s is not rs and s is not ag)
        return FusedCollective(rs, compute, ag, tuple(u.stages))
    return Kernel(tuple(u.stages))
