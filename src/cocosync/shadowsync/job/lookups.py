"""How a job's ranks reach other nodes' embedding rows (multi-node): the node's replica of the hot rows, the lookup
exchange's process groups and mailboxes (collective: every rank calls these in the same order), the transport a
trainer uses (its own exchange, its relay to the node's server, or RPC) and the exchange a server runs for its node
(node-exchange)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from cocosync.runtime.comm.shm import Arena
from cocosync.shadowsync.config import EXCHANGES, ClusterConfig, DataConfig, TrainConfig
from cocosync.shadowsync.data.sources import first_sparse
from cocosync.shadowsync.job.job import ExchangeGroups, Job
from cocosync.shadowsync.job.roles import Roles
from cocosync.shadowsync.job.run_model import RunModel
from cocosync.shadowsync.model.exchange import LookupExchange
from cocosync.shadowsync.model.hot_rows import HOT_SAMPLE_ROWS, HotRows, choose_hot_rows
from cocosync.shadowsync.model.node_relay import Mailbox, RelayClient, RelayHost, mailbox_nbytes
from cocosync.shadowsync.model.shard import Shard
from cocosync.shadowsync.model.sharding import TablePlan
from cocosync.shadowsync.model.transport import RemoteRows, RpcRows

__all__ = ["hot_rows", "hot_row_ids", "joined_hot_rows", "exchange_groups", "hosts_exchange", "node_exchange",
           "trainer_transport"]

RELAY_BATCHES = 2  # node-exchange: batches of rows (lookups, or pushes) one mailbox slot holds


def hot_rows(cfg: TrainConfig, cluster: ClusterConfig, data: DataConfig, model: RunModel,
             empty: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]) -> HotRows | None:
    """The node's replica of the hot rows (zeros until `HotSync.fill`), the same ids on every rank: trainer 0's
    choice from the first training rows (`hot_row_ids`), broadcast (collective over the job); in the tensors
    `empty(name, shape, dtype)` makes (`NodeTensors.empty`: named where a restarted trainer maps them)."""
    if cluster.lookup_transport not in EXCHANGES or not cluster.hot_rows:
        return None
    ids = [hot_row_ids(cfg, cluster, data, model) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(ids, src=0)
    return _named_replica(cfg, ids[0], model.plan.width, empty)


def hot_row_ids(cfg: TrainConfig, cluster: ClusterConfig, data: DataConfig, model: RunModel) -> torch.Tensor:
    """The hot set: the --hot-rows rows seen most often in the first HOT_SAMPLE_ROWS training rows (the same on every
    machine that reads them)."""
    sample = first_sparse(cfg, data, HOT_SAMPLE_ROWS)
    if sample is None:
        return torch.empty(0, dtype=torch.int64)
    rows = model.plan.row_ids(model.features(sample))
    return choose_hot_rows(rows, torch.zeros(rows.shape[1], dtype=torch.int64), cluster.hot_rows)


def _replica(cfg: TrainConfig, ids: torch.Tensor, dim: int,
             empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> HotRows | None:
    H = ids.numel()
    if not H:
        return None
    shard = Shard(empty((H, dim), torch.float32), empty((H,), torch.float32), empty((H,), torch.int64),
                  optimizer=cfg.embedding_optimizer, lr=cfg.embedding_lr, weight_decay=cfg.embedding_weight_decay)
    return HotRows(ids, shard)


def joined_hot_rows(cfg: TrainConfig, cluster: ClusterConfig, data: DataConfig, model: RunModel,
                    empty: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]) -> HotRows | None:
    """The hot rows' replica of a machine that joins a running job (job/node_join.py), or the machine's own mapped
    by a trainer started again: the same ids, chosen again from the same rows, in segments `empty(name, shape,
    dtype)` makes or maps (a joining machine's: zeros until `HotSync.take`)."""
    if cluster.lookup_transport not in EXCHANGES or not cluster.hot_rows:
        return None
    return _named_replica(cfg, hot_row_ids(cfg, cluster, data, model), model.plan.width, empty)


def _named_replica(cfg: TrainConfig, ids: torch.Tensor, dim: int,
                   empty: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]) -> HotRows | None:
    names = iter(("hot-w", "hot-acc", "hot-v"))
    return _replica(cfg, ids, dim, lambda shape, dtype: empty(next(names), shape, dtype))


