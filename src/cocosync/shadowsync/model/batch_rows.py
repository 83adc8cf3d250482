"""A batch's rows on the trainer's lookup path (`ShardedEmbeddings`): its distinct global rows (`distinct_rows`) and,
with the lookup exchange, where each of them lives (`split_rows`: the node's replicated hot rows, one of its local
shards, or another node). One C++ pass each where the native module is built (runtime/comm/native/lookup_rounds.cpp:
torch.unique sorted every id of a batch, ~250 us of 256 x 26 ids; the split was ~15 tensor operations); the torch
operations here otherwise, their references (the same bits, tested)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Sequence

import torch

from cocosync.runtime.comm.native import one_shot as native_module

if TYPE_CHECKING:
    from cocosync.shadowsync.model.hot_rows import HotRows

__all__ = ["distinct_rows", "split_rows"]

_NO_HOT = torch.empty(0, dtype=torch.int64)


def distinct_rows(sparse: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct global rows (ascending) of ids [B, tables] whose tables start at `offsets`, and each id's position
    in them [B, tables]: torch.unique((sparse + offsets).view(-1), return_inverse=True)."""
    native = native_module()
    if native is not None and sparse.dtype == torch.int64 and sparse.dim() == 2:
        uniq, inverse = native.distinct_rows(sparse.contiguous(), offsets)
        return uniq, inverse
    uniq, inverse = torch.unique((sparse + offsets).reshape(-1), return_inverse=True)
    return uniq, inverse.view(sparse.shape)


def split_rows(uniq: torch.Tensor, hot: HotRows | None, is_local: torch.Tensor, local_servers: Sequence[int]) -> dict:
    """Where the distinct rows `uniq` live, as `Lookup` fields: "hot" (positions, slots) in the node's replica `hot`
    (None without one), "local" [(server, positions, local rows)] per shard of `local_servers` (`is_local`: a bool per
    server; row g lives on server g % S at its row g // S), "remote_idx" the positions of the other nodes' rows."""
    S = is_local.numel()
    native = native_module()
    if native is not None and uniq.dtype == torch.int64:
        hot_pos, hot_slot, local_pos, local_rows, counts, remote_idx = native.split_rows(
            uniq.contiguous(), hot.ids if hot is not None else _NO_HOT, is_local)
        bounds = [0, *itertools.accumulate(counts.tolist())]
        local = [(s, local_pos[bounds[s]:bounds[s + 1]], local_rows[bounds[s]:bounds[s + 1]])
                 for s in local_servers if bounds[s + 1] > bounds[s]]
        return {"local": local, "remote_idx": remote_idx, "hot": (hot_pos, hot_slot) if hot is not None else None}
    owner = uniq % S
    where_hot = None
    if hot is not None:
        where_hot = hot.locate(uniq)
        if where_hot[0].numel():
            owner[where_hot[0]] = -1  # neither a local shard's nor remote
    local = [(s, idx, uniq[idx] // S) for s in local_servers if (idx := (owner == s).nonzero().view(-1)).numel()]
    remote = ~is_local[owner.clamp(min=0)]
    if where_hot is not None:
        remote[where_hot[0]] = False
    return {"local": local, "remote_idx": remote.nonzero().view(-1), "hot": where_hot}
