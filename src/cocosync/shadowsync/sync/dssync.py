"""DS-Sync (divide-and-shuffle synchronization; Divide-and-Shuffle Synchronization for Distributed Machine
Learning): each round the T trainers are split into `groups` groups of near-equal size that average their
parameters within the group only, and the membership is reshuffled every round from a seed all trainers share.

    perm      = shuffle(0..T-1; seed, round r)          (the same permutation on every trainer)
    group k   = perm[k*T//G : (k+1)*T//G]
    x_local  <- mean over my group of x                  (delta write-back, as model averaging)

A round moves 1/G of the bytes a full all-reduce would move per group (each group reduces only its members'
vectors, and the G groups run at once), while the reshuffling mixes information across groups over rounds. The
paper's claim: convergence close to full averaging at a fraction of its communication.

Each group is a process group of its members (created once, when its membership first occurs: every trainer calls
`new_group` for every group of the round in the same order, as torch requires). The active and hold flags, which
must count every trainer, ride on a small all-reduce over all trainers. With `compiled` (the default) these groups
are of the `cocosync` backend, so the averages and the flags go through the node's shared memory (the runtime's
communicator) instead of gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cocosync.runtime.comm.backend import BACKEND
from cocosync.shadowsync.sync.base import SyncAlgorithm
from cocosync.shadowsync.train_config import SyncConfig

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
                 backend: str | None = None):
        """`backend` of the groups it makes: default 'cocosync' (shared memory) with cfg.compiled, else the
        default group's (gloo)."""
        super().__init__(flat, cfg, group)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise ValueError("DS-Sync runs over a flat group of trainers (one machine), not a hierarchical one")
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self.last_group: tuple[int, ...] = ()
        self.backend = backend or (BACKEND if cfg.compiled else None)
        self._flags_group = group
        if self.backend is not None and self._world() > 1:  # collective: every trainer builds its sync here
            self._flags_group = dist.new_group(self._ranks(range(self._world())), backend=self.backend)

    def _ranks(self, members) -> list[int]:
        return [dist.get_global_rank(self.group, m) for m in members] if self.group is not None else list(members)

    def _process_group(self, members: tuple[int, ...]) -> dist.ProcessGroup | None:
        if members not in self._groups:  # collective: every trainer reaches here for every new group in order
            self._groups[members] = (dist.new_group(self._ranks(members), backend=self.backend)
                                     if len(members) > 1 else None)
        return self._groups[members]

    def _sync(self, active: bool) -> int:
        world = self._world()
        flags = torch.tensor([1.0 if active else 0.0, 1.0 if self.holding else 0.0])
        if world == 1:
            self.holds = int(self.holding)
            return int(active)
        me = dist.get_rank(self.group)
        mine: tuple[int, ...] = ()
        my_pg: dist.ProcessGroup | None = None
        for members in partition(world, self.cfg.groups, self.cfg.shuffle_seed, self.syncs):
            pg = self._process_group(members)
            if me in members:
                mine, my_pg = members, pg
        self.last_group = mine
        snapshot = self.flat.clone()
        if my_pg is not None:
            mean = snapshot.clone()
            dist.all_reduce(mean, group=my_pg)
            self.flat.add_(mean.div_(len(mine)).sub_(snapshot))  # delta write-back: keeps Hogwild updates
        dist.all_reduce(flags, group=self._flags_group)
        self.holds = int(round(flags[1].item()))
        return int(round(flags[0].item()))
