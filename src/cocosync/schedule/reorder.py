"""reorder(computations, all_gather): run computations that consume an all_gather on its slices, before it.

Representation (documented once here, relied on by as_slice and fuse):

* the all_gather `ag = all_gather(x)` (x Sliced, typically a reduce_scatter) is read by the moved computations as
  `x` itself: a moved computation computes its value on this rank's slice (layout S[d]);
* a Replicated operand of a moved computation that lines up with the sliced dim becomes `scatter(a)` (named
  `a_s`, shared by all readers); scalars and operands broadcast along the sliced dim stay Replicated; slices that
  are flat (runs of elements) line up only with operands of the full shape (a broadcast operand is an error);
* a moved value still read as Replicated afterwards (by a stage that was not moved, or as a program output) gets
  its own `all_gather` (named `<value>_ag`);
* `update(w, value)` of a Replicated state w moves as `update(w, all_gather(value_slice))` (w stays Replicated; its
  new value is gathered), and readers of the updated w among the moved computations read `value_slice`. After
  `as_slice(w)` it becomes `update(w, value_slice)` with w Sliced state;
* norm and reduce_tensor of a moved value read the slice: their Sliced semantics are global, the result is the
  same Replicated scalar; segment_norm (per-element, like an elementwise op) of a slice is the slice of the
  segment norms, and of a Replicated input it reads `scatter(input)`; `send` of a slice sends each rank's slice
  (send(all_gather(x)) == all_gather(send(x))).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from cocosync.dsl import ops
from cocosync.dsl.ir import Node, Program
from cocosync.dsl.registry import OPS, names
from cocosync.dsl.types import FLAT, DslError
from cocosync.schedule._rewrite import Namer, Ref, connected, finish, graph, named, names_of, resolve
from cocosync.schedule.endpoints import between_readers
from cocosync.schedule.errors import ScheduleError

#: ops that reorder moves onto slices besides the elementwise ones
MOVABLE = names(lambda d: d.movable and not d.elementwise)


def reorder(program: Program, computations: Sequence[Ref], all_gather: Ref) -> Program:
    ag = resolve(program, all_gather, "reorder")
    if ag.op != "all_gather":
        raise ScheduleError("reorder", ag.name, f"is a {ag.op}, not an all_gather; reorder moves computations "
                            "before an all_gather (split an all_reduce first)")
    comps = _members(program, computations, ag)
    src = ag.args[0]
    d0 = src.layout.dim
    order = {id(s): i for i, s in enumerate(program.stages)}
    comps.sort(key=lambda c: order[id(c)])
    moved = {id(c) for c in comps}
    users = program.users()
    outs = {id(o) for o in program.outputs}
    live_out = {id(c) for c in comps if id(c) in outs or any(id(u) not in moved for u in users[c.name])}
    fresh = Namer(names_of(program))
    sl: dict[int, Node] = {id(ag): src}  # old stage -> its value on slices
    new: dict[int, Node] = {}  # old stage -> what readers outside the moved set read
    scattered: dict[int, Node] = {}
    gathered: dict[int, Node] = {}

    def gather(x: Node, who: Node) -> Node:
        if id(x) not in gathered:
            try:
                g = ops.all_gather(x, groups=ag.attr("groups"))
            except DslError as e:
                raise ScheduleError("reorder", who.name, f"is needed as Replicated after the move, but its slice "
                                    f"cannot be gathered: {e}") from None
            gathered[id(x)] = named(g, fresh(f"{x.name}_ag"))
        return gathered[id(x)]

    def scatter(a: Node, dim: int) -> Node:
        if id(a) not in scattered:
            scattered[id(a)] = named(ops.scatter(a, dim=dim, groups=ag.attr("groups")), fresh(f"{a.name}_s"))
        return scattered[id(a)]

    for c in program.stages:
        if id(c) not in moved:  # a stage that is not moved reads moved values through their gathers
            args = tuple(new.get(id(a), a) for a in c.args)
            new[id(c)] = c if all(x is y for x, y in zip(args, c.args)) else dataclasses.replace(c, args=args)
            continue
        args = [sl[id(a)] if id(a) in sl else new.get(id(a), a) for a in c.args]
        for a, old in zip(args, c.args):
            if a.layout.is_local:
                raise ScheduleError("reorder", c.name, f"reads the Local tensor {old.name!r}; reorder cannot move a "
                                    "computation through a Local tensor (a Local value cannot meet a slice)")
        if c.op == "update":
            state, value = args
            if value.layout.is_sliced and value.layout != state.layout:
                if state.layout.is_sliced:
                    raise ScheduleError("reorder", c.name, f"writes state {state.name!r} ({state.layout}) with a "
                                        f"value sliced as {value.layout}")
                value = gather(value, c)
            out = dataclasses.replace(c, args=(state, value))
            sl[id(c)], new[id(c)] = args[1], out
            continue
        if c.op == "send":
            out = dataclasses.replace(c, args=tuple(args), layout=args[0].layout)
        elif c.op in ("norm", "reduce_tensor"):
            out = dataclasses.replace(c, args=tuple(args))
        elif c.op == "segment_norm":  # per element, like an elementwise op: on slices its value is the slice
            if args[0].layout.is_replicated and args[0].shape == ag.shape:
                args[0] = scatter(args[0], d0)
            out = dataclasses.replace(c, args=tuple(args), layout=args[0].layout)
        else:
            if d0 == FLAT:  # a flat slice lines up only with operands of the full shape
                args = [scatter(a, FLAT) if a.layout.is_replicated and a.ndim and a.shape == c.shape else a
                        for a in args]
            ds = -1 if d0 == FLAT else d0 + c.ndim - ag.ndim
            if 0 <= ds < c.ndim and c.shape[ds] == ag.shape[d0]:
                for i, a in enumerate(args):
                    k = ds - (c.ndim - a.ndim)
                    if a.layout.is_replicated and k >= 0 and a.shape[k] == c.shape[ds]:
                        args[i] = scatter(a, k)
            try:
                layout = ops._broadcast_layout(c.op, tuple(args), c.shape)
            except DslError as e:
                raise ScheduleError("reorder", c.name, f"cannot run on slices: {e}") from None
            out = dataclasses.replace(c, args=tuple(args), layout=layout)
        sl[id(c)] = out
        new[id(c)] = gather(out, c) if (out.layout.is_sliced and id(c) in live_out) else out
    return finish(program, new)


def _members(program: Program, computations: Sequence[Ref], ag: Node) -> list[Node]:
    if isinstance(computations, (str, Node)):
        computations = [computations]
    comps: list[Node] = []
    for ref in computations:
        c = resolve(program, ref, "reorder")
        if c.op == "input":
            raise ScheduleError("reorder", c.name, "is a program input, not a computation")
        if c is ag:
            raise ScheduleError("reorder", c.name, "is the all_gather itself; list the computations that read it")
        if not OPS[c.op].movable:
            raise ScheduleError("reorder", c.name, f"is a {c.op}; reorder moves elementwise computations (and "
                                f"{', '.join(MOVABLE)}) onto slices")
        if all(c is not x for x in comps):
            comps.append(c)
    if not comps:
        raise ScheduleError("reorder", ag.name, "no computations given")
    args, _ = graph(program)
    parts = connected([ag.name, *(c.name for c in comps)], args)
    if len(parts) > 1:  # endpoints: take the computations between the all_gather and them (schedule/endpoints.py)
        grown = [program.stage(n) for n in between_readers(program, ag.name, [c.name for c in comps])]
        if connected([ag.name, *(c.name for c in grown)], args)[1:] == [] and all(OPS[c.op].movable for c in grown):
            comps, parts = grown, [[ag.name]]
    if len(parts) > 1:
        stray = next(p for p in parts if ag.name not in p)
        raise ScheduleError("reorder", sorted(stray)[0], f"is not connected to all_gather {ag.name!r} through the "
                            "computations being reordered; reorder moves a connected set of its readers")
    return comps
