"""A machine that joins a running job in the place of a lost one (across machines: `cocosync train --nnodes N
--node-rank K` started again after its machine's loss, or on another machine with the same command), or of one
awaited since the job's start (`--nnodes MIN:MAX`: recorded as lost before training, its rows unread).

Its launcher finds, in the job's store, a machine recorded as lost whose place no machine has taken, while the
trainers still read their own rows (`claim_node`: `node-join/<n>`); otherwise it goes to the rendezvous as any
machine. It then starts that machine's trainers (not its servers: the lost machine's shards were restored on the
machines left, which keep them). Each trainer joins as a lost trainer started again does on one machine
(recovery.py): it records its join, takes the dense model from a trainer in the job (live recovery: no checkpoint is
read), and reads the rest of its own rows from the positions its lost predecessor last published, unless the
trainers left had already shared them out.

What this machine did with the others is made again with it, through the job's store (gloo groups on a prefix of it:
the job's own groups were formed at its start):

* the lookup exchange: trainer i of every machine in the job, each server's rows sent to the machine that holds its
  shard (loss_across.holders); the joining machine holds none, so all its rows but the hot ones come through it;
* the hot rows' sync: the first trainers of the machines; the joining machine's replica starts from the consensus a
  machine in the job hands it (`HotSync.take`), and that machine's changes since come with the first sync (a
  machine left alone had given its sync up: it syncs again);
* the dense sync, re-formed over every trainer in the job (recovery.py: the joining trainers take the model).

The machines in the job see a join between two rounds of their dense sync (it looks at the membership's epoch every
`Recovery.LOOK_EVERY` seconds): `MachineJoins.prepare` runs before the sync re-forms, once every trainer of the
joining machine has recorded its join. Where the trainers' dense sync is a gloo group (over machines), they leave it
together: they look at the membership at the same round (`Recovery.changed`), so none waits in a collective for a
peer that left for the new group. Machines join one after another: each claim is numbered (`NodeJoin.seq`) and
made while no other machine is joining, every machine takes each join in with the machines in the job as of that
join (`join_machines(upto=)`), and a machine that joined takes in the later ones as the others do (its trainers have
a `MachineJoins` too, run before it first forms the sync: a machine may join while another joins). No machine is lost
after a join without stopping the job (the job's record of lost machines is by node: `LossAcross.took_in`). A claim
holds the trainers' agreements until its trainers have joined, so that none joins after the others agreed without it
(membership.py: `JOINING`). A claim made just before the trainers in the job finished their own rows may come too
late all the same: their dense sync ended before any of them saw the join, and none takes it in. Who comes first
settles it (`settle_join`): the machines in the job, which admit the join before they make its groups, or its
trainers, which give it up once the trainers have read their own rows and no machine admitted them (their place's
rows are then shared out as an awaited or lost machine's are, and the joining machine's command says so).

A lone trainer lost as the job's first loss (loss_across.py) and started again by its keeper (--max-restarts) joins
the same way, alone: it maps its machine's shards, reader positions and hot rows' replica by name, records its join,
and makes a new lookup exchange (`rejoin_key`) with the trainers of its local index on the other machines, which
leave the exchange the substitute on its machine served for it (that one's serving ends as they leave); the
substitute keeps the machine's hot rows' sync. Its dense sync re-forms as above.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from cocosync.shadowsync.job.job import Job
from cocosync.shadowsync.job.link import FIRST_FAILURE
from cocosync.shadowsync.job.loss_across import LossAcross, holders, machine_exchange, machine_group
from cocosync.shadowsync.job.membership import (
    JOINING,
    JOINING_SINCE,
    Join,
    Membership,
    job_ending,
    joins_open,
    loss_batches,
)
from cocosync.shadowsync.job.roles import Roles
from cocosync.shadowsync.model.embeddings import ShardedEmbeddings
from cocosync.shadowsync.model.exchange import LookupExchange
from cocosync.shadowsync.model.hot_rows import HotSync

__all__ = ["NodeJoin", "claim_node", "joined", "joined_nodes", "join_machines", "join_key", "rejoin_key",
           "MachineJoins", "fence_key", "settle_join", "taken_in", "wait_joined", "ADMITTED", "ABANDONED"]

#: the store keys (`<JOIN_GATE>/<seq>`) a machine's claim of a lost or awaited one's place sets first: the job's
#: joins are made one after another, each numbered
JOIN_GATE = "join-gate"
#: the store keys (`<JOIN_FATE>/<node>`) that settle whether the machine that claimed node's place is taken in
JOIN_FATE = "join-fate"
ADMITTED, ABANDONED = "admitted", "abandoned"


@dataclass(frozen=True)
class NodeJoin:
    """A machine that took lost (or awaited) machine `node`'s place: when its launcher claimed it (time.time()), its
    host, and its place in the job's joins (1: the first)."""

    node: int
    time: float
    host: str
    seq: int = 1


def fence_key(node: int) -> str:
    """The store key that would fence the machine that joined in node `node`'s place (never set: a machine that
    joined is not recorded as lost again)."""
    return f"lost-node/{node}/joined"


