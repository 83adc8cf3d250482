"""as_slice(tensors): keep a Replicated state tensor Sliced (ZeRO-1 style sharded optimizer state).

After `reorder`, a Replicated state m is read only as `m_s = scatter(m)` and written as `update(m, all_gather(x))`
with x its new slice. as_slice re-declares the input m as Sliced(d): the caller passes only its slice, the
scatter disappears (readers read m), and the update writes the slice: `update(m, x)`. Readers of the updated m
outside the update (rare after reorder) read `all_gather(m_new)`. Whole-tensor reductions (norm, reduce_tensor)
may read m as it is: their value is the same for the Replicated tensor and for its slices (e.g. LAMB's ||w||).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from cocosync.dsl import ops
from cocosync.dsl.check import program_groups
from cocosync.dsl.ir import Node, Program
from cocosync.dsl.registry import OPS, names
from cocosync.dsl.types import Sliced
from cocosync.schedule._rewrite import Namer, Ref, finish, named, names_of, resolve
from cocosync.schedule.errors import ScheduleError

#: reductions to a scalar over the whole tensor, whatever its layout
WHOLE_TENSOR = names(lambda d: d.whole_tensor)


def as_slice(program: Program, tensors: Sequence[Ref]) -> Program:
    if isinstance(tensors, (str, Node)):
        tensors = [tensors]
    for t in tensors:
        program = _as_slice_one(program, t)
    return program


def _as_slice_one(program: Program, ref: Ref) -> Program:
    m = resolve(program, ref, "as_slice")
    if m.op != "input" or m.attr("kind") != "tensor":
        raise ScheduleError("as_slice", m.name, f"is a {m.op} stage; as_slice re-declares a Replicated tensor input")
    if not m.layout.is_replicated:
        raise ScheduleError("as_slice", m.name, f"is {m.layout}, not Replicated; only a Replicated tensor is kept "
                            "as slices")
    users = program.users()
    upd = program.updates.get(m.name)
    dims = set()
    for u in users[m.name]:
        if u.op == "scatter":
            dims.add(u.layout.dim)
        elif u is upd or OPS[u.op].whole_tensor:
            continue
        else:
            raise ScheduleError("as_slice", u.name, f"reads {m.name!r} as Replicated; as_slice({m.name}) needs every "
                                f"reader to read its slice (reorder {u.name!r} onto slices first)")
    if upd is not None:
        value = upd.args[1]
        if value.op == "all_gather":
            dims.add(value.args[0].layout.dim)
        elif value.ndim:
            raise ScheduleError("as_slice", upd.name, f"writes {m.name!r} with the Replicated value {value.name!r}; "
                                "reorder the update onto slices first (it then writes all_gather(slice))")
    if len(dims) > 1:
        raise ScheduleError("as_slice", m.name, f"is sliced along different dims {sorted(map(str, dims))} by its "
                            "readers")
    if not dims:
        raise ScheduleError("as_slice", m.name, "is never read or written as slices; nothing to keep sliced")
    dim = dims.pop()
    ms = dataclasses.replace(m, layout=Sliced(dim))
    new: dict[int, Node] = {id(m): ms}
    fresh = Namer(names_of(program))
    outputs: dict[int, Node] = {}
    for s in program.stages:
        if s.op == "scatter" and s.args[0] is m:
            new[id(s)] = ms
        elif s is upd:
            value = new.get(id(upd.args[1]), upd.args[1])
            if value.op == "all_gather":
                value = value.args[0]
            nu = dataclasses.replace(upd, args=(ms, value), layout=ms.layout)
            outputs[id(upd)] = nu
            new[id(s)] = named(ops.all_gather(nu, groups=program_groups(program)), fresh(f"{upd.name}_ag"))
        else:
            args = tuple(new.get(id(a), a) for a in s.args)
            new[id(s)] = s if all(x is y for x, y in zip(args, s.args)) else dataclasses.replace(s, args=args)
    return finish(program, new, outputs=outputs)
