"""Leaf module of the DSL: layouts, reduce ops, dtypes and the DslError. Imported by everything; of ours it imports only
the shared ReduceOp (cocosync.reduce_op, which the transport layer uses too)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from cocosync.reduce_op import ReduceOp  # noqa: F401 - re-exported: the DSL's reduce ops are the runtime's

float32, float16, bfloat16 = torch.float32, torch.float16, torch.bfloat16
#: dtypes a program tensor may have (bool only appears as the result of comparisons).
FLOAT_DTYPES = (float32, float16, bfloat16)
DTYPE_SHORT = {float32: "f32", float16: "f16", bfloat16: "bf16", torch.bool: "bool"}


class DslError(ValueError):
    """A program is ill-formed: the message names the op, the operands and what was expected."""


class LayoutKind(enum.Enum):
    LOCAL = "L"  # each rank holds its own, independent values (e.g. its gradient before reduction)
    REPLICATED = "R"  # every rank of the group holds the same values
    SLICED = "S"  # rank i of the group holds the i-th contiguous part along `dim` (or of the flattened tensor)


#: Sliced(FLAT): rank i holds the i-th of G equal parts of the tensor's elements in row-major order (CoCoNeT slices
#: flat), for shapes where no dimension divides by the group size but the element count does
FLAT = "flat"


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a tensor's values live across the ranks of a group. Prints short: L, R, S[0], S[flat]."""

    kind: LayoutKind
    dim: int | str | None = None

    def __post_init__(self) -> None:
        if (self.kind is LayoutKind.SLICED) != (self.dim is not None):
            raise DslError(f"Layout {self.kind.name}: dim must be given for SLICED and only for it, got dim={self.dim}")
        if self.dim is not None and self.dim != FLAT and not (isinstance(self.dim, int) and self.dim >= 0):
            raise DslError(f"Sliced(dim={self.dim!r}): dim must be an int >= 0 or {FLAT!r}")

    @property
    def is_flat(self) -> bool:
        return self.dim == FLAT

    @property
    def is_local(self) -> bool:
        return self.kind is LayoutKind.LOCAL

    @property
    def is_replicated(self) -> bool:
        return self.kind is LayoutKind.REPLICATED

    @property
    def is_sliced(self) -> bool:
        return self.kind is LayoutKind.SLICED

    def __str__(self) -> str:
        return f"S[{self.dim}]" if self.is_sliced else self.kind.value

    __repr__ = __str__


Local = Layout(LayoutKind.LOCAL)
Replicated = Layout(LayoutKind.REPLICATED)


def Sliced(dim: int | str = 0) -> Layout:  # noqa: N802 - reads like the paper's layout name
    """Rank i of the group holds the i-th contiguous part of the tensor along `dim` (FLAT: of its elements)."""
    return Layout(LayoutKind.SLICED, dim)


def slice_count(shape: tuple[int, ...], layout: Layout) -> int:
    """The length that the group size must divide: the sliced dim's size, or the element count for FLAT."""
    if layout.is_flat:
        n = 1
        for d in shape:
            n *= d
        return n
    return shape[layout.dim]


def local_shape_of(shape: tuple[int, ...], layout: Layout, gsize: int) -> tuple[int, ...]:
    """The shape of one rank's part (a FLAT part is 1-D)."""
    if not layout.is_sliced:
        return tuple(shape)
    if layout.is_flat:
        return (slice_count(shape, layout) // gsize,)
    out = list(shape)
    out[layout.dim] //= gsize
    return tuple(out)


def part_of(whole: torch.Tensor, layout: Layout, gsize: int, index: int) -> torch.Tensor:
    """Part `index` of a whole Sliced tensor (a view where it can be)."""
    if layout.is_flat:
        return whole.reshape(-1).chunk(gsize)[index]
    return whole.chunk(gsize, dim=layout.dim)[index]


def as_layout(layout: object) -> Layout:
    """Accept Local, Replicated, Sliced(d) and the bare function Sliced (meaning Sliced(0))."""
    if layout is Sliced:
        return Sliced(0)
    if isinstance(layout, Layout):
        return layout
    raise DslError(f"layout must be Local, Replicated or Sliced(dim), got {layout!r}")


def parse_reduce_op(op: "ReduceOp | str") -> ReduceOp:
    """ReduceOp.parse with the DSL's error type."""
    try:
        return ReduceOp.parse(op)
    except ValueError as e:
        raise DslError(str(e)) from None
