"""Which trainers and embedding servers of a one-machine job are still there, and what the others do when one is
lost.

A rank is *lost* when its process dies by a signal (kill -9, the OOM killer, the monitor's SIGKILL of a trainer
silent past --heartbeat-timeout). The elastic agent stops every rank when one of them fails, so a rank that may be
lost runs under a *keeper* (`keep_trainer`, `keep_server`): its rank process forks the rank's work and waits for it.
When the child dies by a signal and the job can go on without it, the keeper records the loss in the job's store and
ends as a rank that finished; otherwise it dies by the same signal, and the job stops naming the rank as before.

* A trainer can be lost while at least --min-trainers are left.
* An embedding server can always be lost: its shard lives in the machine's shared memory, which every trainer maps
  and updates in place, so the trainers do not need it to train. Trainer 0 saves the shard in the periodic checkpoints
  instead, and the first trainer left in the last one (periodic checkpoints stop after a trainer's loss).

The record of losses is the store's (the launcher's loopback store, which outlives every rank): `losses` counts them
(the membership's epoch) and `lost/<t>` says which trainer, its pid and signal, in the order they were counted. Every
other rank reads it through `Membership`:

* a trainer whose dense sync failed because a peer died waits for the loss to be recorded and re-forms the sync among
  the trainers left (`dense_group`: a new process group among them only, no collective over the job);
* when the trainers left have read their own shards, they agree (`agree`, through the store) on the losses so far
  and read the lost trainers' unread rows between them;
* the job's end (the results' gather, the last checkpoint, the CPU time) runs over the ranks still there
  (`job_group`).

Servers' losses have a counter and records of their own (`server-losses`, `lost-server/<s>`): they change no
trainer's sync or data, only who is at the job's end.

Across machines (`cocosync train --nnodes N`) the job goes on without a machine that does not host the job's store
when that machine's launcher falls silent (survival.py: `Survival.machine_loss`): the launcher that hosts the store
records the loss (`record_node_loss`: `lost-node/<n>`, and each of its trainers and embedding servers as lost above),
and the ranks left restore its shards and re-form what they did with it (job/loss_across.py); the dense sync re-forms
as above, in a gloo group made through the store where the trainers left span machines. Each trainer publishes its
reader positions with its heartbeat (`pos/<t>`), where the others read a lost machine's (`published_positions`).

A lone trainer of a job across machines is lost as on one machine (`Survival.trainer_loss`: it runs under a keeper,
which records it), while its machine goes on: another trainer of that machine serves the lost one's part of the
lookup exchange (job/loss_across.py). The first to record a loss across machines claims `LOSS_ACROSS`
(`claim_loss_across`): after a lone trainer's, a later loss of either kind stops the job; after a machine's, later
losses of machines are survived in turn (each handled as the trainers recorded it: `Membership.loss_batch`).
Each trainer publishes its positions in its share of lost trainers' rows too (`share-pos/<t>`).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch.distributed as dist
from setproctitle import getproctitle, setproctitle

from cocosync.runtime.comm.backend import BACKEND
from cocosync.runtime.comm.collectives import ShmCommunicator
from cocosync.runtime.comm.gloo_device import gloo_backend
from cocosync.runtime.comm.topology import NodeGroups, Topology
from cocosync.shadowsync.job.link import FIRST_FAILURE
from cocosync.shadowsync.job.roles import Roles
from cocosync.shadowsync.sync.base import GlooGroup, ShmGroup

__all__ = ["Loss", "ServerLoss", "NodeLoss", "Membership", "keep_trainer", "keep_server", "record_node_loss",
           "Restored", "restored_shards", "RestoredRange", "restored_ranges", "centre_key", "restored_key",
           "loss_batches", "EPOCH", "ABSENT", "SERVER_LOSSES", "NODE_LOSSES", "END", "job_ending", "Join",
           "record_change", "joins_open", "JOINING", "JOINING_SINCE", "LOSS_ACROSS", "claim_loss_across", "loss_across",
           "CheckpointsStopped", "record_checkpoints_stopped", "checkpoints_stopped"]

EPOCH = "membership"  # the count of trainers' losses and joins (a store counter: the membership's epoch)
ABSENT = "absent-trainers"  # the trainers lost and not back (a store counter: what --min-trainers is checked on)
FIRST_LOST = "first-lost"  # the trainers whose first process (the job's own) was lost
SERVER_LOSSES = "server-losses"  # the count of lost embedding servers
NODE_LOSSES = "node-losses"  # the count of lost machines
END = "end"  # the agreement of the trainers left at the end of their data (after it, the job's end is collective)
#: trainers of a machine that claimed a lost one's place and have not recorded their join yet (a store counter;
#: `JOINING_SINCE`: when the last claim was made): no agreement is decided while there are any (job/node_join.py)
JOINING = "joining"
JOINING_SINCE = "joining-since"
#: across machines: the job's first loss, claimed by whoever records it ("node": a machine's; "trainer <t>": a lone
#: trainer's); a loss of another kind after it is not survived
LOSS_ACROSS = "loss-across"
#: across machines: the machines of each loss as the trainers handle it (`loss-batch/<k>`: a JSON list), decided once
#: for every machine by the first trainer to handle it
LOSS_BATCH = "loss-batch"
#: seconds between two reads of the store while waiting for peers (a loss, an agreement, a command)
POLL = 0.02


@dataclass(frozen=True)
class Loss:
    """One lost trainer: its index, the pid of its process, the signal that ended it, when (time.time()), and its
    place in the order of changes (the epoch it made)."""

    trainer: int
    pid: int
    signal: str
    time: float
    seq: int
    node: int | None = None  # the machine whose loss it was part of (None: the trainer alone)

    def describe(self) -> str:
        if self.node is not None:
            return f"trainer {self.trainer} was lost with node {self.node}"
        return f"trainer {self.trainer} (pid {self.pid}) was lost: killed by {self.signal}"


@dataclass(frozen=True)
class Join:
    """A lost trainer started again by its keeper (--max-restarts): its index, the new process's pid, which restart
    it is (1 for the first), when it joined (time.time()) and its place in the order of changes."""

    trainer: int
    pid: int
    restart: int
    time: float
    seq: int

    def describe(self) -> str:
        return f"trainer {self.trainer} (pid {self.pid}) joined again (restart {self.restart})"


def record_change(store: Any, kind: str, trainer: int, **fields: Any) -> int:
    """Append a change of the trainers ('lost' or 'joined') to the job's record; returns its place in the order of
    changes (the membership's epoch it makes). Readers count first and wait for the record (`Membership.changes`)."""
    seq = int(store.add(EPOCH, 1))
    store.set(f"change/{seq}", json.dumps({"kind": kind, "trainer": trainer, "time": time.time(), **fields}))
    return seq


@dataclass(frozen=True)
class ServerLoss:
    """One lost embedding server: its index, pid, the signal that ended it and when (time.time())."""

    server: int
    pid: int
    signal: str
    time: float


@dataclass(frozen=True)
class NodeLoss:
    """One lost machine: its node index, when its loss was recorded (time.time()) and for how long its launcher had
    been silent then (seconds); `awaited`: a machine of the job's layout not there at its start (--nnodes MIN:MAX)."""

    node: int
    time: float
    silent_s: float
    awaited: bool = False


@dataclass(frozen=True)
class Restored:
    """One lost embedding server's shard as restored: where its rows came from (a checkpoint's path, or 'initial
    rows'), the job's examples then, and its age in seconds when restored; its rows, and how many of them are hot
    (current: this machine's replica)."""

    server: int
    source: str
    examples: int
    age_s: float
    rows: int
    hot_rows: int
    name: str  # the shared-memory segment (named until every trainer left here has mapped it)
    node: int = 0  # the machine it was restored on
    lost_with: int = 0  # the lost machine that held it (its own, or one that had restored it after an earlier loss)
    batch: int = 1  # the loss it was restored after (`Membership.loss_batch`)


@dataclass(frozen=True)
class RestoredRange:
    """One range of EASGD's centre whose sync server was lost, as adopted by a sync server left (`server`, its RPC
    name): from `source` (a trainer's replica of the range), at `time` (time.time())."""

    range: int
    server: str
    source: str
    time: float
    lost_with: int = 0  # the lost machine whose sync server held it (its own, or one that had adopted it)
    batch: int = 1  # the loss it was adopted after (`Membership.loss_batch`)


def centre_key(batch: int, index: int) -> str:
    """The store key of range `index` of EASGD's centre as adopted after loss `batch` (a range is adopted again when
    the machine of the sync server that adopted it is lost in turn)."""
    return f"centre/{batch}/{index}"


def restored_ranges(store: Any, ranges: int) -> list[RestoredRange]:
    """The records of every adopted range of EASGD's centre so far (of its `ranges`), loss by loss."""
    keys = [centre_key(k, r) for k in range(1, len(loss_batches(store)) + 1) for r in range(ranges)]
    return [RestoredRange(**json.loads(store.get(key))) for key in keys if store.check([key])]


def restored_key(batch: int, server: int) -> str:
    """The store key of embedding server `server`'s shard as restored after loss `batch` (a shard is restored again
    when the machine that held it is lost in turn)."""
    return f"restored/{batch}/{server}"


def loss_batches(store: Any) -> list[list[int]]:
    """The machines lost, as the losses the trainers handled (`Membership.loss_batch`), in order."""
    out: list[list[int]] = []
    while store.check([f"{LOSS_BATCH}/{len(out) + 1}"]):
        out.append([int(n) for n in json.loads(store.get(f"{LOSS_BATCH}/{len(out) + 1}"))])
    return out


def restored_shards(store: Any, servers: int) -> list[Restored]:
    """The records of every shard restored so far (of the job's `servers`), loss by loss."""
    out = []
    for k in range(1, len(loss_batches(store)) + 1):
        for s in range(servers):
            if store.check([restored_key(k, s)]):
                out.append(Restored(**json.loads(store.get(restored_key(k, s)))))
    return out


def claim_loss_across(store: Any, who: str) -> bool:
    """Claim the job's first loss across machines for `who` ("node", or "trainer <t>"): True if it is `who`'s (now or
    before)."""
    return store.compare_set(LOSS_ACROSS, "", who).decode() == who


def loss_across(store: Any) -> str | None:
    """Who claimed the job's first loss across machines ("node", "trainer <t>"), or None."""
    return store.get(LOSS_ACROSS).decode() if store.check([LOSS_ACROSS]) else None


def record_node_loss(store: Any, roles: Roles, node: int, silent_s: float, *, awaited: bool = False) -> bool:
    """Record machine `node` as lost (its trainers and embedding servers too, as their keepers would), once: False if
    it was recorded already. `store`: a client of the job's store under the job's prefix. The caller checked that no
    lone trainer's loss came first (`loss_across`). `awaited`: a machine of the job's layout that was not there at its
    start (--nnodes MIN:MAX), recorded before training as a machine lost then: the machines there hold its shards and
    read its rows unless a machine joins in its place first."""
    claim_loss_across(store, "node")
    now = time.time()
    rec = json.dumps({"time": now, "silent_s": silent_s, **({"awaited": True} if awaited else {})})
    why = f"node {node} not joined yet" if awaited else f"the loss of node {node}"
    if json.loads(store.compare_set(f"lost-node/{node}", "", rec)) != json.loads(rec):
        return False
    for t in (i for i in range(roles.trainers) if roles.node_of(roles.rank_of("trainer", i)) == node):
        store.add(ABSENT, 1)
        record_change(store, "lost", t, pid=0, signal=why, node=node)
    E = roles.embedding_per_node
    for s in range(node * E, (node + 1) * E):
        store.set(f"lost-server/{s}", json.dumps({"pid": 0, "signal": why, "time": now}))
        store.add(SERVER_LOSSES, 1)
    store.set(f"lost-node/{node}/recorded", "1")  # (before the count: a machine counted is recorded whole)
    store.add(NODE_LOSSES, 1)
    return True


#: the job's first periodic checkpoint mark not saved (JSON of `CheckpointsStopped`; set once): none after it is
CHECKPOINTS_STOPPED = "checkpoints-stopped"


@dataclass(frozen=True)
class CheckpointsStopped:
    """The job's periodic checkpoints stopped: its first mark not saved (`examples` of the job) and why."""

    examples: int
    reason: str


def record_checkpoints_stopped(store: Any, examples: int, reason: str) -> None:
    """Record that the periodic checkpoints stop at the mark of `examples`, for `reason`, unless a trainer recorded
    it first (the first mark any trainer skipped is the job's)."""
    store.compare_set(CHECKPOINTS_STOPPED, "", json.dumps(asdict(CheckpointsStopped(examples, reason))))


def checkpoints_stopped(store: Any) -> CheckpointsStopped | None:
    """Where and why the job's periodic checkpoints stopped, if they did."""
    if not store.check([CHECKPOINTS_STOPPED]):
        return None
    return CheckpointsStopped(**json.loads(store.get(CHECKPOINTS_STOPPED)))


def job_ending(store: Any) -> bool:
    """Whether the trainers have agreed that the job ends (a machine lost from then on is not survived: the job's end
    runs collectives over every machine's ranks)."""
    return bool(store.check([f"agree/{END}/epoch"]))


class Membership:
    """A rank's view of which trainers are left, read from the job's store (`store`: a client of it, under the
    job's prefix)."""

    def __init__(self, store: Any, roles: Roles, min_trainers: int, timeout: float,
                 cross_timeout: float | None = None):
        """`timeout`: seconds a rank waits for peers that are alive (a loss to be recorded, an agreement).
        `cross_timeout`: seconds a dense sync's group across machines waits for a member (its connection once formed,
        then each collective; default `timeout`)."""
        self.store, self.roles, self.min_trainers, self.timeout = store, roles, min_trainers, timeout
        self.cross_timeout = timeout if cross_timeout is None else cross_timeout
        self._current: tuple[tuple[int, ...], Any] | None = None  # the group made last, by its ranks
        self._dropped: list[Any] = []  # groups destroyed by `drop`
        self._changes: dict[int, Loss | Join] = {}  # by place in the order of changes

    # -- the record -----------------------------------------------------------------------------------------
    def epoch(self) -> int:
        """Changes of the trainers (losses and joins) recorded so far."""
        return int(self.store.add(EPOCH, 0))

    def changes(self, epoch: int | None = None) -> list[Loss | Join]:
        """The first `epoch` changes (default: all recorded), in order; waits for the records of the counted ones."""
        epoch = self.epoch() if epoch is None else epoch
        deadline = time.monotonic() + self.timeout
        for seq in range(1, epoch + 1):
            while seq not in self._changes:
                if self.store.check([f"change/{seq}"]):
                    rec = json.loads(self.store.get(f"change/{seq}"))
                    if rec["kind"] == "joined":
                        self._changes[seq] = Join(int(rec["trainer"]), int(rec["pid"]), int(rec["restart"]),
                                                  float(rec["time"]), seq)
                    else:
                        node = rec.get("node")
                        self._changes[seq] = Loss(int(rec["trainer"]), int(rec["pid"]), str(rec["signal"]),
                                                  float(rec["time"]), seq, None if node is None else int(node))
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{epoch} changes of the trainers counted but change {seq} not recorded after "
                                       f"{self.timeout:.0f}s")
                time.sleep(POLL)
        return [self._changes[seq] for seq in range(1, epoch + 1)]

    def losses(self, epoch: int | None = None) -> list[Loss]:
        """The losses among the first `epoch` changes (default: all recorded), in order."""
        return [x for x in self.changes(epoch) if isinstance(x, Loss)]

    def joins(self, epoch: int | None = None) -> list[Join]:
        """The joins among the first `epoch` changes (default: all recorded), in order."""
        return [x for x in self.changes(epoch) if isinstance(x, Join)]

    def live(self, epoch: int | None = None) -> list[int]:
        """The trainers in the job after the first `epoch` changes (default: now), in index order."""
        out = set(range(self.roles.trainers))
        for x in self.changes(epoch):
            (out.add if isinstance(x, Join) else out.discard)(x.trainer)
        return sorted(out)

    def first_live(self, epoch: int | None = None) -> list[int]:
        """The trainers left of the job's start (in its default process group: never lost) after `epoch` changes."""
        changed = {x.trainer for x in self.changes(epoch)}
        return [t for t in range(self.roles.trainers) if t not in changed]

    def wait_for_change(self, epoch: int, timeout: float | None = None) -> int | None:
        """The epoch once a change past `epoch` is recorded, or None if none comes within `timeout` (default: the
        membership's) or a rank reported a failure first (a peer failed for another reason)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            now = self.epoch()
            if now > epoch:
                return now
            if self.store.check([FIRST_FAILURE]):
                return None
            time.sleep(POLL)
        return None

    def lost_nodes(self) -> list[NodeLoss]:
        """The machines lost so far, each once it is recorded whole (its trainers and servers too), in node order."""
        found = []
        for n in range(self.roles.topo.nnodes):
            if self.store.check([f"lost-node/{n}/recorded"]):
                rec = json.loads(self.store.get(f"lost-node/{n}"))
                found.append(NodeLoss(n, float(rec["time"]), float(rec["silent_s"]), bool(rec.get("awaited", False))))
        return found

    def wait_for_key(self, key: str, what: str) -> bytes:
        """The store's value at `key` once another rank has set it; a TimeoutError saying `what` did not happen after
        the membership's timeout."""
        deadline = time.monotonic() + self.timeout
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} within {self.timeout:.0f}s")
            time.sleep(POLL)
        return self.store.get(key)

    def loss_batch(self, k: int, nodes: list[int]) -> list[int]:
        """The machines of the job's `k`-th loss of machines, as every trainer handles it: `nodes` (those this trainer
        found recorded since the `k-1`-th), or the machines another trainer decided first (machines lost within
        moments of each other may be seen apart: the first word is every machine's)."""
        raw = self.store.compare_set(f"{LOSS_BATCH}/{k}", "", json.dumps(sorted(nodes)))
        return [int(n) for n in json.loads(raw)]

    def wait_for_node_loss(self, handled: int, timeout: float | None = None) -> bool:
        """Whether more than `handled` machines are recorded as lost, within `timeout` (default the membership's);
        False at once if a rank reported a failure first."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            if int(self.store.add(NODE_LOSSES, 0)) > handled:
                return True
            if self.store.check([FIRST_FAILURE]):
                return False
            time.sleep(POLL)
        return False

    def wait_for_loss_across(self, timeout: float | None = None) -> str | None:
        """Across machines: who claimed the job's first loss (`loss_across`) once one is recorded (a machine's: its
        record counted; a lone trainer's: its change recorded), or None if none is within `timeout` (default the
        membership's) or a rank reported a failure first."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            who = loss_across(self.store)
            if who == "node" and int(self.store.add(NODE_LOSSES, 0)):
                return who
            if who is not None and who != "node" and self.lone_loss() is not None:
                return who
            if self.store.check([FIRST_FAILURE]):
                return None
            time.sleep(POLL)
        return None

    def lone_loss(self) -> Loss | None:
        """Across machines: the lone trainer's loss that was the job's first (None: none, or not recorded yet)."""
        who = loss_across(self.store)
        if who is None or not who.startswith("trainer "):
            return None
        t = int(who.split()[1])
        return next((x for x in self.losses() if x.trainer == t), None)

    def substitute(self, trainer: int) -> int | None:
        """Across machines: the trainer that serves lone lost trainer `trainer`'s part of the lookup exchange (None:
        none said yet)."""
        key = f"lone/{trainer}"
        return int(json.loads(self.store.get(key))["substitute"]) if self.store.check([key]) else None

    def published_positions(self, trainer: int) -> list[int] | None:
        """Trainer `trainer`'s reader positions as it last published them with its heartbeat (None: never)."""
        raw = self.store.get(f"pos/{trainer}") if self.store.check([f"pos/{trainer}"]) else None
        return [int(p) for p in json.loads(raw)] if raw is not None else None

    def published_share_positions(self, trainer: int) -> list[int] | None:
        """Trainer `trainer`'s positions in its share of lost trainers' rows as it last published them (the agreement
        first, then one per worker; None: never)."""
        key = f"share-pos/{trainer}"
        return [int(p) for p in json.loads(self.store.get(key))] if self.store.check([key]) else None

    def record_start(self, trainer: int, examples: int, restart: int = 0) -> None:
        """Trainer `trainer` starts from `examples` read (its resumed reader positions; `restart`: its restart)."""
        self.store.set(f"start/{trainer}" + (f"/{restart}" if restart else ""), str(examples))

    def lost_servers(self) -> list[ServerLoss]:
        """The embedding servers lost so far, by index (waits for the records of the counted ones)."""
        count = int(self.store.add(SERVER_LOSSES, 0))
        deadline = time.monotonic() + self.timeout
        while True:
            found = []
            for s in range(self.roles.embedding_per_node * self.roles.topo.nnodes):
                if self.store.check([f"lost-server/{s}"]):
                    rec = json.loads(self.store.get(f"lost-server/{s}"))
                    found.append(ServerLoss(s, int(rec["pid"]), str(rec["signal"]), float(rec["time"])))
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} server losses counted but {len(found)} recorded after "
                                   f"{self.timeout:.0f}s")
            time.sleep(POLL)

    def server_left(self, server: int, cpu: list[Any]) -> None:
        """Embedding server `server` leaves the job's end (`Survival.servers_leave_at_end`), with its CPU record for the
        summary: (kind, CPU seconds since set-up, those by thread role, its node exchange's counters or None)."""
        self.store.set(f"server-end/{server}", json.dumps(cpu))

    def servers_at_end(self, servers: list[int]) -> tuple[list[list[Any]], list[ServerLoss]]:
        """The CPU records of those of embedding servers `servers` that left the job's end, and the losses of the
        others (before or during the end); waits for one or the other of each."""
        left: dict[int, list[Any]] = {}
        deadline = time.monotonic() + self.timeout
        todo = list(servers)
        while todo:
            for s in list(todo):
                if self.store.check([f"server-end/{s}"]):
                    left[s] = json.loads(self.store.get(f"server-end/{s}"))
                    todo.remove(s)
                elif self.store.check([f"lost-server/{s}"]):
                    todo.remove(s)
            if todo and time.monotonic() > deadline:
                raise TimeoutError(f"embedding server(s) {', '.join(map(str, todo))} neither left the job's end nor "
                                   f"were recorded as lost after {self.timeout:.0f}s")
            if todo:
                time.sleep(POLL)
        return list(left.values()), [x for x in self.lost_servers() if x.server in servers and x.server not in left]

    def start(self, trainer: int, restart: int = 0) -> int:
        """The examples trainer `trainer` had read when it started (its `restart`-th start: 0 the job's own)."""
        key = f"start/{trainer}" + (f"/{restart}" if restart else "")
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def restarts(self, trainer: int, epoch: int | None = None) -> int:
        """How many times trainer `trainer` joined again in the first `epoch` changes (its current process's
        restart)."""
        return sum(1 for x in self.joins(epoch) if x.trainer == trainer)

    # -- agreement among the trainers left ------------------------------------------------------------------
    def agree(self, key: str, trainer: int, give_up: Callable[[], bool] = lambda: False) -> int | None:
        """Every trainer left calls this with the same `key` once it has read all it was given: returns the epoch
        all of them take as the losses so far (the first to see every live trainer arrived fixes it). A trainer
        lost while the others wait is not waited for; one still training is, however long it takes (without a
        collective sync the trainers finish apart; a silent one is the heartbeats' to find). Nor is it decided
        while a machine that claimed a lost one's place has trainers yet to record their join (at most the
        membership's timeout after the claim), so that no trainer joins after the others agreed without it. None if
        `give_up()` turns true first (the job is stopping)."""
        self.store.set(f"agree/{key}/{trainer}", str(self.restarts(trainer)))  # (a lost process's arrival is not its
        self.store.set(f"agree/{key}/any", "1")                                # restart's)
        decided = f"agree/{key}/epoch"
        while not self.store.check([decided]):
            if give_up():
                return None
            epoch = self.epoch()
            if self._joining():
                time.sleep(POLL)
                continue
            if all(self.store.check([f"agree/{key}/{t}"])
                   and int(self.store.get(f"agree/{key}/{t}")) == self.restarts(t, epoch) for t in self.live(epoch)):
                self.store.compare_set(decided, "", str(epoch))
                break
            time.sleep(POLL)
        return int(self.store.get(decided))

    def _joining(self) -> bool:
        """Whether trainers of a machine that claimed a lost one's place are yet to record their join (given up
        the membership's timeout after the claim: its machine failed on the way)."""
        if int(self.store.add(JOINING, 0)) <= 0:
            return False
        return time.time() - float(self.store.get(JOINING_SINCE)) < self.timeout

    def publish_result(self, trainer: int, restart: int, result: dict) -> None:
        """A restarted trainer's measurements at its end (it is in none of the job's process groups: the trainer
        that finishes the job reads them here)."""
        self.store.set(f"result/{trainer}/{restart}", json.dumps(result, default=float))

    def restarted_result(self, trainer: int) -> dict:
        """The measurements of trainer `trainer`'s current restart, once it has published them."""
        key = f"result/{trainer}/{self.restarts(trainer)}"
        deadline = time.monotonic() + self.timeout
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer {trainer} (restarted) gave no result within {self.timeout:.0f}s")
            time.sleep(POLL)
        return json.loads(self.store.get(key))

    def claim_rows(self, seq: int, who: str) -> str:
        """Who reads the unread rows of the trainer lost at change `seq`: the first to claim them of its restart
        ('join') and an agreement that shares them out ('phase<k>'); returns that claimant."""
        return self.store.compare_set(f"rows/{seq}", "", who).decode()

    def rows_claimant(self, seq: int) -> str | None:
        """Who claimed the unread rows of the trainer lost at change `seq` (None: no one yet)."""
        key = f"rows/{seq}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def arrived(self, key: str) -> bool:
        """Whether some trainer has arrived at agreement `key`."""
        return bool(self.store.check([f"agree/{key}/any"]))

    # -- the dense sync among the trainers in the job -------------------------------------------------------
    def sync_group(self, epoch: int, trainer: int,
                   give_up: Callable[[], bool] = lambda: False) -> ShmGroup | GlooGroup | None:
        """The dense sync's group of the trainers in the job after `epoch` changes (`live(epoch)`), made through the
        store alone (a trainer that joined again is in no process group of the job's start): a shared-memory
        communicator named by the epoch where they are on one machine, else a gloo group on the store. Each member
        says it is ready; the first to see every member ready seals the group, and every member uses it. If the
        epoch moves on first (another change), or `give_up()` turns true, the group is abandoned, by every member
        alike: None (form the next one); so is one a member was lost from while it connected."""
        live = self.live(epoch)
        key = f"group/{epoch}"
        self.store.set(f"{key}/ready/{trainer}", "1")
        deadline = time.monotonic() + self.timeout
        while not self.store.check([f"{key}/state"]):
            if all(self.store.check([f"{key}/ready/{t}"]) for t in live):
                self.store.compare_set(f"{key}/state", "", "sealed")
            elif self.epoch() > epoch or give_up() or self.store.check([FIRST_FAILURE]):
                self.store.compare_set(f"{key}/state", "", "abandoned")
            elif time.monotonic() > deadline:
                missing = [t for t in live if not self.store.check([f"{key}/ready/{t}"])]
                raise TimeoutError(f"the dense sync of trainers {live} was not formed within {self.timeout:.0f}s: "
                                   f"trainers {missing} never came")
            else:
                time.sleep(POLL)
        if self.store.get(f"{key}/state") != b"sealed":
            return None
        n, i = len(live), live.index(trainer)
        try:
            if len({self.roles.node_of(r) for r in self.trainer_ranks(live)}) > 1:  # (machines left after a loss)
                pg = gloo_backend(dist.PrefixStore(f"{key}/gloo", self.store), i, n,
                                  datetime.timedelta(seconds=self.cross_timeout))
                return GlooGroup(pg, live)
            job = self.store.compare_set("group-id", "", uuid.uuid4().hex[:10]).decode()
            topo = Topology(rank=i, world_size=n, local_rank=i, local_world_size=n, node=0)
            groups = NodeGroups(topo=topo, job_id=f"{job}-e{epoch}", members=self.trainer_ranks(live))
            return ShmGroup(ShmCommunicator(groups, timeout=self.timeout), live)
        except Exception:
            if self.epoch() > epoch:  # a member was lost after it said it was ready: the next change's group
                return None
            raise

    # -- groups among the ranks left ------------------------------------------------------------------------
    def trainer_group(self, live: list[int]) -> Any:
        """The process group of the live trainers `live` (the `cocosync` backend: shared memory), made by them
        alone: no collective over the job, whose lost ranks would never come."""
        return self._group(self.trainer_ranks(live), BACKEND)

    def job_group(self, live: list[int], lost_servers: list[int], held: tuple[Any, ...] = ()) -> Any:
        """The process group (gloo) of every rank still in the job: the servers not in `lost_servers` and the live
        trainers `live`. `held`: the other groups this rank is a member of (the job's trainer groups), destroyed
        first: see `_group`."""
        self.drop(held)
        return self._group(self.alive_ranks(live, lost_servers), None)

    def drop(self, groups: tuple[Any, ...]) -> None:
        """Destroy those of `groups` not destroyed yet, skipping None (a group with a lost machine's ranks is of no
        more use, and torch names a group made by its members alone by how many groups each holds: see `_group`)."""
        for group in groups:
            if group is not None and not any(group is g for g in self._dropped):
                dist.destroy_process_group(group)
                self._dropped.append(group)

    def _group(self, ranks: list[int], backend: str | None) -> Any:
        """One group at a time: the one before is destroyed first. torch names a group made by its members alone by
        its ranks and by how many groups the process holds, which must then be equal on every member: the trainers'
        groups are held by trainers only, so a group with the servers is made once they are gone."""
        key = tuple(ranks)
        if self._current is not None and self._current[0] == key:
            return self._current[1]
        if self._current is not None:
            dist.destroy_process_group(self._current[1])
            self._current = None
        group = dist.new_group(list(ranks), backend=backend, use_local_synchronization=True,
                               timeout=datetime.timedelta(seconds=self.timeout))
        self._current = (key, group)
        return group

    def trainer_ranks(self, live: list[int]) -> list[int]:
        return [self.roles.rank_of("trainer", t) for t in live]

    def alive_ranks(self, live: list[int], lost_servers: list[int] = ()) -> list[int]:
        """The ranks of every server but the embedding servers `lost_servers` and those of lost machines (their sync
        servers), and of the live trainers `live`, in rank order."""
        kept = set(self.trainer_ranks(live))
        gone = {self.roles.rank_of("embedding", s) for s in lost_servers}
        lost = {n.node for n in self.lost_nodes()} if self.roles.topo.nnodes > 1 else set()
        return [r for r in range(self.roles.topo.world_size)
                if (r in kept if self.roles.role(r)[0] == "trainer" else r not in gone)
                and self.roles.node_of(r) not in lost]


