"""DS-Sync (divide-and-shuffle synchronization; Divide-and-Shuffle Synchronization for Distributed Machine
Learning): each round the T trainers are split into `groups` groups of near-equal size that average their
parameters within the group only, and the membership is reshuffled every round from a seed all trainers share.

    perm      = shuffle(0..T-1; seed, round r)          (the same permutation on every trainer)
    group k   = perm[k*T//G : (k+1)*T//G]
    x_local  <- mean over my group of x                  (delta write-back, as model averaging)

In the paper a round moves 1/G of the bytes a full all-reduce would (each group reduces only its members' vectors,
the G groups at once), while the reshuffling mixes information across groups over rounds; its claim: convergence
close to full averaging at a fraction of the communication.

All groups average in ONE all-reduce over every trainer: trainer i writes its vector into its group's row of a
[G, D] buffer (zeros elsewhere) and the sum gives every group's total, with the active and hold flags (which must
count every trainer) in the same buffer. A process group per group, as first built, cost a `new_group` (a collective
of every trainer, and shared memory for the `cocosync` backend) whenever a membership first occurred: C(8, 4) = 70
groups at T=8, so nearly every round paid one, and the shadow threads synced every 25-48 iterations against MA's 4-5
(BENCHMARKS.md). The buffer is G times one vector, moved on one machine through shared memory (`compiled`, the
`cocosync` backend's world group of the trainers) or gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cocosync.runtime.comm.backend import BACKEND
from cocosync.shadowsync.config import SyncConfig
from cocosync.shadowsync.sync.base import SyncAlgorithm

__all__ = ["DSSync", "partition"]


def partition(trainers: int, groups: int, seed: int, round_index: int) -> list[tuple[int, ...]]:
    """The groups of round `round_index` (sorted members; every trainer computes the same)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + round_index)
    perm = torch.randperm(trainers, generator=gen).tolist()
    return [tuple(sorted(perm[k * trainers // groups:(k + 1) * trainers // groups])) for k in range(groups)]


class DSSync(SyncAlgorithm):
    name = "dssync"
    collective = True

    def __init__(self, flat: torch.Tensor, cfg: SyncConfig, group: dist.ProcessGroup | None = None,
                 backend: str | None = None, round_group: dist.ProcessGroup | None = None):
        """`backend` of the trainers' group the rounds reduce on: default 'cocosync' (shared memory) with
        cfg.compiled, else `group` itself (gloo); `round_group`: that group, made by the caller (no group is made
        here then)."""
        super().__init__(flat, cfg, group)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise ValueError("DS-Sync runs over a flat group of trainers (one machine), not a hierarchical one")
        self.last_group: tuple[int, ...] = ()
        self.backend = backend or (BACKEND if cfg.compiled else None)
        self.round_group = round_group or group
        if round_group is None and self.backend is not None and self.group_size() > 1:  # collective over the trainers
            ranks = [dist.get_global_rank(group, m) for m in range(self.group_size())] if group is not None else None
            self.round_group = dist.new_group(ranks, backend=self.backend)
        self._buf = torch.empty(0)

    def _sync(self, active: bool) -> int:
        world = self.group_size()
        if world == 1:
            self.holds = int(self.holding)
            return int(active)
        me, n = dist.get_rank(self.group), self.flat.numel()
        groups = partition(world, self.cfg.groups, self.cfg.shuffle_seed, self.syncs)
        k = next(i for i, members in enumerate(groups) if me in members)
        self.last_group = groups[k]
        if self._buf.numel() != len(groups) * n + 2:
            self._buf = torch.empty(len(groups) * n + 2, dtype=self.flat.dtype)
        buf = self._buf.zero_()
        mine = buf[k * n:(k + 1) * n]
        mine.copy_(self.flat)
        snapshot = mine.clone()
        buf[-2:] = torch.tensor([1.0 if active else 0.0, 1.0 if self.holding else 0.0])
        dist.all_reduce(buf, group=self.round_group)
        self.flat.add_(mine.div_(len(self.last_group)).sub_(snapshot))  # delta write-back: keeps Hogwild updates
        self.holds = int(round(buf[-1].item()))
        return int(round(buf[-2].item()))
