"""What a trainer of a job across machines does at its losses there (`LossAcross`): lost machines (survival.py:
`Survival.machine_loss`; membership.py: `record_node_loss`), each loss in turn, or, as the job's first and only loss,
a lone lost trainer whose machine goes on (below).

When a machine is lost, its embedding shards are restored on the machines left, where their trainers read and
update them in place, and the job's cross-machine parts re-form among those machines. The machines of a job's layout
that did not come to its start (`--nnodes MIN:MAX`: `Roles.awaited`) are recorded as lost before training and handled
here first, alike, before the hot rows' replica is filled (rank.py: `_start_without`).

The first thread of a trainer whose rows from another machine fail (the lookup exchange broke) or whose dense sync
fails waits for the launcher that hosts the job's store to record the machine's loss (with more than two machines,
`SETTLE` seconds more for machines lost with it: they are one loss; the first trainer to handle the loss records its
machines, `Membership.loss_batch`, which every trainer then handles), then, once per process and loss:

* the replicated hot rows: with one machine left they stop syncing (its replica is the truth for those rows); with
  more, their sync re-forms among the machines left (`HotSync.regroup`);
* the groups this trainer holds with the lost machine are destroyed (torch names the groups the trainers left make
  by how many groups each holds: they must hold as many);
* the shards the lost machines held (their own, and those they had restored after an earlier loss) are dealt out
  over the machines left (`holders`: the same on every machine); each of this machine's share is restored into its
  shared memory: its mirror here, a few seconds old (two machines, `--shard-mirror-interval`:
  model/shard_mirror.py), else made by the first trainer left here from the job's last periodic checkpoint, else from
  the checkpoint the job resumed from, else from the tables' initial rows (the seed draws them again), and mapped by
  the others; with the hot rows from this machine's replica. The restored rows' machine, source and age (seconds
  since the mirror's last round or the checkpoint) are recorded in the store (`restored/<k>/<s>`, k the loss) for
  the summary and the monitor;
* the trainer's tables take the restored shards as local (`ShardedEmbeddings.adopt`) and, with more than one machine
  left, a lookup exchange re-formed among them, which sends each server's rows to the machine that holds its shard
  now: the lookups in flight are read in place or asked again there, and the row gradients pushed to the lost
  machine and not yet applied there are lost with it. The groups re-formed here are gloo groups made through the
  job's store (the job's own groups hold the lost machine's ranks);
* with EASGD, each range of the centre whose sync server was lost (or had adopted it) is adopted by a sync server
  left (the first trainer left in the job hands it that range of its replica: the centre is an elastic average of
  the replicas, and this replica is current), recorded in the store (`centre/<k>/<r>`), and every trainer's view of
  the centre sends the range there from then on (sync/center.py: `RemoteCenter.adopt`, `reroute`).

A loss is handled before the dense sync re-forms for it (`Recovery.before_regroup`; a machine's trainers' losses are
recorded before the machine's, whose record is waited for). A machine lost after that is handled the same way, as
long as a machine is left, except after a lone trainer's loss or a machine's join (node_join.py), which stop the job.
The dense sync re-forms among the trainers left (recovery.py), and the lost machine's trainers' unread rows are read
by the trainers left from the positions they last published (`Membership.published_positions`, and
`published_share_positions` for a share of earlier lost trainers' rows): the rows they read since that last heartbeat
are read again.

A lone trainer lost while its machine goes on (survival.py: `Survival.trainer_loss`, recorded by its keeper as the
job's first loss across machines) leaves that machine's shards where they are. Its part of the lookup exchange (the
machine's end of the exchange with the trainers of its local index elsewhere) is served from then on by the first
trainer left on its machine: those trainers and that one make a new exchange group through the job's store, the
substitute serving the machine's shards in it alongside its own exchange, and the lookups in flight are asked again
there. Where the lost trainer synced its machine's hot rows (a machine's first), the substitute takes that over: its
sync starts from the consensus another machine's first hands it, and keeps the machine's replica (this machine's
updates since the last sync go out at the next). Every trainer looks for the job's first loss every `WATCH_EVERY`
seconds (a thread of its own: a substitute whose dense sync is between phases would not see a lone trainer's loss
otherwise), besides finding it through a collective that fails; seeing a lone trainer's, it leaves its old groups'
collectives, so that a collective across machines waiting for a peer that left it for the new groups ends at once.

A machine killed or shut down resets its connections, and its peers' collectives fail at once. One cut off or hung
resets nothing: once training runs, a collective with another machine gives up after `cross_timeout` seconds
(`bound_waits`; until then, the groups' timeout, which covers start-up and a resume's load). So does a collective of
the old groups whose peer left it for the new ones.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from cocosync.runtime.comm.gloo_device import gloo_backend
from cocosync.runtime.comm.shm import (
    create_named,
    leave_collectives,
    map_named,
    pid_alive,
    remove_named,
    unlink_named,
)
from cocosync.shadowsync.checkpoint import load_parts, part_name, read_meta, resolve
from cocosync.shadowsync.job.job import Job
from cocosync.shadowsync.job.membership import (
    Loss,
    Membership,
    NodeLoss,
    Restored,
    RestoredRange,
    centre_key,
    loss_across,
    loss_batches,
    restored_key,
)
from cocosync.shadowsync.model.embeddings import ShardedEmbeddings
from cocosync.shadowsync.model.exchange import LookupExchange
from cocosync.shadowsync.model.hot_rows import HotSync
from cocosync.shadowsync.model.lookup_thread import LookupThread
from cocosync.shadowsync.model.shard import Shard, initial_rows
from cocosync.shadowsync.sync.center import RemoteCenter

__all__ = ["LossAcross", "LAST_CHECKPOINT", "cross_timeout", "save_timeout", "restored_segment", "remove_restored",
           "holders", "machine_group", "machine_exchange"]

#: the store key of the job's last periodic checkpoint ({"path", "examples", "time"}), set by the trainer that wrote
#: its metadata
LAST_CHECKPOINT = "last-checkpoint"


#: seconds a trainer waits after a machine's loss is recorded for other machines lost with it to be recorded (the
#: launcher records every machine silent for as long in one pass, milliseconds apart)
SETTLE = 0.5


#: seconds between two looks of a trainer for a lone trainer's loss across machines (a store read)
WATCH_EVERY = 0.2


#: bytes per second that a periodic checkpoint's slowest writer is granted (a slow network file system)
SAVE_WRITE_FLOOR = 20e6


def save_timeout(heartbeat_timeout: float, nbytes: int) -> float:
    """Seconds a collective of a periodic checkpoint's save across machines may wait: `cross_timeout` plus the time to
    write `nbytes` (every shard and the dense state: no rank writes more) at SAVE_WRITE_FLOOR, since the save's last
    collective waits for its slowest writer. A machine cut off during a save resets no connection: the ranks left give
    the save up after this, rather than at the job's group timeout."""
    return cross_timeout(heartbeat_timeout) + nbytes / SAVE_WRITE_FLOOR


