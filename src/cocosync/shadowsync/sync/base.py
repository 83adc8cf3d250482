"""The interface every dense-synchronization algorithm implements, and the flat parameter buffer it works on.

A trainer's dense parameters are re-pointed at views of one contiguous fp32 buffer (`FlatParams`), so that a
sync reads a snapshot with one copy and writes back with one in-place add, and Hogwild workers keep updating
the same memory meanwhile. Every algorithm writes back a *delta* (`flat += target - snapshot`), never an
assignment: updates that workers made while the sync was in flight (shadow mode) are kept, not overwritten.
With no concurrent updates (tests, foreground mode) the delta form equals the textbook assignment.

`sync(active)` is the whole interface. Collective algorithms (MA, BMUF) piggyback a "still training" flag on
their all_reduce and return how many trainers reported active in that round; a trainer that has finished its
data keeps calling `sync(active=False)` until that count is 0, so all trainers run the same number of
collectives and none waits forever on a finished peer. Local algorithms (EASGD, none) return `int(active)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable

import torch
import torch.distributed as dist

from cocosync.shadowsync.config import SyncConfig

__all__ = ["FlatParams", "SyncAlgorithm", "NoSync", "DenseGroup", "HierarchicalGroup", "ShmGroup", "GlooGroup"]


class DenseGroup(ABC):
    """The trainers a collective sync averages over, where they are not one torch.distributed process group."""

    @abstractmethod
    def size(self) -> int: ...

    @abstractmethod
    def all_reduce(self, buf: torch.Tensor) -> None:
        """Sum `buf` over the trainers, in place."""


class ShmGroup(DenseGroup):
    """Trainers of one machine through a shared-memory communicator made without torch.distributed (job/membership.py:
    the sync re-formed after a trainer's loss or join). `members`: the trainers' indices, in the communicator's rank
    order."""

    def __init__(self, comm: Any, members: list[int]):
        self.comm, self.members = comm, list(members)

    def size(self) -> int:
        return len(self.members)

    def all_reduce(self, buf: torch.Tensor) -> None:
        if self.size() > 1:
            self.comm.all_reduce(buf, "sum")

    def broadcast(self, buf: torch.Tensor, root: int) -> None:
        """`buf` from member index `root` onto every member, in place."""
        if self.size() > 1:
            self.comm.broadcast(buf, root)


class GlooGroup(DenseGroup):
    """Trainers of several machines through a gloo group made through the job's store, outside torch's map of groups
    (job/membership.py: the sync re-formed among the trainers of the machines left after one's loss). `members`: the
    trainers' indices, in the group's rank order."""

    def __init__(self, pg: Any, members: list[int]):
        self.pg, self.members = pg, list(members)

    def size(self) -> int:
        return len(self.members)

    def all_reduce(self, buf: torch.Tensor) -> None:
        if self.size() > 1:
            self.pg.allreduce([buf]).wait()

    def broadcast(self, buf: torch.Tensor, root: int) -> None:
        """`buf` from member index `root` onto every member, in place."""
        if self.size() > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            self.pg.broadcast([buf], opts).wait()


class HierarchicalGroup(DenseGroup):
    """The trainers of a job across machines, as a collective sync sees them: `intra` holds this node's trainers
    (the cocosync backend: shared memory; None when a node has one trainer), `inter` the trainers with this trainer's
    node-local index, one per node (gloo; None on one node).

    all_reduce with both: reduce-scatter within the node, all-reduce of this trainer's slice across the nodes, then
    all-gather within the node, so each trainer sends only 1/(trainers per node) of the vector over the network."""

    def __init__(self, intra: dist.ProcessGroup | None, inter: dist.ProcessGroup | None, size: int):
        self.intra, self.inter, self._size = intra, inter, size
        self.local = dist.get_world_size(intra) if intra is not None else 1

    def size(self) -> int:
        return self._size

    def all_reduce(self, buf: torch.Tensor) -> None:
        if self.intra is None or self.inter is None:
            for group in (self.intra, self.inter):
                if group is not None:
                    dist.all_reduce(buf, group=group)
            return
        n = buf.numel()
        padded = -(-n // self.local) * self.local
        work = buf if padded == n else torch.cat([buf, buf.new_zeros(padded - n)])
        mine = work.new_empty(padded // self.local)
        dist.reduce_scatter_tensor(mine, work, group=self.intra)
        dist.all_reduce(mine, group=self.inter)
        dist.all_gather_into_tensor(work, mine, group=self.intra)
        if work is not buf:
            buf.copy_(work[:n])


class FlatParams:
    """Re-point `params` at views of one contiguous buffer `self.flat` (values kept); no copy on later access."""

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.params = list(params)
        if not self.params:
            raise ValueError("FlatParams needs at least one parameter")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"all dense parameters must share one dtype, got {sorted(map(str, dtypes))}")
        numel = sum(p.numel() for p in self.params)
        self.flat = torch.empty(numel, dtype=self.params[0].dtype)
        self.offsets: list[tuple[int, int]] = []
        off = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                self.flat[off:off + n].copy_(p.detach().reshape(-1))
                p.data = self.flat[off:off + n].view_as(p)
                self.offsets.append((off, n))
                off += n

    def __len__(self) -> int:
        return self.flat.numel()

    def flatten_grads(self, grads: Iterable[torch.Tensor | None]) -> torch.Tensor:
        """One flat gradient (zeros where a grad is None) aligned with `self.flat`."""
        out = torch.zeros_like(self.flat)
        for (off, n), g in zip(self.offsets, grads):
            if g is not None:
                out[off:off + n].copy_(g.reshape(-1))
        return out


class SyncAlgorithm(ABC):
    """Synchronizes one trainer's flat dense buffer with the other trainers. Subclasses implement `_sync`."""

    name = "base"
    collective = False  # True when sync() runs a collective that every trainer must join

    def __init__(self, flat: torch.Tensor, cfg: SyncConfig, group: dist.ProcessGroup | DenseGroup | None = None):
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError("sync algorithms work on a 1-D contiguous flat parameter buffer (see FlatParams)")
        self.flat, self.cfg, self.group = flat, cfg, group
        self.syncs = 0
        self.holding = False  # this trainer asks every trainer to pause after a common round (a checkpoint)
        self.holds = 0  # how many trainers asked that in the last round

    def sync(self, active: bool = True) -> int:
        """One synchronization round. Returns the number of trainers that reported active (see module doc)."""
        with torch.no_grad():
            n = self._sync(bool(active))
        self.syncs += 1
        return n

    @abstractmethod
    def _sync(self, active: bool) -> int: ...

    def state(self) -> dict[str, torch.Tensor]:
        """Copies of the algorithm's own state, for a checkpoint (the flat buffer is the trainer's)."""
        return {}

    def load_state(self, saved: dict[str, torch.Tensor]) -> None:
        """Restore `state()`'s keys found in `saved` (absent ones keep the fresh state)."""

    # -- helpers for the collective algorithms ---------------------------------------------------------
    def group_size(self) -> int:
        """Trainers taking part in the collective sync."""
        if isinstance(self.group, DenseGroup):
            return self.group.size()
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _mean_and_active(self, snapshot: torch.Tensor, active: bool) -> tuple[torch.Tensor, int]:
        """All-reduce `snapshot`, the active flag and the hold flag in one message; returns (mean over trainers,
        #active) and sets `holds`."""
        n = snapshot.numel()
        buf = torch.empty(n + 2, dtype=snapshot.dtype)
        buf[:n].copy_(snapshot)
        buf[n] = 1.0 if active else 0.0
        buf[n + 1] = 1.0 if self.holding else 0.0
        world = self.group_size()
        if isinstance(self.group, DenseGroup):
            self.group.all_reduce(buf)
        elif world > 1:
            dist.all_reduce(buf, group=self.group)
        self.holds = int(round(buf[n + 1].item()))
        return buf[:n].div_(world), int(round(buf[n].item()))


class NoSync(SyncAlgorithm):
    """'none': independent trainers; sync() changes nothing."""

    name = "none"

    def _sync(self, active: bool) -> int:
        return int(active)
