"""What a trainer of a one-machine job does when another trainer is lost or joins again (membership.py says who is in
the job): its dense sync re-formed among the trainers in the job, and its share of the lost trainers' unread rows.

The sync: each re-formed sync is a shared-memory communicator of the trainers in the job at one epoch of the
membership (Membership.sync_group), made through the store alone, since a trainer started again is in none of the
job's process groups. A lost trainer's peers find out when their collective fails; a join (--max-restarts), when the
sync loop looks at the epoch before a round (every LOOK_EVERY seconds). A trainer that joins takes the dense
replica, its optimizer state and the sync's state from the first member that did not join, in the new group's first
collectives (live recovery: no checkpoint is read), and only then starts training.

The rows: a trainer's W reader shards are segments of the data source's sharding (data/plan.py); the node's shared
reader positions (Job.positions) say how far the lost trainer read each one when it died. What is left of them is cut
into S x W parts for the S trainers left, as a resume onto S trainers would cut it, and each reads its W parts with
its W workers. A trainer lost while it was reading such a share leaves the rest of that share (its positions there are
in the node's shared memory too: Job.share_positions), shared out at the next agreement in the same way. A batch a
lost trainer was training when it died may be read again (at most one per worker); nothing is read by none, except
the rows of a trainer lost after the others' last agreement (the summary's `short_by` says how many). A lost
trainer's restart reads the rest of its own shards from where it stopped, unless an agreement shared them out first
(the store's `rows/<change>` says which came first); then it reads only what later agreements give it. A trainer of
a machine that joins (node_join.py) reads them only up to about what the trainers in the job have left of their own
(`cut_own`): the rest is shared out at the first agreement with the lost trainers' rows (`_tails`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from cocosync.runtime.comm.shm import leave_collectives
from cocosync.shadowsync.data.plan import DataPlan, base_plan, split_plan, unread
from cocosync.shadowsync.data.sources import base_shard_rows, trainer_source
from cocosync.shadowsync.job.job import Job
from cocosync.shadowsync.job.link import leave_fenced
from cocosync.shadowsync.job.membership import Loss, Membership
from cocosync.shadowsync.sync import make_sync
from cocosync.shadowsync.sync.base import GlooGroup, ShmGroup, SyncAlgorithm
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
    """A trainer's side of losing peers, and of peers that join again (see the module doc)."""

    #: seconds between two looks at the membership's epoch from the sync loop (a join is seen within this)
    LOOK_EVERY = 0.1
    #: across machines (a gloo group): rounds of the sync between two looks, which its members take together
    LOOK_EVERY_ROUNDS = 8

    def __init__(self, job: Job, membership: Membership, trainer: int, restart: int = 0):
        """`restart`: this trainer's restart (0: the job's own process; else a lost trainer started again, which
        joins with `admit`)."""
        self.job, self.membership, self.trainer, self.restart = job, membership, trainer, restart
        self.epoch = 0  # the changes this trainer's sync is formed after
        self.regrouped_at: float | None = None  # when this trainer's sync was first re-formed (time.time())
        self.taken = 0  # the changes whose lost trainers' rows have been shared out
        self.phases = 0  # the agreements so far
        # by agreement: the trainers each given a share of lost trainers' rows there, and the shares (W parts each),
        # the same on every trainer left (published in the store for the trainers that join later)
        self.shares: dict[int, tuple[list[int], list]] = {}
        # across machines: run once a change is recorded, before the sync re-forms (job/node_join.py:
        # MachineJoins.prepare); False if no loss explains the failure
        self.before_regroup: Callable[[], bool] | None = None
        # what a joining trainer takes from a peer (its dense replica and optimizer state: set by the trainer)
        self.carried: tuple[torch.Tensor, ...] = ()
        self.fresh = restart > 0  # this trainer has not yet taken the model from a peer
        self.reads_own = True  # this trainer reads (the rest of) its own shards (a joiner: if it got them back)
        self.state_from: int | None = None  # the trainer this one took the model from (a joiner)
        self._looked = 0.0
        self._group: ShmGroup | GlooGroup | None = None  # the sync's group as re-formed last
        self._rounds = 0  # the sync's rounds on it (calls of `changed`)

    # -- the dense sync ---------------------------------------------------------------------------------
    def changed(self) -> bool:
        """Whether the trainers changed since this trainer's sync was formed (looked up at most every LOOK_EVERY s:
        the sync loop asks before each round). Only where a trainer may join (--max-restarts; across machines, a
        machine in a lost one's place, which comes only after a loss: once this trainer's sync was re-formed,
        node_join.py; not with EASGD, whose sync servers no machine starts again): a loss is found by the collective
        it breaks."""
        across = self.job.roles.topo.nnodes > 1
        if across and self.job.cfg.sync.method == "easgd":
            return False
        if not self.job.cfg.max_restarts and (not across or self._group is None):
            return False
        if isinstance(self._group, GlooGroup):
            return self._changed_together(self._group)
        now = time.monotonic()
        if now - self._looked < self.LOOK_EVERY:
            return False
        self._looked = now
        return self.membership.epoch() > self.epoch

    def _changed_together(self, group: GlooGroup) -> bool:
        """Across machines: whether any member of the sync's gloo group sees a change, looked at by every member at
        the same round (every LOOK_EVERY_ROUNDS-th), so that they all leave the group after that round. A member that
        left it on its own would leave a peer waiting in its next collective (a shared-memory group releases such a
        peer; a gloo group only at its timeout). A failed look is a change (a peer was lost: the re-forming finds
        out)."""
        self._rounds += 1
        if self._rounds % self.LOOK_EVERY_ROUNDS:
            return False
        try:
            seen = torch.tensor([float(self.membership.epoch() > self.epoch)])
            group.all_reduce(seen)
        except Exception:  # noqa: BLE001 - the sync's next round would fail the same way: re-form
            return True
        return bool(seen.item() > 0)

    def regroup(self, old: SyncAlgorithm) -> SyncAlgorithm | None:
        """The sync of `old`'s algorithm among the trainers in the job, once a change past this trainer's epoch is
        recorded (its state carried over; a trainer that joined takes the model from a peer); None if no change comes
        (`old` failed for another reason)."""
        # the old sync is given up here: a trainer left waiting in one of its collectives for this one fails now
        leave_collectives(f"trainer {self.trainer}'s sync is re-formed")
        if self.trainer not in self.membership.live():  # (recorded as lost while it ran: its machine was fenced)
            leave_fenced(self.trainer)
        seen = self.epoch
        while True:
            epoch = self.membership.wait_for_change(seen)
            if epoch is None:
                return None
            # (across machines: the losses recorded are handled first, a machine's shards restored and its centre
            # ranges adopted, and the machines that joined taken in)
            if self.before_regroup is not None and not self.before_regroup():
                return None
            group = self.membership.sync_group(epoch, self.trainer)
            if group is not None:
                break
            seen = epoch  # (abandoned: a later change came first)
        new = self._formed(old, group, epoch)
        if self.regrouped_at is None:
            self.regrouped_at = time.time()
        return new

    def admit(self, old: SyncAlgorithm, give_up: Callable[[], bool]) -> SyncAlgorithm | None:
        """A trainer started again joins: once the trainers in the job form the sync with it, it takes the model
        from one of them, and gets its own unread rows back unless they were shared out already. None if
        `give_up()` turned true first (the others are done with their rows: too late to join)."""
        epoch = self.membership.epoch()
        while True:
            # (a machine that joins takes in the machines that joined after it first, as the machines in the job do
            # before they form the sync with it: node_join.MachineJoins)
            if self.before_regroup is not None and not self.before_regroup():
                return None
            group = self.membership.sync_group(epoch, self.trainer, give_up)
            if group is not None:
                break
            if give_up():
                return None
            epoch = self.membership.wait_for_change(epoch) or self.membership.epoch()
        new = self._formed(old, group, epoch)
        self._catch_up()
        own = [x for x in self.membership.losses(epoch) if x.trainer == self.trainer][-1]
        started = int(self.job.share_positions[self.trainer, 0]) != 0  # (it was reading others' rows when lost)
        self.reads_own = not started and self.membership.claim_rows(own.seq, "join") == "join"
        return new

    def _formed(self, old: SyncAlgorithm, group: ShmGroup | GlooGroup, epoch: int) -> SyncAlgorithm:
        cfg, live = self.job.cfg.sync, group.members
        if cfg.method == "dssync":
            new: SyncAlgorithm = DSSync(old.flat, cfg, group=group, round_group=group)
        elif cfg.method == "easgd":  # no collective: the same exchanges with the centre (its lost ranges adopted)
            new = old
        else:
            new = make_sync(old.flat, cfg, group=group, trainers=len(live))
        new.load_state(old.state())
        new.syncs, new.holding = old.syncs, old.holding
        self._share_state(group, new)
        self.epoch = epoch
        self._group, self._rounds = group, 0
        return new

    def _share_state(self, group: ShmGroup | GlooGroup, new: SyncAlgorithm) -> None:
        """Trainers that joined take the dense replica, its optimizer state and the sync's state from the first
        member that did not (one flag per member first, summed: nothing more is sent when none joined)."""
        n, i = group.size(), group.members.index(self.trainer)
        need = torch.zeros(n)
        need[i] = float(self.fresh)
        group.all_reduce(need)
        donors = [k for k in range(n) if need[k] == 0]
        if not need.any() or not donors:
            self.fresh = False
            return
        root = donors[0]
        state = new.state()
        for t in list(self.carried) + [state[k] for k in sorted(state)]:
            group.broadcast(t if self.fresh or i == root else t.clone(), root)
        if self.fresh:
            new.load_state(state)
            self.state_from = group.members[root]
            self.fresh = False

    # -- the lost trainers' rows -------------------------------------------------------------------------
    def cut_own(self) -> DataPlan | None:
        """A trainer of a machine that joined and got its place's rows back (`admit`): the plan it reads them through,
        cut so that it reads about as many as each trainer already in the job has left of its own (their published
        positions; the others' rates taken for this one's), or None where it would read them all. The rest of its
        rows (`cut/<t>`: where each of its W shards stops) is shared out over every trainer at the first agreement,
        with the lost trainers' rows: a machine that joins late does not leave the others idle at the end."""
        roles, membership, W = self.job.roles, self.membership, self.job.cfg.workers
        mine = roles.machine_of(self.trainer)
        peers = [d for d in membership.live() if roles.machine_of(d) != mine]
        own = self._own_plan()
        pos = [int(p) for p in self.job.positions[self.trainer]]
        rows = [sum(r for _, _, r in segments) for segments in own[self.trainer * W:(self.trainer + 1) * W]]
        left = sum(rows) - sum(pos)
        if not peers or left <= 0:
            return None
        theirs = sum(self._left_of(d, own) for d in peers) / len(peers)
        share = min(1.0, theirs / left)
        if share >= 1.0:
            return None
        limits = [p + int(share * (r - p)) for p, r in zip(pos, rows)]
        membership.store.set(f"cut/{self.trainer}", json.dumps(limits))
        cut = [list(segments) for segments in own]
        for w in range(W):
            cut[self.trainer * W + w] = _prefix(own[self.trainer * W + w], limits[w])
        plan = self.job.plan
        return DataPlan(plan.base_shards if plan is not None else len(own), cut,
                        plan.examples_before if plan is not None else 0)

    def _left_of(self, d: int, own: list) -> int:
        """Rows trainer d (in the job) has left to read of its own, up to its cut if it joined with one."""
        W = self.job.cfg.workers
        cut = self.membership.store.get(f"cut/{d}") if self.membership.store.check([f"cut/{d}"]) else None
        ends = json.loads(cut) if cut is not None else [sum(r for _, _, r in segments)
                                                       for segments in own[d * W:(d + 1) * W]]
        return max(0, sum(ends) - sum(self.positions(d)))

    def _own_plan(self) -> list:
        """Every trainer's own W reader shards, as segments of the base sharding."""
        cfg, data, plan = self.job.cfg, self.job.data, self.job.plan
        T, W = self.job.roles.trainers, cfg.workers
        if plan is not None:
            return plan.shards
        return base_plan(T * W, lambda s: base_shard_rows(cfg, data, s, T * W))

    def _catch_up(self) -> None:
        """A joining trainer takes the agreements made before it joined: their count, the changes shared out by the
        last, and their shares (the store's copies)."""
        k = 0
        while self.membership.store.check([f"agree/phase{k + 1}/epoch"]):
            k += 1
        self.phases = k
        if k:
            self.taken = int(self.membership.store.get(f"agree/phase{k}/epoch"))
        self._load_shares()

    def _load_shares(self) -> None:
        for k in range(1, self.phases + 1):
            if k not in self.shares and self.membership.store.check([f"share/{k}"]):
                rec = json.loads(self.membership.store.get(f"share/{k}"))
                self.shares[k] = (rec["live"], [[tuple(x) for x in part] for part in rec["parts"]])

    def takeover(self, give_up: Callable[[], bool] = lambda: False) -> Takeover | None:
        """After this trainer read all it was given: agree with the trainers in the job on the changes so far, and
        return this trainer's share of the rows of the trainers lost since the last agreement (None: no new loss,
        or `give_up()` turned true while waiting for the others). A lost trainer's rows that its restart got back
        (`admit`) are not shared out."""
        while True:
            self.phases += 1
            epoch = self.membership.agree(f"phase{self.phases}", self.trainer, give_up)
            if epoch is None:
                return None
            if self.trainer in self.membership.live(epoch):
                break
            self.taken = max(self.taken, epoch)  # (an agreement made before this trainer joined)
            self._load_shares()
        phase = f"phase{self.phases}"
        tails = self._tails(epoch, phase)
        if epoch <= self.taken and not tails:
            return None
        losses = self.membership.losses(epoch)
        new = [x for x in losses if x.seq > self.taken and self.membership.claim_rows(x.seq, phase) == phase]
        self.taken = max(self.taken, epoch)
        if not new and not tails:  # (the same on every trainer: the claims are the store's)
            return None
        self._load_shares()
        live = self.membership.live(epoch)
        cfg, data, plan = self.job.cfg, self.job.data, self.job.plan
        W = cfg.workers
        shards = self._own_plan()
        base_shards = plan.base_shards if plan is not None else len(shards)
        left = []
        for loss in new:
            left += self._unread(loss, shards)
        for d, limits in tails:  # (the rest of the rows of trainers that joined with a cut: cut_own)
            left += unread(shards[d * W:(d + 1) * W], limits)
        parts = split_plan(left, len(live) * W)
        # the first trainer's cut is every trainer's. Across machines each reads a lost trainer's positions where it
        # sees them: its machine's shared memory (exact), or what it last published (up to ~0.2 s old: rows read
        # again). A lone trainer's loss is cut on its machine (a trainer is left there), the others take that cut.
        key = f"share/{self.phases}"
        roles = self.job.roles
        if any(x.node is None and roles.node_of(roles.rank_of("trainer", x.trainer)) != roles.topo.node for x in new):
            raw = self.membership.wait_for_key(key, f"no trainer wrote {key!r}")
        else:
            raw = self.membership.store.compare_set(key, "", json.dumps({"live": live, "parts": parts}))
        parts = [[tuple(x) for x in part] for part in json.loads(raw)["parts"]]
        self.shares[self.phases] = (live, parts)
        j = live.index(self.trainer)
        share = DataPlan(base_shards, parts, 0)
        return Takeover(trainer_source(cfg, data, j, share), j * W, len(live) * W)

    def _tails(self, epoch: int, phase: str) -> list[tuple[int, list[int]]]:
        """The trainers in the job at `epoch` that joined with a cut (`cut_own`) whose rest no agreement has shared out
        yet, claimed for this one (the same on every trainer: the claims are the store's), with their cuts."""
        store, out = self.membership.store, []
        for d in self.membership.live(epoch):
            if store.check([f"cut/{d}"]) and store.compare_set(f"cut-rows/{d}", "", phase).decode() == phase:
                out.append((d, json.loads(store.get(f"cut/{d}"))))
        return out

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
        row = self._share_row(d)
        pos = row[1:] if row[0] == k else [0] * W
        return k, parts[j * W:(j + 1) * W], pos

    def _share_row(self, d: int) -> list[int]:
        """Trainer d's agreement and positions in its share of lost trainers' rows (Job.share_positions): this
        machine's shared copy, or (a trainer of another machine) what it last published (zeros if it never did)."""
        roles = self.job.roles
        if roles.node_of(roles.rank_of("trainer", d)) == roles.topo.node:
            return [int(p) for p in self.job.share_positions[d]]
        return self.membership.published_share_positions(d) or [0] * (self.job.cfg.workers + 1)

    def _unread(self, loss: Loss, own: list) -> list:
        """The rows the process lost at `loss` had not read: of its own shards (`own`: every trainer's), or, when it
        was given a share of an earlier loss's rows (which it reads once its own are done), of its last share. A
        restart owns its trainer's own rows only if it got them back (`admit`): otherwise they are the earlier
        loss's, shared out with it."""
        d = loss.trainer
        last = self._last_share(d)
        if last is None:
            if not self._owned_rows(loss):
                return []
            W = self.job.cfg.workers
            return unread(own[d * W:(d + 1) * W], self.positions(d))
        _, parts, pos = last
        return unread(parts, pos)

    def _owned_rows(self, loss: Loss) -> bool:
        """Whether the process lost at `loss` read its trainer's own rows: the job's own process, or a restart that
        got them back from the loss before it."""
        before = [x for x in self.membership.losses(loss.seq) if x.trainer == loss.trainer and x.seq < loss.seq]
        return not before or self.membership.rows_claimant(before[-1].seq) == "join"

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


def _prefix(segments: list, rows: int) -> list:
    """The first `rows` rows of a reader shard's `segments`."""
    out = []
    for base, first, n in segments:
        if rows <= 0:
            break
        out.append((base, first, min(n, rows)))
        rows -= n
    return out
