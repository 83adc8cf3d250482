"""Building one rank's `Job` (job.py), collectively and in the same order on every rank: the network interfaces
of a loopback job, the RPC world, this node's embedding shards in shared memory, EASGD's centre range, the process
groups (the trainers', the dense sync's, the lookup exchange's, the hot rows'), and a resumed job's data plan."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from cocosync.runtime.comm.communicators import register_subgroup
from cocosync.runtime.comm.shm import Arena
from cocosync.runtime.comm.topology import node_groups, spanning_node_groups
from cocosync.shadowsync.checkpoint import read_positions, resharded_trainers
from cocosync.shadowsync.config import ClusterConfig, DataConfig, ModelConfig, TrainConfig
from cocosync.shadowsync.data.plan import DataPlan, replan
from cocosync.shadowsync.data.sources import base_shard_rows
from cocosync.shadowsync.job.job import ExchangeGroups, Job, ReleasableGroup
from cocosync.shadowsync.job.link import Link
from cocosync.shadowsync.job.lookups import exchange_groups, hot_rows, joined_hot_rows
from cocosync.shadowsync.job.loss_across import cross_timeout, save_timeout
from cocosync.shadowsync.job.membership import Membership, record_node_loss
from cocosync.shadowsync.job.node_join import fence_key
from cocosync.shadowsync.job.roles import Roles
from cocosync.shadowsync.job.run_model import run_model
from cocosync.shadowsync.job.segments import NodeTensors
from cocosync.shadowsync.job.survival import Survival
from cocosync.shadowsync.model.shard import RowHash, Shard, initial_rows
from cocosync.shadowsync.model.transport import serve_shard
from cocosync.shadowsync.sync import FlatParams
from cocosync.shadowsync.sync.base import HierarchicalGroup
from cocosync.shadowsync.sync.center import CenterShard, center_bounds, serve_center

__all__ = ["loopback_interfaces", "init_rpc", "build_job", "attach_job", "join_job", "data_plan"]

_LOOPBACK = ("127.", "localhost", "::1")


def loopback_interfaces() -> None:
    """gloo and TensorPipe pick an interface from the hostname, which may be a public one: on a loopback
    rendezvous keep them on `lo` unless the user named an interface."""
    if os.environ.get("MASTER_ADDR", "127.0.0.1").startswith(_LOOPBACK):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")


def init_rpc(cfg: TrainConfig, roles: Roles) -> None:
    """Join the job's RPC world (EASGD's sync servers, `--lookup-transport rpc`) under this rank's role name."""
    topo = roles.topo
    with warnings.catch_warnings():  # torch's own RPC init passes its gloo Backend as a group (deprecated use)
        warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
        # TCP only ("uv"): TensorPipe's shared-memory transport busy-polls a reactor thread per process
        # (measured: 87% of this machine's CPU in system time with 4 processes), and a node's own shards never
        # go through RPC
        rpc.init_rpc(roles.rpc_name(), rank=topo.rank, world_size=topo.world_size,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                         init_method="env://", rpc_timeout=max(60.0, cfg.heartbeat_timeout),
                         _transports=["uv"], _channels=["basic"]))


