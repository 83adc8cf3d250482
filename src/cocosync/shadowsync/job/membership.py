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

Across two machines (`cocosync train --nnodes 2`) the job goes on without the machine that does not host the job's
store when that machine's launcher falls silent (`survives_node_loss`): the launcher that hosts the store records
the loss (`record_node_loss`: `lost-node/<n>`, and each of its trainers and embedding servers as lost above), and the
ranks left restore its shards (job/node_loss.py). Each trainer publishes its reader positions with its heartbeat
(`pos/<t>`), where the others read a lost machine's (`published_positions`).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
from setproctitle import setproctitle

from cocosync.runtime.comm.backend import BACKEND
from cocosync.shadowsync.job.link import FIRST_FAILURE
from cocosync.shadowsync.job.roles import Roles

__all__ = ["Loss", "ServerLoss", "NodeLoss", "Membership", "keep_trainer", "keep_server", "survives_losses",
           "survives_node_loss", "record_node_loss", "Restored", "restored_shards", "LOSSES", "SERVER_LOSSES",
           "NODE_LOSSES", "END", "job_ending"]

LOSSES = "losses"  # the count of lost trainers (a store counter: the membership's epoch)
SERVER_LOSSES = "server-losses"  # the count of lost embedding servers
NODE_LOSSES = "node-losses"  # the count of lost machines
END = "end"  # the agreement of the trainers left at the end of their data (after it, the job's end is collective)
#: seconds between two reads of the store while waiting for peers (a loss, an agreement, a command)
POLL = 0.02


@dataclass(frozen=True)
class Loss:
    """One lost trainer: its index, the pid of its process, the signal that ended it, when (time.time()), and its
    place in the order of losses (1 for the first)."""

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
class ServerLoss:
    """One lost embedding server: its index, pid, the signal that ended it and when (time.time())."""

    server: int
    pid: int
    signal: str
    time: float


@dataclass(frozen=True)
class NodeLoss:
    """One lost machine: its node index, when its loss was recorded (time.time()) and for how long its launcher had
    been silent then (seconds)."""

    node: int
    time: float
    silent_s: float


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


def restored_shards(store: Any, servers: list[int]) -> list[Restored]:
    """The records of the restored shards among `servers` (those recorded)."""
    out = []
    for s in servers:
        if store.check([f"restored/{s}"]):
            out.append(Restored(**json.loads(store.get(f"restored/{s}"))))
    return out


def survives_node_loss(nnodes: int, lookup_transport: str, sync_method: str, sync_servers: int,
                       trainers_per_node: int, min_trainers: int, launched: bool) -> bool:
    """Whether a job goes on without a lost machine: two machines launched by `cocosync train --nnodes` (the machine
    that hosts the job's store survives, the other may be lost), rows between them through the lookup exchange (the
    survivor restores the lost machine's shards and reads every row in place), a dense sync that re-forms among the
    trainers left (MA or BMUF; no EASGD centre on sync servers), and at least --min-trainers on one machine."""
    return (launched and nnodes == 2 and lookup_transport == "exchange" and sync_method in ("ma", "bmuf")
            and sync_servers == 0 and trainers_per_node >= min_trainers)


def record_node_loss(store: Any, roles: Roles, node: int, silent_s: float) -> bool:
    """Record machine `node` as lost (its trainers and embedding servers too, as their keepers would), once: False if
    it was recorded already. `store`: a client of the job's store under the job's prefix."""
    now = time.time()
    rec = json.dumps({"time": now, "silent_s": silent_s})
    if json.loads(store.compare_set(f"lost-node/{node}", "", rec)) != json.loads(rec):
        return False
    for t in (i for i in range(roles.trainers) if roles.node_of(roles.rank_of("trainer", i)) == node):
        seq = int(store.add(LOSSES, 1))
        store.set(f"lost/{t}", json.dumps({"pid": 0, "signal": f"the loss of node {node}", "time": now, "seq": seq,
                                           "node": node}))
    E = roles.embedding_per_node
    for s in range(node * E, (node + 1) * E):
        store.set(f"lost-server/{s}", json.dumps({"pid": 0, "signal": f"the loss of node {node}", "time": now}))
        store.add(SERVER_LOSSES, 1)
    store.add(NODE_LOSSES, 1)
    return True


