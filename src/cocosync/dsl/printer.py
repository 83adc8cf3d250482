"""Readable listings: one stage per line with shape, dtype and short layout (L, R, S[0])."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cocosync.dsl.registry import OPS
from cocosync.dsl.types import DTYPE_SHORT, ReduceOp

if TYPE_CHECKING:
    from cocosync.dsl.ir import Node, Program


def type_str(n: "Node") -> str:
    dt = DTYPE_SHORT.get(n.dtype, str(n.dtype))
    shape = f"[{', '.join(map(str, n.shape))}]" if n.shape else ""
    return f"{dt}{shape} {n.layout}"


def _ref(n: "Node") -> str:
    if n.op == "const":
        v = n.attr("value")
        return repr(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(v)
    return n.name or "?"


def _attr_str(k: str, v: object) -> str:
    if isinstance(v, ReduceOp):
        return v.value
    if k == "to":
        return DTYPE_SHORT.get(v, str(v))
    if k == "sizes" and len(v) > 4:  # segment_norm over many parameter tensors
        return f"sizes=({v[0]}, {v[1]}, ..., {v[-1]}: {len(v)} segments)"
    return f"{k}={v}"


def expr_str(n: "Node") -> str:
    sym = OPS[n.op].symbol
    if sym and len(n.args) == 2:
        return f"{_ref(n.args[0])} {sym} {_ref(n.args[1])}"
    parts = [_ref(a) for a in n.args]
    parts += [_attr_str(k, v) for k, v in n.attrs if not (k == "groups" and v == 1)]
    return f"{n.op}({', '.join(parts)})"


def format_program(p: "Program") -> str:
    head = ", ".join(f"{n.name}: {type_str(n)}" for n in p.inputs)
    lines = [f"program {p.name}({head})"]
    width = max((len(s.name) for s in p.stages), default=0)
    exprs = [expr_str(s) for s in p.stages]
    ew = max((len(e) for e in exprs), default=0)
    for s, e in zip(p.stages, exprs):
        lines.append(f"  {s.name:<{width}} = {e:<{ew}}  : {type_str(s)}")
    for g in p.groups:
        extra = "".join(f" {k}={v}" for k, v in g.attrs)
        lines.append(f"  {g.kind}({', '.join(g.stages)}){extra}")
    outs = [o.name if o.name == nm else f"{nm}={o.name}" for nm, o in zip(p.output_names, p.outputs)]
    lines.append(f"  return {', '.join(outs)}")
    return "\n".join(lines)
