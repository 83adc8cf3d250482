"""ReduceOp: how values are combined across ranks. A leaf module shared by the DSL and the transport layer
(runtime/comm imports nothing of the DSL), with the one table of what each op means in torch terms."""

from __future__ import annotations

import enum
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["ReduceOp"]

_ALIASES = {"+": "sum", "add": "sum", "avg": "mean"}


class ReduceOp(enum.Enum):
    SUM = "sum"  # elementwise sum over ranks
    MAX = "max"  # elementwise maximum over ranks
    MIN = "min"  # elementwise minimum over ranks
    MEAN = "mean"  # sum divided by the number of ranks in the group

    @classmethod
    def parse(cls, op: "ReduceOp | str") -> "ReduceOp":
        """A ReduceOp from itself, its value, an alias ('avg', 'add', '+') or a torch name ('ReduceOp.SUM');
        ValueError naming the accepted values otherwise."""
        if isinstance(op, ReduceOp):
            return op
        key = str(op).lower().rsplit(".", 1)[-1]
        try:
            return cls(_ALIASES.get(key, key))
        except ValueError:
            raise ValueError(f"unknown reduce op {op!r}; expected one of {[o.value for o in cls]}") from None

    @property
    def dist_op(self) -> dist.ReduceOp:
        """The torch.distributed op that combines partial values (MEAN sums; the caller divides by the count)."""
        return _DIST[self]

    @property
    def partial(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The torch reduction of one rank's values to a scalar, to be combined across ranks with `dist_op`
        (MEAN sums here too; divide by the element count once the partial sums are combined)."""
        return _PARTIAL[self]


_DIST = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MEAN: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX,
         ReduceOp.MIN: dist.ReduceOp.MIN}
_PARTIAL = {ReduceOp.SUM: torch.sum, ReduceOp.MEAN: torch.sum, ReduceOp.MAX: torch.amax, ReduceOp.MIN: torch.amin}
