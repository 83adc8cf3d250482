"""The header every shared-memory collective publishes with its first barrier, and the cross-rank check of it.

Words: [collective, dtype, numel, op, root, arena segment, offset, chunk_bytes, pipeline_bytes, one_shot_bytes].
Segment/offset (-1 when the data is not in the arena) may differ across ranks; everything else must agree, or the
ranks called different collectives (or the same one with different arguments or settings).
"""

from __future__ import annotations

from cocosync.reduce_op import ReduceOp
from cocosync.runtime.comm.reduction import REDUCE_OPS, SUPPORTED_DTYPES

__all__ = ["header", "validate"]

_DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(SUPPORTED_DTYPES)}
_CODE_DTYPE = {v: k for k, v in _DTYPE_CODE.items()}
_OP_CODE = {op: i + 1 for i, op in enumerate(REDUCE_OPS)}  # ReduceOp -> its word
_COLL_CODE = {name: i + 1 for i, name in enumerate(
    ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "fused_all_reduce", "barrier"])}
_CODE_COLL = {v: k for k, v in _COLL_CODE.items()}


def header(name: str, dtype, numel: int, op: ReduceOp, root: int, seg: int, off: int, settings: tuple[int, ...]) -> list[int]:
    """The words this rank publishes for collective `name` (its first word; e.g. 'all_reduce (copied in)')."""
    return [_COLL_CODE[name.split(" ")[0]], _DTYPE_CODE[dtype], numel, _OP_CODE[op], root, seg, off, *settings]


def validate(name: str, seq: int, hdrs: list[list[int]], me: int, global_ranks: list[int]) -> None:
    """Raise an error naming the ranks when the local ranks' headers of call `seq` disagree."""
    mine = hdrs[me]
    if all(h[:5] == mine[:5] and h[7:10] == mine[7:10] for h in hdrs):
        return  # the common case; the messages below are built only on a mismatch
    g = global_ranks
    for lr, h in enumerate(hdrs):
        if h[0] != mine[0]:
            raise RuntimeError(f"{name} (call #{seq}): ranks called different collectives: global rank {g[lr]} "
                               f"called {_CODE_COLL.get(int(h[0]), '?')}, global rank {g[me]} called {name}")
    desc = ", ".join(f"rank {g[lr]}: {int(h[2])} x {_CODE_DTYPE.get(int(h[1]))}" for lr, h in enumerate(hdrs))
    if any(h[1] != mine[1] for h in hdrs):
        raise TypeError(f"{name} (call #{seq}): dtype differs across ranks ({desc})")
    if any(h[2] != mine[2] for h in hdrs):
        raise ValueError(f"{name} (call #{seq}): number of elements differs across ranks ({desc})")
    if any(h[3] != mine[3] for h in hdrs):
        ops = ", ".join(f"rank {g[lr]}: {REDUCE_OPS[int(h[3]) - 1].value}" for lr, h in enumerate(hdrs))
        raise ValueError(f"{name} (call #{seq}): reduce op differs across ranks ({ops})")
    if any(h[7:10] != mine[7:10] for h in hdrs):
        cb = ", ".join(f"rank {g[lr]}: {int(h[7])}/{int(h[8])}/{int(h[9])}" for lr, h in enumerate(hdrs))
        raise ValueError(f"{name} (call #{seq}): ShmCommunicator chunk_bytes/pipeline_bytes/one_shot_bytes "
                         f"differ across ranks ({cb})")
    if any(h[4] != mine[4] for h in hdrs):
        roots = ", ".join(f"rank {g[lr]}: {int(h[4])}" for lr, h in enumerate(hdrs))
        raise ValueError(f"{name} (call #{seq}): root differs across ranks ({roots})")