def exchange_groups(cfg: TrainConfig, cluster: ClusterConfig, roles: Roles, tables: TablePlan,
                    arena: Arena) -> ExchangeGroups:
    """The exchange's own groups (a thread of its own uses them): trainer i of every node, or the nodes' first
    servers and a mailbox per local trainer (node-exchange); this rank's of them. Collective."""
    if roles.topo.nnodes == 1 or cluster.lookup_transport not in EXCHANGES or roles.awaited:
        return ExchangeGroups()  # (machines awaited: the trainers make theirs at the start, as after a loss)
    kind, index = roles.role()
    trainers, Tn, E = roles.ranks("trainer"), roles.trainers_per_node, roles.embedding_per_node
    if cluster.lookup_transport == "exchange":
        mine = None
        for i in range(Tn):
            g = dist.new_group(trainers[i::Tn])
            if kind == "trainer" and roles.slot_of(index) == i:
                mine = g
        return ExchangeGroups(mine)
    g = dist.new_group(roles.ranks("embedding")[0::E])
    slot = mailbox_nbytes(RELAY_BATCHES * cfg.batch_size * len(tables.features), tables.width)
    boxes = tuple(Mailbox.of(arena.shared_empty(Mailbox.nbytes(slot), torch.uint8), slot) for _ in range(Tn))
    return ExchangeGroups(g if hosts_exchange(cluster, roles) else None, boxes)


def hosts_exchange(cluster: ClusterConfig, roles: Roles) -> bool:
    """Whether this rank runs its node's lookup exchange (node-exchange: the node's first embedding server)."""
    kind, index = roles.role()
    return (cluster.lookup_transport == "node-exchange" and roles.topo.nnodes > 1 and kind == "embedding"
            and index % roles.embedding_per_node == 0)


def _label(job: Job, r: int) -> str:
    return f"{job.roles.rpc_name(r)}, rank {r}, host {job.hosts[r]}"


def node_exchange(job: Job) -> LookupExchange:
    """The node's lookup exchange on its first embedding server: every trainer of the node relays through it."""
    roles, dim = job.roles, job.tables.width
    E = roles.embedding_per_node
    return LookupExchange(job.exchange.group, job.shards, servers=E * roles.topo.nnodes, servers_per_node=E,
                          dim=dim, interval=job.cluster.exchange_interval,
                          relays=RelayHost(list(job.exchange.mailboxes), dim),
                          labels=[_label(job, r) for r in roles.ranks("embedding")[0::E]])


def trainer_transport(job: Job, t: int, labels: list[str]) -> RemoteRows | None:
    """Trainer t's transport to other nodes' rows (the one place that chooses): its own lookup exchange (with trainer
    t's peers on every node), its relay to the node's exchange (node-exchange), RPC to every remote server, or None
    (one node: every shard is read in place). `labels[s]`: how errors name embedding server s."""
    roles, dim, Tn = job.roles, job.tables.width, job.roles.trainers_per_node
    if roles.topo.nnodes == 1 or roles.awaited:  # (awaited machines: the exchange comes at the start, loss_across.py)
        return None
    if job.cluster.lookup_transport == "rpc":
        names = [None if s in job.shards else roles.rpc_name(r) for s, r in enumerate(roles.ranks("embedding"))]
        return RpcRows(names, dim, max_inflight=job.cluster.max_inflight, group=job.cluster.lookup_batches,
                       labels=labels)
    if job.exchange.group is not None:
        peers = (roles.ranks("trainer")[roles.slot_of(t)::Tn] if not job.exchange.machines
                 else [roles.ranks("trainer")[roles.trainer_at(n, roles.slot_of(t))] for n in job.exchange.machines])
        return LookupExchange(job.exchange.group, job.shards, servers=roles.embedding_per_node * roles.topo.nnodes,
                              servers_per_node=roles.embedding_per_node, dim=dim,
                              interval=job.cluster.exchange_interval, labels=[_label(job, r) for r in peers],
                              owners=job.exchange.owners)
    host = roles.ranks("embedding")[roles.topo.node * roles.embedding_per_node]
    return RelayClient(job.exchange.mailboxes[roles.slot_of(t)], n=roles.topo.nnodes, dim=dim,
                       interval=job.cluster.exchange_interval,
                       leader=f"{roles.rpc_name(host)} (rank {host}, host {job.hosts[host]})",
                       timeout=max(30.0, job.cfg.heartbeat_timeout))