def joins_open(store: Any) -> bool:
    """Whether a lost trainer may still be started again: no trainer has finished its own rows yet (arrived at the
    first agreement, or at the end's)."""
    return not any(store.check([f"agree/{key}/any"]) for key in ("phase1", END))


def keep_trainer(trainer: int, trainers: int, min_trainers: int, store: Callable[[], Any],
                 max_restarts: int = 0, per_node: int | None = None) -> int | None:
    """Fork this rank: in the child, which runs the trainer (and must leave through os._exit: it is not the process
    the agent started), its restart (0: the job's own start); in this process, the keeper, which waits for it: None
    once the trainer finished (exit status 0) or was lost, a rank that finished as far as the agent is concerned. A
    trainer that failed (another exit status) ends the keeper with its status; one killed by a signal is recorded as
    lost if at least `min_trainers` are left (and one of the job's own processes, which finish it) and the trainers
    have not agreed that the job ends, else the keeper dies by the same signal (the agent then stops the job, naming
    it). A lost trainer is started again (a new child, which joins the job) up to `max_restarts` times while
    `joins_open`. `store()`: a client of the job's store, under the job's prefix. `per_node`: across machines, the
    trainers of each: one is lost alone only as the job's first loss, and where its machine keeps a trainer
    (otherwise the keeper dies by the signal, and its machine leaves the job as a lost one)."""

    def record(pid: int, sig: int, restart: int) -> bool:
        client = store()
        if job_ending(client):  # (the job's end is collective over the trainers in the job then)
            return False
        if per_node is not None and (per_node < 2 or loss_across(client) is not None):
            return False
        absent = int(client.add(ABSENT, 1))
        # the job's end runs in its process groups: one of the trainers it started must be left to finish it
        first_lost = int(client.add(FIRST_LOST, 0 if restart else 1))
        if trainers - absent < min_trainers or first_lost >= trainers or \
                (per_node is not None and not claim_loss_across(client, f"trainer {trainer}")):
            client.add(ABSENT, -1)  # not a loss the job goes on from: it stops, naming the trainer
            client.add(FIRST_LOST, 0 if restart else -1)
            return False
        record_change(client, "lost", trainer, pid=pid, signal=signal.Signals(sig).name)
        return True

    def again(restart: int) -> bool:
        client = store()
        if not joins_open(client) or job_ending(client):
            print(f"trainer {trainer} is not started again: the trainers have read their own rows (the others read "
                  "its unread rows)", file=sys.stderr, flush=True)
            return False
        print(f"starting trainer {trainer} again (restart {restart} of {max_restarts})", file=sys.stderr, flush=True)
        return True

    return _keep(f"trainer {trainer}", record, max_restarts, again)


