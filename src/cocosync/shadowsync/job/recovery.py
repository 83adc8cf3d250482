"""What a trainer of a one-machine job does when another trainer is lost (membership.py says who is left): its dense
sync re-formed among the trainers left, and its share of the lost trainers' unread rows.

The rows: a trainer's W reader shards are segments of the data source's sharding (data/plan.py); the node's shared
reader positions (Job.positions) say how far the lost trainer read each one when it died. What is left of them is cut
into S x W parts for the S trainers left, as a resume onto S trainers would cut it, and each reads its W parts with
its W workers. A trainer lost while it was reading such a share leaves the rest of that share (its positions there are
in the node's shared memory too: Job.share_positions), shared out at the next agreement in the same way. A batch a
lost trainer was training when it died may be read again (at most one per worker); nothing is read by none, except
the rows of a trainer lost after the others' last agreement (the summary's `short_by` says how many).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from cocosync.runtime.comm.shm import leave_collectives
from cocosync.shadowsync.data.plan import DataPlan, base_plan, split_plan, unread
from cocosync.shadowsync.data.sources import base_shard_rows, trainer_source
from cocosync.shadowsync.job.job import Job
from cocosync.shadowsync.job.membership import Membership
from cocosync.shadowsync.sync import make_sync
from cocosync.shadowsync.sync.base import HierarchicalGroup, SyncAlgorithm
from cocosync.shadowsync.sync.dssync import DSSync

__all__ = ["Recovery", "Takeover"]


@dataclass(frozen=True)
class Takeover:
    """This trainer's share of lost trainers' unread rows: worker w reads shard `first + w` of `shards` of
    `source`."""

    source: Any
    first: int
    shards: int


class Recovery:
    """A trainer's side of losing peers (see the module doc)."""

    def __init__(self, job: Job, membership: Membership, trainer: int):
        self.job, self.membership, self.trainer = job, membership, trainer
        self.epoch = 0  # the losses this trainer's sync is formed after
        self.regrouped_at: float | None = None  # when this trainer's sync was first re-formed (time.time())
        self.taken = 0  # the losses whose rows have been shared out
        self.phases = 0  # the agreements so far
        # by agreement: the trainers each given a share of lost trainers' rows there, and the shares (W parts each),
        # the same on every trainer left
        self.shares: dict[int, tuple[list[int], list]] = {}
        # across machines: run before the sync re-forms (job/node_loss.py: LostMachine.prepare), False if no
        # machine's loss explains the failure
        self.before_regroup: Callable[[], bool] | None = None

    # -- the dense sync ---------------------------------------------------------------------------------
    def regroup(self, old: SyncAlgorithm) -> SyncAlgorithm | None:
        """The sync of `old`'s algorithm among the trainers left, once a loss past this trainer's epoch is recorded
        (its state carried over); None if no loss comes (`old` failed for another reason)."""
        # the old sync is given up here: a trainer left waiting in one of its collectives for this one fails now
        leave_collectives(f"trainer {self.trainer}'s sync failed and is re-formed")
        if self.before_regroup is not None and not self.before_regroup():
            return None
        epoch = self.membership.wait_for_loss(self.epoch)
        if epoch is None:
            return None
        live = self.membership.live(epoch)
        group = self.membership.trainer_group(live)
        cfg = self.job.cfg.sync
        if cfg.method == "dssync":
            new: SyncAlgorithm = DSSync(old.flat, cfg, group=group, round_group=group)
        else:
            new = make_sync(old.flat, cfg, group=HierarchicalGroup(group, None, len(live)), trainers=len(live))
        new.load_state(old.state())
        new.syncs, new.holding = old.syncs, old.holding
        self.epoch = epoch
        if self.regrouped_at is None:
            self.regrouped_at = time.time()
        return new

    # -- the lost trainers' rows -------------------------------------------------------------------------
    def takeover(self, give_up: Callable[[], bool] = lambda: False) -> Takeover | None:
        """After this trainer read all it was given: agree with the trainers left on the losses so far, and return
        this trainer's share of the rows of those not shared out yet (None: no new loss, or `give_up()` turned true
        while waiting for the others)."""
        self.phases += 1
        epoch = self.membership.agree(f"phase{self.phases}", self.trainer, give_up)
        if epoch is None or epoch <= self.taken:
            return None
        losses = self.membership.losses(epoch)
        new = [x for x in losses if x.seq > self.taken]
        self.taken = epoch
        live = self.membership.live(epoch)
        cfg, data, plan = self.job.cfg, self.job.data, self.job.plan
        W, T = cfg.workers, self.job.roles.trainers
        if plan is None:
            shards = base_plan(T * W, lambda s: base_shard_rows(cfg, data, s, T * W))
            base_shards = T * W
        else:
            shards, base_shards = plan.shards, plan.base_shards
        left = []
        for loss in new:
            left += self._unread(loss.trainer, shards)
        parts = split_plan(left, len(live) * W)
        self.shares[self.phases] = (live, parts)
        j = live.index(self.trainer)
        share = DataPlan(base_shards, parts, 0)
        return Takeover(trainer_source(cfg, data, j, share), j * W, len(live) * W)

    def positions(self, d: int) -> list[int]:
        """Trainer d's reader positions in its own shards: this machine's shared copy, or (a trainer of another
        machine) what it last published (zeros if it never did)."""
        roles = self.job.roles
        if roles.node_of(roles.rank_of("trainer", d)) == roles.topo.node:
            return [int(p) for p in self.job.positions[d]]
        return self.membership.published_positions(d) or [0] * self.job.cfg.workers

    def begin(self) -> Any:
        """This trainer starts reading the share it was just given: its reader positions there (int64 [W], in the
        node's shared memory, zeroed), which say what is left of it if this trainer is lost in turn."""
        row = self.job.share_positions[self.trainer]
        row[1:].zero_()
        row[0] = self.phases  # (after the zeroing: the agreement whose share these positions are in)
        return row[1:]

    def _last_share(self, d: int) -> tuple[int, list, list[int]] | None:
        """Trainer d's last share of lost trainers' rows: (its agreement, its W parts, d's positions in them; zero if
        d was lost before it started reading), or None if it was given none."""
        given = [k for k, (live, _) in self.shares.items() if d in live]
        if not given:
            return None
        k, W = max(given), self.job.cfg.workers
        live, parts = self.shares[k]
        j = live.index(d)
        started = int(self.job.share_positions[d, 0]) == k
        pos = [int(p) for p in self.job.share_positions[d, 1:]] if started else [0] * W
        return k, parts[j * W:(j + 1) * W], pos

    def _unread(self, d: int, own: list) -> list:
        """The rows lost trainer d had not read: of its own shards (`own`: every trainer's), or, when it was given a
        share of an earlier loss's rows (which it reads once its own are done), of its last share."""
        last = self._last_share(d)
        if last is None:
            W = self.job.cfg.workers
            return unread(own[d * W:(d + 1) * W], self.positions(d))
        _, parts, pos = last
        return unread(parts, pos)

    def share_rows_read(self, d: int) -> int:
        """Rows lost trainer d read in its shares of lost trainers' rows (every share but its last in full)."""
        last = self._last_share(d)
        if last is None:
            return 0
        k, _, pos = last
        W, full = self.job.cfg.workers, 0
        for a, (live, parts) in self.shares.items():
            if a < k and d in live:
                j = live.index(d)
                full += sum(r for segments in parts[j * W:(j + 1) * W] for _, _, r in segments)
        return full + sum(pos)