def join_key(node: int) -> str:
    """The prefix of the groups made when a machine joins in node `node`'s place."""
    return f"join-{node}"


def rejoin_key(trainer: int, restart: int) -> str:
    """The prefix of the lookup exchange made when lone lost trainer `trainer` is started again (its `restart`)."""
    return f"rejoin-t{trainer}-r{restart}"


def claim_node(store: Any, nnodes: int, trainers_per_node: int, host: str) -> tuple[int | None, str]:
    """The lost (or awaited) machine whose place this one takes (`store`: a client of the job's store, under the
    job's prefix): the first one recorded as lost whose place no machine has taken, while the trainers still read
    their own rows, no rank has failed and no other machine is joining; else None and why not (no machine is lost:
    this machine goes to the rendezvous). A claim holds the
    trainers' agreements until its trainers have joined (`JOINING`; each says it is there with `joined`)."""
    lost = [n for n in range(1, nnodes) if store.check([f"lost-node/{n}"])]
    if not lost:
        return None, "no machine of the job is lost or awaited"
    taken = joined_nodes(store, nnodes, abandoned=True)  # (a place given up is not claimed again: it is too late)
    places = [n for n in lost if n not in {j.node for j in taken}]
    if not places:
        return None, "every lost or awaited machine's place has been taken"
    if store.check([FIRST_FAILURE]) or job_ending(store):
        return None, "the job is ending"
    if not joins_open(store):
        return None, "the trainers left have read their own rows and share out the lost ones' (too late to join)"
    if int(store.add(JOINING, 0)) > 0:
        return None, "another machine is joining it now: start this one again once that one has joined"
    seq = len(taken) + 1
    rec = json.dumps(asdict(NodeJoin(places[0], time.time(), host, seq)))
    if store.compare_set(f"{JOIN_GATE}/{seq}", "", rec).decode() != rec:
        return None, "another machine claimed a place at the same moment: start this one again once it has joined"
    store.set(JOINING_SINCE, str(time.time()))
    store.add(JOINING, trainers_per_node)
    store.set(f"node-join/{places[0]}", rec)
    return places[0], ""


def joined(store: Any, trainer: int) -> None:
    """Trainer `trainer` of a machine that claimed a lost one's place recorded its join, or will not (it failed on
    the way: its launcher says so for it); once per trainer."""
    if int(store.add(f"joining-done/{trainer}", 1)) == 1:
        store.add(JOINING, -1)


def settle_join(store: Any, node: int, fate: str) -> str:
    """Settle the fate of the machine that claimed node `node`'s place, `ADMITTED` (a machine in the job, before it
    makes the join's groups) or `ABANDONED` (the joining machine's trainers, too late): the first to say it decides.
    Returns the fate that holds."""
    return store.compare_set(f"{JOIN_FATE}/{node}", "", fate).decode()


def taken_in(membership: Membership, node: int) -> bool:
    """Whether the machines in the job take in the machine that joins in node `node`'s place (its trainers ask once
    they recorded their join): True once a machine in the job admitted it; False once the trainers there have read
    their own rows (or the job stops) and none did: the join is given up (`settle_join`). A TimeoutError if neither
    happens within the membership's timeout."""
    store, key = membership.store, f"{JOIN_FATE}/{node}"
    deadline = time.monotonic() + membership.timeout
    while not store.check([key]):
        if not joins_open(store) or job_ending(store):
            return settle_join(store, node, ABANDONED) == ADMITTED
        if time.monotonic() > deadline:
            raise TimeoutError(f"no machine in the job took in the machine joining in node {node}'s place within "
                               f"{membership.timeout:.0f}s")
        time.sleep(0.02)
    return store.get(key).decode() == ADMITTED


def wait_joined(membership: Membership, roles: Roles, node: int) -> None:
    """Wait until every trainer of the machine that joins in node `node`'s place has recorded its join (each has
    mapped its machine's named segments by then: one that gives the join up waits for this before it leaves, since a
    process unlinks the segments it made or mapped at its exit)."""
    want = set(roles.trainers_of(node))
    deadline = time.monotonic() + membership.timeout
    while True:
        joined = {x.trainer for x in membership.changes() if isinstance(x, Join) and x.trainer in want}
        if joined == want:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the machine joining in node {node}'s place: trainers "
                               f"{sorted(want - joined)} did not join within {membership.timeout:.0f}s")
        time.sleep(0.02)


def joined_nodes(store: Any, nnodes: int, abandoned: bool = False) -> list[NodeJoin]:
    """The machines that joined in lost (or awaited) ones' places, in the order they claimed them; those whose join
    was given up (`settle_join`) too if `abandoned`."""
    out = []
    for n in range(1, nnodes):
        if store.check([f"node-join/{n}"]):
            if not abandoned and store.check([f"{JOIN_FATE}/{n}"]) and \
                    store.get(f"{JOIN_FATE}/{n}").decode() == ABANDONED:
                continue
            out.append(NodeJoin(**json.loads(store.get(f"node-join/{n}"))))
    return sorted(out, key=lambda j: j.seq)