def keep_server(server: int, store: Callable[[], Any], leaves_at_end: bool) -> bool:
    """As `keep_trainer`, for embedding server `server`: a server killed by a signal is recorded as lost (its shard
    stays in the machine's shared memory, where the trainers use it), unless the job is ending and the server takes
    part in its end (`leaves_at_end` false: see `Survival.servers_leave_at_end`); True in the child."""

    def record(pid: int, sig: int, restart: int) -> bool:
        client = store()
        if not leaves_at_end and job_ending(client):  # (the job's end is then collective over every rank left)
            return False
        client.set(f"lost-server/{server}", json.dumps({"pid": pid, "signal": signal.Signals(sig).name,
                                                        "time": time.time()}))
        client.add(SERVER_LOSSES, 1)  # (after the record: a reader that counts it finds it)
        return True

    return _keep(f"embedding server {server}", record) is not None


def _keep(what: str, record: Callable[[int, int, int], bool], restarts: int = 0,
          again: Callable[[int], bool] = lambda restart: False) -> int | None:
    """Fork, and in the parent wait for the child (see `keep_trainer`); `record(pid, signal, restart)` says whether a
    child killed by a signal was recorded as a loss the job goes on from; then, up to `restarts` times while
    `again(restart)`, a new child is forked. Returns the child's restart in the child, None in the keeper."""
    restart, handler, own = 0, signal.getsignal(signal.SIGINT), getproctitle()
    while True:
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGINT, handler)  # (a rank's own, not the keeper's)
            setproctitle(own)  # (the rank's title: a restart is forked by the keeper, titled as such)
            return restart
        setproctitle(f"cocosync keeper of {what} (pid {pid})")  # (the child keeps the rank's title)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # the agent's SIGTERM (the job stopping) ends the keeper, and the child with it (its parent-death signal)
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        if os.WIFEXITED(status):
            code = os.WEXITSTATUS(status)
            if code == 0:
                return None
            os._exit(code)
        sig = os.WTERMSIG(status)
        if record(pid, sig, restart):
            if restart < restarts and again(restart + 1):
                restart += 1
                continue
            return None
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # (those two have no handler to reset)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
