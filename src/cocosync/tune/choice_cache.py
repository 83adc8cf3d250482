"""Choices made by measurement inside a job (an optimizer's schedule, a layer's overlap chunks), kept in the tuner's
cache (tuner.cache_dir) so that the next job with the same program and world reads them instead of timing.

Reading is collective: every rank must run the same plan, so a cached choice counts only where every rank of the
group reads the same one (a rank without the file, or with another entry, makes them all time again)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from cocosync.tune.tuner import cache_dir, cache_key

__all__ = ["entry_path", "read_agreed", "save_entry"]


def entry_path(listing: str, world: int, nnodes: int) -> Path:
    return cache_dir() / f"{cache_key(listing, world, nnodes)}.json"


def read_agreed(path: Path, group: dist.ProcessGroup | None, index_of: Callable[[dict[str, Any]], int | None],
                use_cache: bool = True) -> int | None:
    """`index_of(entry)` of the cached entry (an index into the caller's candidates), where every rank of `group`
    read the same one; else None. Collective over `group`."""
    index = None
    if use_cache:
        try:
            index = index_of(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            index = None
    mine = -1.0 if index is None else float(index)
    agreed = torch.tensor([mine, -mine])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)  # min == max: every rank holds the same entry
    return index if index is not None and float(agreed[0]) == -float(agreed[1]) == mine else None


def save_entry(path: Path, entry: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """Written once, by the group's rank 0, atomically (a reader never sees half a file)."""
    if dist.get_rank(group) != 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entry, indent=2))
    os.replace(tmp, path)