def job_ending(store: Any) -> bool:
    """Whether the trainers have agreed that the job ends (a machine lost from then on is not survived: the job's end
    runs collectives over every machine's ranks)."""
    return bool(store.check([f"agree/{END}/epoch"]))


def survives_losses(trainers: int, min_trainers: int, nnodes: int, sync_method: str, launched: bool) -> bool:
    """Whether a job goes on without a lost trainer or embedding server: on one machine, launched by `cocosync train`
    (whose store outlives every rank and records the losses), with more trainers than --min-trainers, and a sync
    that can re-form among the trainers left (not DS-Sync)."""
    return launched and nnodes == 1 and min_trainers < trainers and sync_method != "dssync"


class Membership:
    """A rank's view of which trainers are left, read from the job's store (`store`: a client of it, under the
    job's prefix)."""

    def __init__(self, store: Any, roles: Roles, min_trainers: int, timeout: float):
        """`timeout`: seconds a rank waits for peers that are alive (a loss to be recorded, an agreement)."""
        self.store, self.roles, self.min_trainers, self.timeout = store, roles, min_trainers, timeout
        self._current: tuple[tuple[int, ...], Any] | None = None  # the group made last, by its ranks
        self._dropped: list[Any] = []  # groups destroyed by `drop`
        self._losses: dict[int, Loss] = {}

    # -- the record -----------------------------------------------------------------------------------------
    def epoch(self) -> int:
        """Losses recorded so far."""
        return int(self.store.add(LOSSES, 0))

    def losses(self, epoch: int | None = None) -> list[Loss]:
        """The first `epoch` losses (default: all recorded), in order; waits for the records of the counted ones."""
        epoch = self.epoch() if epoch is None else epoch
        deadline = time.monotonic() + self.timeout
        while len(self._losses) < epoch:
            for t in range(self.roles.trainers):
                if t not in self._losses and self.store.check([f"lost/{t}"]):
                    rec = json.loads(self.store.get(f"lost/{t}"))
                    node = rec.get("node")
                    self._losses[t] = Loss(t, int(rec["pid"]), str(rec["signal"]), float(rec["time"]),
                                           int(rec["seq"]), None if node is None else int(node))
            if len(self._losses) < epoch:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{epoch} losses counted but {len(self._losses)} recorded after "
                                       f"{self.timeout:.0f}s")
                time.sleep(POLL)
        return sorted((x for x in self._losses.values() if x.seq <= epoch), key=lambda x: x.seq)

    def live(self, epoch: int | None = None) -> list[int]:
        """The trainers not lost by `epoch` (default: now), in index order."""
        lost = {x.trainer for x in self.losses(epoch)}
        return [t for t in range(self.roles.trainers) if t not in lost]

    def wait_for_loss(self, epoch: int, timeout: float | None = None) -> int | None:
        """The epoch once a loss past `epoch` is recorded, or None if none comes within `timeout` (default: the
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
        """The machines lost so far (their trainers and servers are recorded before the count grows)."""
        count = int(self.store.add(NODE_LOSSES, 0))
        found = []
        for n in range(self.roles.topo.nnodes):
            if len(found) < count and self.store.check([f"lost-node/{n}"]):
                rec = json.loads(self.store.get(f"lost-node/{n}"))
                found.append(NodeLoss(n, float(rec["time"]), float(rec["silent_s"])))
        return found

    def wait_for_node_loss(self, timeout: float | None = None) -> list[NodeLoss]:
        """The machines lost, once one is (empty if none is within `timeout`, default the membership's, or a rank
        reported a failure first)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            if int(self.store.add(NODE_LOSSES, 0)):
                return self.lost_nodes()
            if self.store.check([FIRST_FAILURE]):
                return []
            time.sleep(POLL)
        return []

    def published_positions(self, trainer: int) -> list[int] | None:
        """Trainer `trainer`'s reader positions as it last published them with its heartbeat (None: never)."""
        raw = self.store.get(f"pos/{trainer}") if self.store.check([f"pos/{trainer}"]) else None
        return [int(p) for p in json.loads(raw)] if raw is not None else None

    def record_start(self, trainer: int, examples: int) -> None:
        """Trainer `trainer` starts from `examples` read (its resumed reader positions)."""
        self.store.set(f"start/{trainer}", str(examples))

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

    def start(self, trainer: int) -> int:
        raw = self.store.get(f"start/{trainer}") if self.store.check([f"start/{trainer}"]) else b"0"
        return int(raw)

    # -- agreement among the trainers left ------------------------------------------------------------------
    def agree(self, key: str, trainer: int, give_up: Callable[[], bool] = lambda: False) -> int | None:
        """Every trainer left calls this with the same `key` once it has read all it was given: returns the epoch
        all of them take as the losses so far (the first to see every live trainer arrived fixes it). A trainer
        lost while the others wait is not waited for; one still training is, however long it takes (without a
        collective sync the trainers finish apart; a silent one is the heartbeats' to find). None if `give_up()`
        turns true first (the job is stopping)."""
        self.store.set(f"agree/{key}/{trainer}", "1")
        decided = f"agree/{key}/epoch"
        while not self.store.check([decided]):
            if give_up():
                return None
            epoch = self.epoch()
            if all(self.store.check([f"agree/{key}/{t}"]) for t in self.live(epoch)):
                self.store.compare_set(decided, "", str(epoch))
                break
            time.sleep(POLL)
        return int(self.store.get(decided))

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
        """Destroy those of `groups` not destroyed yet (a group with a lost machine's ranks is of no more use, and
        torch names a group made by its members alone by how many groups each holds: see `_group`)."""
        for group in groups:
            if not any(group is g for g in self._dropped):
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
        """The ranks of every server but the embedding servers `lost_servers`, and of the live trainers `live`, in
        rank order."""
        kept = set(self.trainer_ranks(live))
        gone = {self.roles.rank_of("embedding", s) for s in lost_servers}
        return [r for r in range(self.roles.topo.world_size)
                if (r in kept if self.roles.role(r)[0] == "trainer" else r not in gone)]