def build_job(cfg: TrainConfig, cluster: ClusterConfig, roles: Roles, data: DataConfig, model_cfg: ModelConfig, *,
              plan: DataPlan | None, link: Link | None, resumed_from: int) -> Job:
    """Collective over the whole job, in the same order on every rank: shards, EASGD centre, process groups."""
    topo = roles.topo
    kind, index = roles.role()
    E = roles.embedding_per_node
    model = run_model(cfg, data, model_cfg)
    tables = model.plan
    rowhash = RowHash(tables.total_rows, E * topo.nnodes)
    arena = Arena(node_groups())
    survival = Survival.of(cfg, cluster, topo.nnodes, roles.trainers_per_node, link is not None)
    restartable = cfg.max_restarts > 0 and survival.restarts  # (named segments: a restart maps them)
    node = NodeTensors(arena, link.client() if restartable else None, topo.local_rank == 0, topo.node,
                       timeout=cfg.heartbeat_timeout + 30.0)
    shards = _node_shards(cfg, roles, tables, rowhash, node)
    for server, shard in shards.items():  # this node's servers: every local process maps their shards
        if (kind, index) == ("embedding", server):
            shard.weight.copy_(initial_rows(tables.table_rows, tables.width, init_std=model_cfg.embedding_init_std,
                                            seed=model_cfg.seed, rowhash=rowhash, server=server))
            serve_shard(server, shard)
    # the other machine's shards, mirrored here (--shard-mirror-interval, a job that survives a machine's loss)
    mirrored = survival.machine_loss and cluster.shard_mirror_interval > 0 and topo.nnodes == 2
    mirrors: dict[int, Shard] = {}
    mirror_stamps = None
    if mirrored:
        other = 1 - topo.node
        for lr in range(E):
            server = other * E + lr
            n, dim = rowhash.shard_rows(server), tables.width
            mirrors[server] = Shard(arena.shared_empty((n, dim)), arena.shared_empty(n),
                                    arena.shared_empty(n, torch.int64), optimizer=cfg.embedding_optimizer,
                                    lr=cfg.embedding_lr, weight_decay=cfg.embedding_weight_decay)
        mirror_stamps = arena.shared_empty(E, torch.float64)  # when each mirror last took a round (time.time())
    # every trainer's reader positions, where every process of the node sees them (a lost trainer's: where it stopped)
    positions, share_positions = _node_positions(cfg, roles, node)
    hot = hot_rows(cfg, cluster, data, model, node.empty) if topo.nnodes > 1 else None
    flat = FlatParams(model.dense_parameters()).flat
    center = None
    if kind == "sync":
        lo, hi = center_bounds(flat.numel(), roles.sync_per_node * topo.nnodes)[index]
        center = CenterShard(flat[lo:hi], index)
        serve_center(index, center)
    # the groups of the machines there at the start (torch's world): those that join later make theirs through the
    # job's store (node_join.py)
    trainers = roles.present_ranks("trainer")
    trainer_group = dist.new_group(trainers)
    Tn, nnodes, machines = roles.trainers_per_node, topo.nnodes, roles.present or topo.nnodes
    intra = inter = None
    for node in range(machines):  # every rank creates every group, in the same order (new_group is collective)
        members = trainers[node * Tn:(node + 1) * Tn]
        g = dist.new_group(members, backend="cocosync") if Tn > 1 else None
        if node == topo.node:
            intra = g
    for i in range(Tn):
        g = dist.new_group(trainers[i::Tn]) if machines > 1 else None
        if kind == "trainer" and roles.slot_of(index) == i:
            inter = g
    exchange = exchange_groups(cfg, cluster, roles, tables, arena)
    mirror_group = None
    if mirrored:  # embedding server e of each machine mirrors its shard on the other's server e
        for lr in range(E):
            g = dist.new_group(roles.ranks("embedding")[lr::E])
            if (kind, index % E) == ("embedding", lr):
                mirror_group = g
    hot_group = dense_group = hot_peers = None
    if hot is not None:  # the machines' first trainers sync the hot rows
        # (a group for each local index, every trainer holding one: torch names a group that trainers make later by
        # their members alone, after a loss, by how many groups each holds, which must then be equal)
        for i in range(Tn):
            g = dist.new_group(trainers[i::Tn])
            if kind == "trainer" and roles.slot_of(index) == i:
                hot_peers = g
        hot_group = hot_peers if kind == "trainer" and roles.is_first(index) else None
    node_gloo_mine = None
    if cfg.sync.method in ("ma", "bmuf") and cfg.sync.compiled and machines > 1:
        # the compiled MA/BMUF programs over all trainers: shared memory within a node, gloo between nodes (the
        # runtime's hierarchical communicator), the same fused collective as on one machine
        node_gloo = [dist.new_group(trainers[node * Tn:(node + 1) * Tn]) for node in range(machines)]
        if kind == "trainer":
            node_gloo_mine = node_gloo[topo.node]
            register_subgroup(spanning_node_groups(trainers, trainer_group, node_gloo[topo.node], inter, Tn))
            dense_group = trainer_group
    elif kind == "trainer" and cfg.sync.method in ("ma", "bmuf"):
        dense_group = HierarchicalGroup(intra, inter, len(trainers))
    elif kind == "trainer" and cfg.sync.method == "dssync":  # one node (sync_servers_for): a flat group
        dense_group = trainer_group
    # the periodic checkpoints' collectives across machines: a group of their own, which a rank that gave a save up
    # after a machine's loss destroys, releasing the ranks of its machine still waiting for it in the save
    save_group = ReleasableGroup(dist.new_group(list(range(dist.get_world_size())))) if nnodes > 1 else None
    if save_group is not None:  # (its first collective is a periodic save's, once training runs)
        nbytes = tables.total_rows * (tables.width * 4 + 12) + 16 * flat.numel()  # rows, Adagrad, versions; dense
        save_group.group.set_timeout(datetime.timedelta(seconds=save_timeout(cfg.heartbeat_timeout, nbytes)))
    held = ([trainer_group, intra, inter, node_gloo_mine] if kind == "trainer" else []) + [hot_peers, exchange.group,
                                                                                           mirror_group]
    cross = (inter, hot_peers, exchange.group) if kind == "trainer" else ()
    membership = None
    if survival.losses or survival.machine_loss:
        membership = _membership(cfg, roles, link)
    if membership is not None and roles.awaited and topo.rank == 0:  # (before any trainer reads the membership)
        for n in roles.awaited:
            record_node_loss(membership.store, roles, n, 0.0, awaited=True)
    hosts = [""] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())  # also: every shard is initialized before a trainer reads
    hosts += [""] * (topo.world_size - len(hosts))  # (the machines that have not joined)
    return Job(cfg=cfg, cluster=cluster, roles=roles, data=data, model_cfg=model_cfg, tables=tables, rowhash=rowhash,
               shards=shards, trainer_group=trainer_group, exchange=exchange, hot=hot, hot_group=hot_group,
               dense_group=dense_group, center=center, init_dense=flat, hosts=tuple(hosts), plan=plan, link=link,
               resumed_from=resumed_from, membership=membership, positions=positions, share_positions=share_positions,
               held_groups=tuple(g for g in held if g is not None),
               cross_groups=tuple(g for g in cross if g is not None), mirrors=mirrors, mirror_stamps=mirror_stamps,
               mirror_group=mirror_group, save_group=save_group)


