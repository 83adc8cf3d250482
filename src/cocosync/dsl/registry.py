"""One definition per op (JAX's primitives, tinygrad's op sets): its kind and every property a pass asks about.

Passes ask the registry (`OPS[op].movable`, `names(lambda d: d.chunkable)`) instead of keeping their own string
tuples, and the interpreter, the executor and the printer each have one rule per op, keyed by name;
tests/dsl/test_registry.py checks that every op here has each of them, so an op added here and missed elsewhere
fails at test time instead of when that path first runs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

__all__ = ["OpKind", "OpDef", "OPS", "names"]


class OpKind(enum.Enum):
    LEAF = "leaf"  # a program input or a constant: nothing is computed
    ELEMENTWISE = "elementwise"  # pointwise over broadcast operands: fusable into one generated kernel
    COMPUTE = "compute"  # other local computation (matmul)
    REDUCTION = "reduction"  # over the whole tensor or per segment (norm, segment_norm, reduce_tensor)
    STATE = "state"  # writes a program state when the program finishes (update)
    SLICE = "slice"  # keeps this rank's part of a Replicated value, without communicating (scatter)
    COMMUNICATES = "communicates"  # moves data between ranks (the collectives and send)


@dataclass(frozen=True, slots=True, kw_only=True)
class OpDef:
    name: str
    kind: OpKind
    symbol: str | None = None
    """Infix symbol for the printer and for Python operators ('+')."""
    comparison: bool = False
    """A boolean-valued elementwise comparison (an operand of `where`)."""
    fusable: bool = False
    """May join a `fuse` group (elementwise ops always may)."""
    movable: bool = False
    """`reorder` may move it onto slices after an all_gather (elementwise ops always may)."""
    whole_tensor: bool = False
    """Reduces the whole tensor to a scalar whatever the operand's layout (`as_slice` lets it read a slice)."""
    norm: bool = False
    """An L2 norm (whole or per segment): a fused collective computes it between phases."""
    chunkable: bool = True
    """May sit inside an `overlap` group (its values can be computed chunk by chunk)."""
    zero_preserving: bool = False
    """Zero operands on every rank give zeros (runtime.reference.prune skips it where its operand is known zero)."""
    in_kernels: bool = False
    """Generated kernels (runtime.steps.codegen) compute it."""
    scalar_fn: str | None = None
    """torch function taking a Python number for a constant operand (torch.maximum rejects one: clamp_min)."""
    cut_like_output: bool = False
    """One operand of the stage's shape, cut into chunks exactly as the stage (overlap step)."""
    pipelined: bool = False
    """A collective the overlap step runs chunk by chunk on its communication thread."""
    collective: str | None = None
    """The shared-memory communicator's collective that implements it (runtime.comm's wire protocol names)."""

    @property
    def elementwise(self) -> bool:
        return self.kind is OpKind.ELEMENTWISE

    @property
    def communicates(self) -> bool:
        return self.kind is OpKind.COMMUNICATES


OPS: dict[str, OpDef] = {}


def _def(kind: OpKind, *ops: str, **props) -> None:
    for op in ops:
        if op in OPS:
            raise ValueError(f"op {op!r} is defined twice")
        if kind is OpKind.ELEMENTWISE:
            props = {"fusable": True, "movable": True, **props}
        OPS[op] = OpDef(name=op, kind=kind, **props)


_def(OpKind.LEAF, "input", "const")
_def(OpKind.ELEMENTWISE, "neg", "abs", "sqrt", "rsqrt", "exp", "log", "where", in_kernels=True)
_def(OpKind.ELEMENTWISE, "cast", in_kernels=True, zero_preserving=True, cut_like_output=True)
_def(OpKind.ELEMENTWISE, "dropout", cut_like_output=True)  # its mask depends on the rank and the whole shape
_def(OpKind.ELEMENTWISE, "maximum", in_kernels=True, scalar_fn="clamp_min")
_def(OpKind.ELEMENTWISE, "minimum", in_kernels=True, scalar_fn="clamp_max")
for _op, _sym in {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**"}.items():
    _def(OpKind.ELEMENTWISE, _op, symbol=_sym, in_kernels=True)
for _op, _sym in {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}.items():
    _def(OpKind.ELEMENTWISE, _op, symbol=_sym, comparison=True, in_kernels=True)
_def(OpKind.COMPUTE, "matmul")
_def(OpKind.REDUCTION, "norm", fusable=True, movable=True, whole_tensor=True, norm=True, chunkable=False)
_def(OpKind.REDUCTION, "segment_norm", fusable=True, movable=True, norm=True, chunkable=False)
_def(OpKind.REDUCTION, "reduce_tensor", fusable=True, movable=True, whole_tensor=True, chunkable=False)
_def(OpKind.STATE, "update", fusable=True, movable=True, in_kernels=True)
_def(OpKind.SLICE, "scatter", fusable=True, zero_preserving=True, cut_like_output=True)
for _op in ("all_reduce", "reduce_scatter", "all_gather"):
    _def(OpKind.COMMUNICATES, _op, zero_preserving=True, pipelined=True, collective=_op)
for _op in ("broadcast", "reduce"):
    _def(OpKind.COMMUNICATES, _op, zero_preserving=True, collective=_op)
_def(OpKind.COMMUNICATES, "send", movable=True, pipelined=True)  # point to point: always torch.distributed


def names(pred: Callable[[OpDef], bool]) -> tuple[str, ...]:
    """The ops whose definition satisfies `pred`, in definition order (e.g. `names(lambda d: d.norm)`)."""
    return tuple(d.name for d in OPS.values() if pred(d))