def restored_segment(server: int, pid: int) -> str:
    """The name of the segment that process `pid` (the first trainer left on a machine) restores lost embedding server
    `server`'s shard in. It is unnamed once every trainer of the machine mapped it."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}-{pid}-restored-s{server}"


def remove_restored(pids: Iterable[int]) -> list[str]:
    """Remove the restored shards' segments that processes `pids` (a machine's ranks) left named, once they are gone:
    those of a job that ended while its trainers were restoring or mapping them. Their paths."""
    return [path for pid in pids if not pid_alive(pid) for path in remove_named(f"*-{pid}-restored-s*")]


def cross_timeout(heartbeat_timeout: float) -> float:
    """Seconds a collective with another machine may wait once training runs: --heartbeat-timeout (a stopped trainer
    is named by its own machine's launcher by then), at least 10 (a round of the lookup exchange or of the hot rows'
    sync takes milliseconds; the dense sync's, well under a second)."""
    return max(10.0, heartbeat_timeout)


def holders(nnodes: int, per_node: int, batches: list[list[int]]) -> dict[int, int]:
    """The machine that holds each embedding server's shard after the machines lost in `batches` (each the machines
    handled as one loss, in the order they were handled: `Membership.loss_batch`), the same on every machine. A shard
    stays where it is while its holder is in the job; at each loss, the shards its machines held are dealt out one at a
    time, in server order, to the machine left holding the fewest (the first in node order among equals)."""
    out = {s: s // per_node for s in range(nnodes * per_node)}
    lost: set[int] = set()
    for batch in batches:
        lost |= set(batch)
        left = [n for n in range(nnodes) if n not in lost]
        for s in [s for s in sorted(out) if out[s] in lost]:
            load = {n: sum(1 for m in out.values() if m == n) for n in left}
            out[s] = min(left, key=lambda n: (load[n], n))
    return out


def machine_group(job: Job, trainer: int, key: str, machines: list[int], index: int | None = None) -> Any:
    """A gloo group of trainer `trainer` and its peers of the same local index on `machines` (in node order; this
    trainer's machine among them), made through the job's store under `key`: the job's own groups hold the ranks of
    the machines as they were at its start. `index`: the local index the group is for, where this trainer stands in
    for another of its machine (default: its own)."""
    membership = job.membership
    assert membership is not None  # (a job that survives a machine's loss has one)
    roles = job.roles
    timeout = datetime.timedelta(seconds=cross_timeout(job.cfg.heartbeat_timeout))
    index = roles.slot_of(trainer) if index is None else index
    return gloo_backend(dist.PrefixStore(f"{key}/{index}", membership.store), machines.index(roles.topo.node),
                        len(machines), timeout)


def machine_exchange(job: Job, trainer: int, group: Any, machines: list[int], held: dict[int, int],
                     shards: dict[int, Shard], members: list[int] | None = None) -> LookupExchange:
    """Trainer `trainer`'s lookup exchange on `group` (`machine_group` over `machines`): each server's rows go to the
    machine that holds its shard (`held`), and this machine serves `shards`. `members`: the trainer of each machine
    in the group (default: those of `trainer`'s local index)."""
    roles = job.roles
    E = roles.embedding_per_node
    moved = any(held[s] != s // E for s in range(E * roles.topo.nnodes)) or machines != list(range(roles.topo.nnodes))
    owners = torch.tensor([machines.index(held[s]) for s in range(E * roles.topo.nnodes)],
                          dtype=torch.int64) if moved else None  # (None: each server's own machine, sorted natively)
    members = [roles.trainer_at(n, roles.slot_of(trainer)) for n in machines] if members is None else members
    peers = [roles.ranks("trainer")[t] for t in members]
    return LookupExchange(group, shards, servers=E * roles.topo.nnodes, servers_per_node=E, dim=job.tables.width,
                          interval=job.cluster.exchange_interval,
                          labels=[f"{roles.rpc_name(r)}, rank {r}, host {job.hosts[r]}" for r in peers],
                          owners=owners)


class LossAcross:
    """A trainer's handler of the job's losses across machines, lost machines or a lone lost trainer (see the
    module doc): `__call__(error)` is `ShardedEmbeddings.on_lost` and runs before the dense sync re-forms
    (`prepare`)."""

    def __init__(self, job: Job, trainer: int, tables: ShardedEmbeddings, hot_sync: HotSync | None,
                 center: RemoteCenter | None = None, replica: torch.Tensor | None = None):
        """`center`, `replica`: with EASGD across machines, this trainer's view of the centre and its dense replica
        (flat), whose ranges stand in for the centre's lost ones."""
        self.job, self.trainer, self.tables, self.hot_sync = job, trainer, tables, hot_sync
        self.center, self.replica = center, replica
        self.hot_lost = False  # the hot rows' sync was given up (the replica is the truth now)
        self.adopted: dict[int, Shard] = {}
        self.ranges: list[RestoredRange] = []  # the centre's ranges adopted after the loss (EASGD)
        self.nodes: list[NodeLoss] = []  # the machines lost, as handled here
        self.batches: list[list[int]] = []  # their losses, in order (`holders`)
        self.handled = 0  # the machines lost whose shards this trainer reads through the transport in use
        self.joined: list[int] = []  # the lost machines whose place another machine took (`took_in`)
        self.lone: Loss | None = None  # a lone trainer's loss (its machine goes on)
        self.serves: int | None = None  # the lone lost trainer whose part of the exchange this trainer serves
        self._serving: list[threading.Thread] = []  # that exchange, closing with its peers
        self._serve_errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._outcome: bool | None = None
        self._failed: Exception | None = None
        self._done = threading.Event()
        self._training = threading.Lock()  # held while the watcher leaves this rank's collectives
        self._over = False  # this trainer's training is over (`training_over`)
        self.started = time.time()

    def bound_waits(self) -> None:
        """Training runs: the collectives with other machines give up after `cross_timeout` (a machine cut off
        resets no connection); this trainer watches for the job's first loss (`_watch`)."""
        timeout = datetime.timedelta(seconds=cross_timeout(self.job.cfg.heartbeat_timeout))
        for group in self.job.cross_groups:
            group.set_timeout(timeout)
        threading.Thread(target=self._watch, name="cocosync-loss-watch", daemon=True).start()

    def _watch(self) -> None:
        """Once a lone trainer's loss is recorded as the job's first across machines, this trainer leaves the
        collectives of its old groups while it trains (the sync's: a collective across machines that waits for a peer
        which left it for the new groups ends then, not at its timeout; the new ones are gloo groups, made through the
        store) and handles the loss (`prepare`). A machine's loss is handled where a collective fails (the trainers
        left on one machine re-form their sync in shared memory: a leave could reach it)."""
        membership = self.job.membership
        assert membership is not None
        while not self._done.wait(WATCH_EVERY):
            try:
                who = loss_across(membership.store)
                if who is not None:
                    if who != "node":  # (a machine's loss: the trainers left may re-form in shared memory at once)
                        with self._training:
                            if not self._over:  # (the groups of the job's end are made after training)
                                leave_collectives(f"trainer {who.split()[1]} was lost")
                        self.prepare()
                    return
            except Exception:  # noqa: BLE001 - the failure stands where the trainer meets it (prepare raises again)
                return

    def training_over(self) -> None:
        """This trainer has trained (its sync ended): the watcher no longer leaves its collectives, so that the groups
        made for the job's end are never left."""
        with self._training:
            self._over = True

    def close(self) -> None:
        """The job's end: stop watching; where this trainer served a lost trainer's part of the exchange, wait until
        that exchange's peers are done (its error, if it broke)."""
        self._done.set()
        for thread in self._serving:
            thread.join()
        if self._serve_errors:
            raise RuntimeError(f"the lookup exchange served for lost trainer {self.serves} broke: "
                               f"{self._serve_errors[0]}")

    def __call__(self, error: BaseException) -> bool:
        """True once the loss that explains `error` is recorded and handled here (a machine's shards restored, a lone
        trainer's part of the exchange served again); False if no loss is recorded (the error stands)."""
        known = self.handled  # (first: a loss handled from here on replaced the transport before it counts)
        remote = self.tables.remote  # (a lookup of a transport replaced since failed: explained already)
        return self.prepare(beyond=known if isinstance(remote, LookupThread) and remote.failed else None)

    def prepare(self, beyond: int | None = None) -> bool:
        """Handle the losses recorded and not handled yet: the job's first, then each later loss of machines (where
        the first was a machine's). `beyond`: the transport in use broke when this many machines' losses were
        handled: wait until more are recorded."""
        with self._lock:
            if self._failed is not None:  # (once: a second try would find the first's segments)
                raise RuntimeError(f"the recovery from a lost machine failed: {self._failed!r}")
            try:
                if self._outcome is None:
                    self._outcome = self._handle()
                elif self._outcome and self.job.membership is not None:
                    return self._later(self.job.membership, beyond)
            except Exception as e:
                self._failed = e
                raise
            return self._outcome

    def _later(self, membership: Membership, beyond: int | None) -> bool:
        """A loss of machines after the job's first, handled as the first was (`_machines`), before the dense sync
        re-forms for it (a trainer's losses are recorded before its machine's: the machine's record is waited for).
        A loss after a lone trainer's is not survived (its substitute's exchange spans every machine); a lone trainer
        lost after a machine's takes its machine out (a loss of machines)."""
        handled = {n.node for n in self.nodes}
        if self.lone is None:
            if any(x.node is not None and x.node not in handled for x in membership.losses()):
                beyond = len(handled)  # (its trainers' losses are recorded: its machine's record comes next)
            if beyond is not None and not membership.wait_for_node_loss(beyond):
                return False
        later = [n.node for n in membership.lost_nodes() if n.node not in handled]
        if not later:
            return True
        if self.lone is not None:
            raise RuntimeError(f"node {later[0]} was lost after trainer {self.lone.trainer} was: a job across "
                               "machines goes on after a lone trainer's loss only if no loss follows it (resume from "
                               "its last checkpoint)")
        if self.joined:
            raise RuntimeError(f"node {later[0]} was lost after a machine joined in node {self.joined[0]}'s place: a "
                               "job across machines goes on after a join only if no machine is lost (resume from its "
                               "last checkpoint)")
        self._machines(membership)
        return True

    def came_in(self, membership: Membership, joins: list[int]) -> None:
        """This trainer's machine joined the job (node_join.py), after the joins in `joins` (its own last): the losses
        recorded so far were handled by the machines in the job before it came (it holds none of their shards), and a
        machine lost from now on stops the job, as after any join (`took_in`)."""
        with self._lock:
            self.batches = loss_batches(membership.store)
            batched = {n for batch in self.batches for n in batch}
            self.nodes = [n for n in membership.lost_nodes() if n.node in batched]
            self.handled = len(self.nodes)
            self.joined = list(joins)
            self._outcome = True

    def took_in(self, node: int) -> None:
        """A machine joined in lost node `node`'s place (node_join.py): a machine lost from then on stops the job (the
        losses' record is by node)."""
        self.joined.append(node)

    def _handle(self) -> bool:
        membership = self.job.membership
        assert membership is not None  # (a job that survives a machine's loss has one)
        who = membership.wait_for_loss_across()
        if who is None:
            return False
        if who != "node":
            loss = membership.lone_loss()
            assert loss is not None  # (wait_for_loss_across waited for its record)
            self._lone_trainer(loss, membership)
            return True
        self._machines(membership)
        return True

    def _machines(self, membership: Membership) -> None:
        """The machines lost since the last loss handled here: their shards (and those they had restored) restored on
        the machines left, and the hot rows' sync and the lookup exchange re-formed among those; with EASGD, the
        ranges of the centre their sync servers held adopted."""
        handled = {n.node for n in self.nodes}
        seen = [n for n in membership.lost_nodes() if n.node not in handled]
        # machines not there at the job's start (--nnodes MIN:MAX), all recorded before training: the state after
        # their loss is made before the first row is read, the hot rows' replica filled after it (rank.py)
        at_start = bool(seen) and all(n.awaited for n in seen)
        # machines lost together are recorded one after another: re-form once, after all of them (with two machines
        # only the one that does not host the store can be lost)
        while self.job.roles.topo.nnodes > 2 and not at_start:
            time.sleep(SETTLE)
            recorded = [n for n in membership.lost_nodes() if n.node not in handled]
            if len(recorded) == len(seen):
                break
            seen = recorded
        k = len(self.batches) + 1
        batch = membership.loss_batch(k, [n.node for n in seen])  # (another trainer's word first: every machine's)
        self.batches.append(batch)
        self.nodes += [n for n in membership.lost_nodes() if n.node in batch]
        roles = self.job.roles
        lost = [n.node for n in self.nodes]
        left = [n for n in range(roles.topo.nnodes) if n not in lost]
        tag = "-".join(map(str, lost))  # (names the groups re-formed after these losses, the same on every machine)
        if self.hot_sync is not None and not at_start:
            if len(left) == 1:
                self.hot_sync.abandon()
                self.hot_lost = True
            else:  # the first trainers of the machines left sync on
                firsts = [roles.rank_of("trainer", roles.trainer_at(n, 0)) for n in left]
                self.hot_sync.regroup(self._group(f"hot/{tag}", left), ", ".join(
                    f"{roles.rpc_name(r)} (host {self.job.hosts[r]})" for r in firsts if r != roles.topo.rank))
        if not at_start:  # (the groups of the job's start hold none of the machines awaited)
            membership.drop(self.job.cross_groups)
        E = roles.embedding_per_node
        before = holders(roles.topo.nnodes, E, self.batches[:-1])
        held = holders(roles.topo.nnodes, E, self.batches)
        restored = {s: self._restore(s, membership, k, before[s], hot=not at_start) for s in sorted(held)
                    if held[s] == roles.topo.node and before[s] in batch}
        self.adopted.update(restored)
        remote = None
        if len(left) > 1:  # each server's rows go to the machine that holds its shard now
            remote = machine_exchange(self.job, self.trainer, self._group(f"exchange/{tag}", left), left, held,
                                      {**self.job.shards, **self.adopted})
        self.tables.adopt(restored, remote=remote)
        self.handled = len(self.nodes)
        if self.center is not None:
            self._adopt_ranges(membership, batch, k)

    def _group(self, key: str, left: list[int]) -> Any:
        return machine_group(self.job, self.trainer, key, left)

    def _lone_trainer(self, loss: Loss, membership: Any) -> None:
        """Trainer `loss.trainer` was lost alone: the first trainer left on its machine serves its part of the lookup
        exchange, and (a machine's first) syncs the machine's hot rows (module doc)."""
        job, roles = self.job, self.job.roles
        self.lone = loss
        lost, machines = loss.trainer, list(range(roles.topo.nnodes))
        node, index = roles.machine_of(lost), roles.slot_of(lost)
        substitute = min(t for t in membership.live(loss.seq) if roles.machine_of(t) == node)
        key = f"lost-t{lost}"
        if self.trainer == substitute:  # its exact last positions, from this machine's shared memory (what it last
            store = membership.store    # published is up to a heartbeat old), and who stands in for it
            store.set(f"pos/{lost}", json.dumps(job.positions[lost].tolist()))
            store.set(f"lone/{lost}", json.dumps({"substitute": substitute, "node": node,
                                                  "hot_rows": job.hot is not None and index == 0}))
        members = [substitute if n == node else roles.trainer_at(n, index) for n in machines]
        if self.trainer in members:
            group = machine_group(job, self.trainer, f"exchange/{key}", machines, index=index)
            held = holders(roles.topo.nnodes, roles.embedding_per_node, [])  # (no machine lost)
            exchange = machine_exchange(job, self.trainer, group, machines, held, job.shards, members)
            if self.trainer == substitute:  # (it sends nothing there: done from its first round, it serves)
                self.serves = lost
                self._serving.append(threading.Thread(target=self._serve, args=(exchange,),
                                                      name="cocosync-exchange-served", daemon=True))
                self._serving[-1].start()
            else:  # (lookups in flight on the broken one are asked again here: ShardedEmbeddings.on_lost)
                self.tables.adopt({}, remote=exchange)
        if job.hot is None or index != 0:
            return
        firsts = [substitute if n == node else roles.trainer_at(n, 0) for n in machines]
        if self.trainer not in firsts:
            return
        root = next(i for i, n in enumerate(machines) if n != node)  # (a first that kept its consensus)
        group = machine_group(job, self.trainer, f"hot/{key}", machines, index=0)
        label = ", ".join(f"{roles.rpc_name(r)} (host {job.hosts[r]})" for r in
                          (roles.rank_of("trainer", t) for t in firsts) if r != roles.topo.rank)
        if self.trainer == substitute:
            hot_sync = HotSync(job.hot, group, interval=job.cluster.hot_sync_interval,
                               staleness=job.cluster.hot_staleness, label=label)
            hot_sync.take(root, keep_replica=True)
            hot_sync.start()
            self.hot_sync = self.tables.hot_sync = hot_sync
        else:
            assert self.hot_sync is not None  # (a machine's first syncs its hot rows)
            self.hot_sync.regroup(group, label, joined=True, root=root)

    def _serve(self, exchange: LookupExchange) -> None:
        try:
            exchange.close()
        except BaseException as e:  # noqa: BLE001 - raised by close() at the job's end
            self._serve_errors.append(e)

    def _adopt_ranges(self, membership: Membership, batch: list[int], k: int) -> None:
        """The ranges of EASGD's centre whose sync servers' machines were lost at the job's `k`-th loss of machines
        (`batch`), each adopted by the sync server left holding the fewest ranges (the first among equals): the first
        trainer left in the job hands it that range of its replica (current: the centre is an elastic average of the
        replicas) and records it; every trainer sends the range there from then on. Every trainer's view of where the
        ranges are is the same before each loss, so every one deals them out alike."""
        assert self.center is not None and self.replica is not None
        roles, store = self.job.roles, membership.store
        lost = {n.node for n in self.nodes}
        names = [roles.rpc_name(roles.rank_of("sync", i)) for i in range(len(self.center.servers))]
        left = [i for i in range(len(names)) if roles.node_of(roles.rank_of("sync", i)) not in lost]
        held = [names.index(name) for name in self.center.servers]  # (the sync server of each range now)
        for r in range(len(held)):
            machine = roles.node_of(roles.rank_of("sync", held[r]))
            if machine not in batch:
                continue
            if not left:
                raise RuntimeError(f"range {r} of EASGD's centre was lost with its machine and no sync server is left")
            onto = min(left, key=lambda i: (held.count(i), i))
            held[r] = onto
            key = centre_key(k, r)
            if self.trainer == min(membership.live()):  # (one trainer of the job hands it over)
                lo, hi = self.center.bounds[r]
                self.center.adopt(r, self.replica[lo:hi], names[onto])
                rec = RestoredRange(r, names[onto], f"trainer {self.trainer}'s replica", time.time(), machine, k)
                store.set(key, json.dumps(asdict(rec)))
            else:
                rec = RestoredRange(**json.loads(membership.wait_for_key(
                    key, f"range {r} of EASGD's centre was not adopted by a sync server")))
                self.center.reroute(r, rec.server)
            self.ranges.append(rec)

    def saved_here(self) -> dict[int, Shard]:
        """The shards this machine restored, on the first trainer left here (which saves them in the last
        checkpoint); empty elsewhere."""
        membership = self.job.membership
        if not self.adopted or membership is None or self.trainer != self._here(membership)[0]:
            return {}
        return self.adopted

    def _here(self, membership: Any) -> list[int]:
        """The trainers left on this machine."""
        roles = self.job.roles
        return [t for t in membership.live() if roles.node_of(roles.rank_of("trainer", t)) == roles.topo.node]

    def _restore(self, server: int, membership: Membership, batch: int, lost_with: int, *, hot: bool = True) -> Shard:
        """Server `server`'s shard, lost with machine `lost_with` at the job's `batch`-th loss of machines, in this
        machine's shared memory: its mirror here (--shard-mirror-interval), else made and filled by the first trainer
        left here, and mapped by the others. `hot`: its hot rows from this machine's replica (not before the replica
        is filled: a machine awaited at the job's start)."""
        key = restored_key(batch, server)
        job, store = self.job, membership.store
        here = self._here(membership)
        if server in job.mirrors:
            shard = job.mirrors[server]
            if self.trainer == here[0]:
                E = job.roles.embedding_per_node
                rec = self._hot_rows(server, shard, Restored(server, "mirror", 0,
                                                             time.time() - float(job.mirror_stamps[server % E]),
                                                             shard.weight.shape[0], 0, "", lost_with=lost_with,
                                                             batch=batch))
                store.set(key, json.dumps(asdict(rec)))
            return shard
        n, dim = job.rowhash.shard_rows(server), job.tables.width
        nbytes = n * dim * 4 + n * 4 + n * 8
        if self.trainer == here[0]:
            name = restored_segment(server, os.getpid())
            buf = create_named(name, nbytes)
            shard = self._shard(buf, n, dim)
            rec = dataclasses.replace(self._fill(server, shard, name, hot), lost_with=lost_with, batch=batch)
            store.set(key, json.dumps(asdict(rec)))
        else:
            rec = Restored(**json.loads(membership.wait_for_key(
                key, f"trainer {here[0]} did not restore embedding server {server}'s shard")))
            buf = map_named(rec.name, nbytes, membership.timeout)
            shard = self._shard(buf, n, dim)
        if int(store.add(f"restored-maps/{batch}/{server}", 1)) == len(here):  # every trainer here mapped it
            unlink_named(rec.name)
        return shard

    def _shard(self, buf: torch.Tensor, n: int, dim: int) -> Shard:
        cfg = self.job.cfg
        versions = buf[:n * 8].view(torch.int64)  # (first: 8-byte aligned whatever n and dim)
        w = buf[n * 8:n * 8 + n * dim * 4].view(torch.float32).view(n, dim)
        acc = buf[n * 8 + n * dim * 4:].view(torch.float32)
        return Shard(w, acc, versions, optimizer=cfg.embedding_optimizer, lr=cfg.embedding_lr,
                     weight_decay=cfg.embedding_weight_decay)

    def _fill(self, server: int, shard: Shard, name: str, hot: bool) -> Restored:
        """Fill a restored shard from the freshest copy of its rows (module doc); `hot`: and its hot rows from this
        machine's replica."""
        job = self.job
        found = self._checkpoint()
        if found is not None:
            path, examples, written = found
            load_parts({part_name("embedding", server): shard}, path, no_dist=True)
            source, age = str(path), time.time() - written
        else:
            m = job.model_cfg
            shard.weight.copy_(initial_rows(job.tables.table_rows, job.tables.width, init_std=m.embedding_init_std,
                                            seed=m.seed, rowhash=job.rowhash, server=server))
            source, examples, age = "initial rows", 0, time.time() - self.started
        rec = Restored(server, source, examples, age, shard.weight.shape[0], 0, name)
        return self._hot_rows(server, shard, rec) if hot else dataclasses.replace(rec, node=job.roles.topo.node)

    def _hot_rows(self, server: int, shard: Shard, rec: Restored) -> Restored:
        """Write this machine's replica of the hot rows (the truth for them) into a restored shard; `rec` with their
        count and this machine."""
        job, hot = self.job, 0
        if job.hot is not None:
            for _, slots, _ in job.hot.owned({server: shard}, job.rowhash.servers):
                hot += slots.numel()
            job.hot.write_back({server: shard}, job.rowhash.servers)
        return dataclasses.replace(rec, hot_rows=hot, node=job.roles.topo.node)

    def _checkpoint(self) -> tuple[Path, int, float] | None:
        """(path, examples, when written) of the checkpoint to restore from: the job's last periodic one, else the
        one it resumed from (at the same server count), else None."""
        job = self.job
        store = job.membership.store if job.membership is not None else None
        if store is not None and store.check([LAST_CHECKPOINT]):
            rec = json.loads(store.get(LAST_CHECKPOINT))
            return Path(rec["path"]), int(rec["examples"]), float(rec["time"])
        if job.cluster.resume is not None:
            path = resolve(job.cluster.resume)
            meta = read_meta(path)
            if int(meta["embedding_servers"]) == job.rowhash.servers:
                return path, int(meta["examples_seen"]), (path / "meta.json").stat().st_mtime
        return None