def join_machines(store: Any, roles: Roles, upto: int | None = None) -> tuple[list[int], dict[int, int]]:
    """The machines in the job (those never lost and those that joined, in node order), and the machine that holds
    each embedding server's shard. `upto`: as of the job's `upto`-th join (every machine takes each join in with the
    same machines, whatever joined since)."""
    nnodes = roles.topo.nnodes
    lost = [n for n in range(nnodes) if store.check([f"lost-node/{n}"])]
    joined = {j.node for j in joined_nodes(store, nnodes) if upto is None or j.seq <= upto}
    machines = [n for n in range(nnodes) if n not in lost or n in joined]
    batches = loss_batches(store)  # (the losses as the trainers handled them; any recorded since, as one more)
    rest = [n for n in lost if not any(n in b for b in batches)]
    return machines, holders(nnodes, roles.embedding_per_node, batches + ([rest] if rest else []))


class MachineJoins:
    """A trainer's side of a machine that joins (see the module doc), or of a lone lost trainer started again
    (--max-restarts): `prepare` is its `Recovery.before_regroup`, after the first loss's handling
    (`LossAcross.prepare`)."""

    def __init__(self, job: Job, trainer: int, tables: ShardedEmbeddings, hot_sync: HotSync | None,
                 machine: LossAcross, admitted: tuple[NodeJoin, ...] = ()):
        """`admitted`: the joins this trainer's machine made with the others already (a machine that joined: its
        own and those before it)."""
        self.job, self.trainer, self.tables, self.hot_sync, self.machine = job, trainer, tables, hot_sync, machine
        self.admitted: list[NodeJoin] = list(admitted)
        self.rejoined: list[Join] = []  # lone lost trainers started again, taken in
        self._closing: list[threading.Thread] = []  # the exchanges replaced, each closing with its peers

    def prepare(self) -> bool:
        """Whether a machine's loss explains the sync's change (`LossAcross.prepare`); then, each machine that
        joined since is taken in."""
        if not self.machine.prepare():
            return False
        membership = self.job.membership
        assert membership is not None
        done = {j.node for j in self.admitted}
        for join in joined_nodes(membership.store, self.job.roles.topo.nnodes):
            if join.node not in done:
                self._admit(join, membership)
        lone = membership.lone_loss()
        for again in membership.joins():
            if lone is not None and again.trainer == lone.trainer and again not in self.rejoined:
                self._rejoin(again)
        return True

    def _rejoin(self, again: Join) -> None:
        """Lone lost trainer `again.trainer` started again: the trainers of its local index on the other machines make
        a new lookup exchange with it (its machine's rows come from it again, not from the trainer that served its
        part since its loss, whose serving exchange ends as they leave it). Its machine's hot rows stay with that
        trainer's sync (the restarted one maps the machine's replica)."""
        self.rejoined.append(again)
        roles = self.job.roles
        t = again.trainer
        if roles.slot_of(self.trainer) != roles.slot_of(t) or roles.machine_of(self.trainer) == roles.machine_of(t):
            return
        machines = list(range(roles.topo.nnodes))  # (after a lone trainer's loss, every machine is in the job)
        group = machine_group(self.job, self.trainer, f"exchange/{rejoin_key(t, again.restart)}", machines)
        exchange = machine_exchange(self.job, self.trainer, group, machines,
                                    holders(roles.topo.nnodes, roles.embedding_per_node, []), self.job.shards)
        self._replace(exchange)

    def _admit(self, join: NodeJoin, membership: Membership) -> None:
        roles = self.job.roles
        if settle_join(membership.store, join.node, ADMITTED) != ADMITTED:
            return  # (its trainers gave it up: too late, they read nothing; their place stays lost)
        wait_joined(membership, roles, join.node)
        machines, held = join_machines(membership.store, roles, upto=join.seq)
        key = join_key(join.node)
        shards = {**self.job.shards, **self.machine.adopted}
        self._replace(machine_exchange(self.job, self.trainer, machine_group(self.job, self.trainer,
                                                                             f"exchange/{key}", machines),
                                       machines, held, shards))
        if self.hot_sync is not None:
            firsts = [roles.rank_of("trainer", roles.trainer_at(n, 0)) for n in machines]
            self.hot_sync.regroup(machine_group(self.job, self.trainer, f"hot/{key}", machines), ", ".join(
                f"{roles.rpc_name(r)} (node {roles.node_of(r)})" for r in firsts if r != roles.topo.rank),
                joined=True)
        self.admitted.append(join)
        self.machine.took_in(join.node)

    def _replace(self, exchange: LookupExchange) -> None:
        """This trainer's lookups go through `exchange` from now on; the one it replaces closes with its peers (it
        serves them until every one is done)."""
        old = self.tables.remote
        self.tables.adopt({}, remote=exchange)
        if old is not None:
            closing = threading.Thread(target=old.close, name="cocosync-exchange-close", daemon=True)
            closing.start()
            self._closing.append(closing)
