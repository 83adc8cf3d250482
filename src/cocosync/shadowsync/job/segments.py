"""The node's shared tensors of a job whose lost trainers are started again (--max-restarts): the embedding shards,
the reader positions. A trainer started again is a new process that took part in none of the job's collective
set-up, so it cannot map the arena's segments (their names are removed once every rank has mapped them); these are
named segments instead, which it maps by name. They stay named while the job runs: the launcher removes them when
the job ends, however it ends (`remove_job_segments`), and any process that mapped them removes them at its exit.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

from cocosync.runtime.comm.shm import Arena, create_named, map_named, remove_named

__all__ = ["NodeTensors", "remove_job_segments"]

#: the store key of the id that names the job's segments
SEGMENTS_ID = "segments-id"


class NodeTensors:
    """Tensors in this node's shared memory, made in the same order by every local rank: from `arena` (collective),
    or (`store` given: a client of the job's store) as named segments, created by local rank 0 (`creator`) and mapped
    by the others, and by a trainer started again (`creator` False, any time later)."""

    def __init__(self, arena: Arena | None, store: Any | None, creator: bool, node: int | str, timeout: float):
        if arena is None and store is None:
            raise ValueError("NodeTensors needs an arena or a store")
        self.arena, self.creator, self.timeout = arena, creator, timeout
        self.prefix = None
        if store is not None:
            job = store.compare_set(SEGMENTS_ID, "", uuid.uuid4().hex[:10]).decode()
            self.prefix = f"{job}-n{node}"

    def empty(self, name: str, shape: tuple[int, ...] | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zero-filled tensor of `shape`, the same memory on every process of the node (`name`: its segment's)."""
        shape = torch.Size([shape] if isinstance(shape, int) else shape)
        if self.prefix is None:
            return self.arena.shared_empty(shape, dtype)
        nbytes = max(1, shape.numel() * torch.empty((), dtype=dtype).element_size())
        seg = f"{self.prefix}-{name}"
        buf = create_named(seg, nbytes) if self.creator else map_named(seg, nbytes, self.timeout)
        return buf[:nbytes].view(dtype)[:shape.numel()].view(shape)


def remove_job_segments(store: Any) -> list[str]:
    """Remove the named segments of the job whose store `store` is (a client under the job's prefix); their paths."""
    if not store.check([SEGMENTS_ID]):
        return []
    return remove_named(f"{store.get(SEGMENTS_ID).decode()}-*")