def keep_trainer(trainer: int, trainers: int, min_trainers: int, store: Callable[[], Any]) -> bool:
    """Fork this rank: True in the child, which runs the trainer (and must leave through os._exit: it is not the
    process the agent started); in this process, the keeper, which waits for it: False once the trainer finished
    (exit status 0) or was lost, a rank that finished as far as the agent is concerned. A trainer that failed (another
    exit status) ends the keeper with its status; one killed by a signal is recorded as lost if at least
    `min_trainers` are left, else the keeper dies by the same signal (the agent then stops the job, naming it).
    `store()`: a client of the job's store, under the job's prefix."""

    def record(pid: int, sig: int) -> bool:
        client = store()
        seq = int(client.add(LOSSES, 1))
        if trainers - seq < min_trainers:
            client.add(LOSSES, -1)  # not a loss the job goes on from: it stops, naming the trainer
            return False
        client.set(f"lost/{trainer}", json.dumps({"pid": pid, "signal": signal.Signals(sig).name,
                                                  "time": time.time(), "seq": seq}))
        return True

    return _keep(f"trainer {trainer}", record)


def keep_server(server: int, store: Callable[[], Any]) -> bool:
    """As `keep_trainer`, for embedding server `server`: a server killed by a signal is always recorded as lost (its
    shard stays in the machine's shared memory, where the trainers use it)."""

    def record(pid: int, sig: int) -> bool:
        client = store()
        client.set(f"lost-server/{server}", json.dumps({"pid": pid, "signal": signal.Signals(sig).name,
                                                        "time": time.time()}))
        client.add(SERVER_LOSSES, 1)  # (after the record: a reader that counts it finds it)
        return True

    return _keep(f"embedding server {server}", record)


def _keep(what: str, record: Callable[[int, int], bool]) -> bool:
    """Fork, and in the parent wait for the child (see `keep_trainer`); `record(pid, signal)` says whether a child
    killed by a signal was recorded as a loss the job goes on from."""
    pid = os.fork()
    if pid == 0:
        return True
    setproctitle(f"cocosync keeper of {what} (pid {pid})")  # (the child keeps the rank's title)
    # the agent's SIGTERM (the job stopping) ends the keeper, and the child with it (its parent-death signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        if code == 0:
            return False
        os._exit(code)
    sig = os.WTERMSIG(status)
    if record(pid, sig):
        return False
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # (those two have no handler to reset)
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)
