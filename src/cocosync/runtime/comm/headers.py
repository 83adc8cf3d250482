"""The header every shared-memory collective publishes with its first barrier, and the cross-rank check of it.

Segment/offset (-1 when the data is not in the arena) may differ across ranks; everything else must agree, or the
ranks called different collectives (or the same one with different arguments or settings).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cocosync.reduce_op import ReduceOp
from cocosync.runtime.comm.reduction import REDUCE_OPS, SUPPORTED_DTYPES

__all__ = ["Header", "header", "validate", "COLLECTIVES", "TagMismatch"]

#: the collectives of the wire protocol (a header's first word is the index + 1); the DSL registry's
#: `OpDef.collective` names one of these
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "fused_all_reduce", "barrier")
_COLL_CODE = {name: i + 1 for i, name in enumerate(COLLECTIVES)}
_DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(SUPPORTED_DTYPES)}
_CODE_DTYPE = {v: k for k, v in _DTYPE_CODE.items()}
_OP_CODE = {op: i + 1 for i, op in enumerate(REDUCE_OPS)}


class Header(NamedTuple):
    """One rank's header words for a call."""

    collective: int  # 1 + index in COLLECTIVES
    dtype: int  # 1 + index in SUPPORTED_DTYPES
    numel: int
    op: int  # 1 + index in REDUCE_OPS
    root: int  # -1 where the collective has none
    segment: int  # arena segment of the data, -1 when it is not in the arena (copied into the workspace)
    offset: int  # byte offset in that segment
    chunk_bytes: int  # the communicator's settings: they must agree across ranks
    one_shot_bytes: int
    tag: int  # the caller's signature of what it computes (e.g. a hash of a program's scalar inputs), 0 if none

    def agrees(self, other: "Header") -> bool:
        """Everything but where the data lives is the same."""
        return self[:5] == other[:5] and self[7:] == other[7:]


class TagMismatch(ValueError):
    """The ranks called the same collective with different caller tags (e.g. different hyperparameters)."""


def header(name: str, dtype: torch.dtype, numel: int, op: ReduceOp, root: int, segment: int, offset: int,
           settings: tuple[int, int], tag: int = 0) -> list[int]:
    """The words this rank publishes for collective `name` (its first word; e.g. 'all_reduce (copied in)')."""
    return [_COLL_CODE[name.split(" ")[0]], _DTYPE_CODE[dtype], numel, _OP_CODE[op], root, segment, offset, *settings,
            tag]


def validate(name: str, seq: int, hdrs: list[Header], me: int, global_ranks: list[int]) -> None:
    """Raise an error naming the ranks when the local ranks' headers of call `seq` disagree."""
    mine = hdrs[me]
    if all(h.agrees(mine) for h in hdrs):
        return  # the common case; the messages below are built only on a mismatch
    g = global_ranks
    for peer, h in enumerate(hdrs):
        if h.collective != mine.collective:
            called = COLLECTIVES[h.collective - 1] if 0 < h.collective <= len(COLLECTIVES) else "?"
            raise RuntimeError(f"{name} (call #{seq}): ranks called different collectives: global rank {g[peer]} "
                               f"called {called}, global rank {g[me]} called {name}")
    desc = ", ".join(f"rank {g[peer]}: {h.numel} x {_CODE_DTYPE.get(h.dtype)}" for peer, h in enumerate(hdrs))
    if any(h.dtype != mine.dtype for h in hdrs):
        raise TypeError(f"{name} (call #{seq}): dtype differs across ranks ({desc})")
    if any(h.numel != mine.numel for h in hdrs):
        raise ValueError(f"{name} (call #{seq}): number of elements differs across ranks ({desc})")
    if any(h.op != mine.op for h in hdrs):
        ops = ", ".join(f"rank {g[peer]}: {REDUCE_OPS[h.op - 1].value}" for peer, h in enumerate(hdrs))
        raise ValueError(f"{name} (call #{seq}): reduce op differs across ranks ({ops})")
    if any(h.tag != mine.tag for h in hdrs):
        tags = ", ".join(f"rank {g[peer]}: {h.tag:#x}" for peer, h in enumerate(hdrs))
        raise TagMismatch(f"{name} (call #{seq}): the callers' tags differ across ranks ({tags})")
    if any(h[7:9] != mine[7:9] for h in hdrs):
        cb = ", ".join(f"rank {g[peer]}: {h.chunk_bytes}/{h.one_shot_bytes}" for peer, h in enumerate(hdrs))
        raise ValueError(f"{name} (call #{seq}): ShmCommunicator chunk_bytes/one_shot_bytes differ across ranks ({cb})")
    if any(h.root != mine.root for h in hdrs):
        roots = ", ".join(f"rank {g[peer]}: {h.root}" for peer, h in enumerate(hdrs))
        raise ValueError(f"{name} (call #{seq}): root differs across ranks ({roots})")