def _membership(cfg: TrainConfig, roles: Roles, link: Link) -> Membership:
    """This rank's view of the job's membership: peers that are alive are waited for --heartbeat-timeout + 30 s (a
    trainer started again takes that long at most to come), a member of a group across machines `cross_timeout`."""
    return Membership(link.client(), roles, cfg.min_trainers, timeout=cfg.heartbeat_timeout + 30.0,
                      cross_timeout=cross_timeout(cfg.heartbeat_timeout))


def _node_shards(cfg: TrainConfig, roles: Roles, tables: Any, rowhash: RowHash, node: NodeTensors) -> dict[int, Shard]:
    """This node's embedding shards (zero rows; their servers fill them), by server index."""
    E, shards = roles.embedding_per_node, {}
    for lr in range(E):
        server = roles.topo.node * E + lr
        n, dim = rowhash.shard_rows(server), tables.width
        shards[server] = Shard(node.empty(f"s{server}-w", (n, dim)), node.empty(f"s{server}-acc", n),
                               node.empty(f"s{server}-v", n, torch.int64), optimizer=cfg.embedding_optimizer,
                               lr=cfg.embedding_lr, weight_decay=cfg.embedding_weight_decay)
    return shards


def _node_positions(cfg: TrainConfig, roles: Roles, node: NodeTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Every trainer's reader positions, and its positions in its share of lost trainers' rows (Job.positions,
    Job.share_positions)."""
    return (node.empty("positions", (roles.trainers, cfg.workers), torch.int64),
            node.empty("share-positions", (roles.trainers, cfg.workers + 1), torch.int64))


def attach_job(cfg: TrainConfig, cluster: ClusterConfig, roles: Roles, data: DataConfig, model_cfg: ModelConfig, *,
               plan: DataPlan | None, link: Link, resumed_from: int) -> Job:
    """The `Job` of a lost trainer started again (--max-restarts), built without any collective: it maps the node's
    shards, reader positions and (across machines) replica of the hot rows by name, and is in none of the job's
    process groups (its dense sync and, across machines, its lookup exchange are formed through the store:
    job/recovery.py, job/node_join.py)."""
    topo = roles.topo
    model = run_model(cfg, data, model_cfg)
    tables = model.plan
    rowhash = RowHash(tables.total_rows, roles.embedding_per_node * topo.nnodes)
    timeout = cfg.heartbeat_timeout + 30.0
    node = NodeTensors(None, link.client(), False, topo.node, timeout=timeout)
    shards = _node_shards(cfg, roles, tables, rowhash, node)
    positions, share_positions = _node_positions(cfg, roles, node)
    hot = joined_hot_rows(cfg, cluster, data, model, node.empty) if topo.nnodes > 1 else None
    flat = FlatParams(model.dense_parameters()).flat
    membership = _membership(cfg, roles, link)
    return Job(cfg=cfg, cluster=cluster, roles=roles, data=data, model_cfg=model_cfg, tables=tables, rowhash=rowhash,
               shards=shards, trainer_group=None, exchange=ExchangeGroups(), hot=hot, hot_group=None,
               dense_group=None, center=None, init_dense=flat, hosts=(socket.gethostname(),) * topo.world_size,
               plan=plan, link=link, resumed_from=resumed_from, membership=membership, positions=positions,
               share_positions=share_positions, held_groups=(), cross_groups=(), mirrors={}, mirror_stamps=None,
               mirror_group=None, save_group=None)


def join_job(cfg: TrainConfig, cluster: ClusterConfig, roles: Roles, data: DataConfig, model_cfg: ModelConfig, *,
             plan: DataPlan | None, link: Link, resumed_from: int) -> Job:
    """The `Job` of a trainer of a machine that joins a running job in a lost one's place (job/node_join.py), built
    without any collective: no shards (the machines in the job hold the lost machine's), this machine's reader
    positions and replica of the hot rows as named segments of its own (the node's first trainer makes them, the
    others map them), and no group yet (the trainer makes them with the job once it has recorded its join)."""
    topo = roles.topo
    model = run_model(cfg, data, model_cfg)
    tables = model.plan
    rowhash = RowHash(tables.total_rows, roles.embedding_per_node * topo.nnodes)
    timeout = cfg.heartbeat_timeout + 30.0
    first = roles.is_first(roles.role()[1])
    node = NodeTensors(None, link.client(), first, f"{topo.node}-joined", timeout=timeout)
    positions, share_positions = _node_positions(cfg, roles, node)
    hot = joined_hot_rows(cfg, cluster, data, model, node.empty)
    flat = FlatParams(model.dense_parameters()).flat
    membership = _membership(cfg, roles, link)
    return Job(cfg=cfg, cluster=cluster, roles=roles, data=data, model_cfg=model_cfg, tables=tables, rowhash=rowhash,
               shards={}, trainer_group=None, exchange=ExchangeGroups(), hot=hot, hot_group=None, dense_group=None,
               center=None, init_dense=flat, hosts=(socket.gethostname(),) * topo.world_size, plan=plan, link=link,
               resumed_from=resumed_from, membership=membership, positions=positions,
               share_positions=share_positions, held_groups=(), cross_groups=(), mirrors={}, mirror_stamps=None,
               mirror_group=None, save_group=None, fence_key=fence_key(topo.node))


def data_plan(cfg: TrainConfig, data: DataConfig, roles: Roles, path: Path, meta: dict) -> DataPlan | None:
    """The resumed job's data plan: the checkpoint's, or (another trainer or worker count) a new one over the rows
    its reader shards had not read. Collective (every rank reads the positions)."""
    old = DataPlan.from_json(meta["data_plan"]) if meta.get("data_plan") else None
    T, W = roles.trainers, cfg.workers
    if not resharded_trainers(meta, T, W):
        return old
    positions = read_positions(path, meta)
    plan = replan(old, meta["trainers"] * meta["workers"], positions, T * W,
                  lambda s, n: base_shard_rows(cfg, data, s, n), int(meta["examples_seen"]))
    if roles.topo.rank == 0:
        print(f"resuming {meta['trainers']} x {meta['workers']} reader shards on {T} x {W}: "
              f"{sum(r for s in plan.shards for _, _, r in s):,} unread rows planned onto the new shards",
              file=sys.stderr, flush=True)
    return plan
