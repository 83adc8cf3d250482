"""A ShadowSync job across machines, one process per torchrun rank (`python -m cocosync.shadowsync` under torchrun).

Every process joins the gloo default group (and the RPC world where EASGD or `--lookup-transport rpc` needs it),
builds its `Job` (build.py: shards, groups, data plan), then takes its role (roles.py):

* an **embedding server** initializes its shard of the tables (row hash, model/embeddings.py) in the node's shared
  memory (where every process of the node reads and updates it in place) and saves it at checkpoints; with
  `--lookup-transport rpc` it also serves the lookups and pushes of trainers on other nodes;
* a **sync server** holds a range of EASGD's centre and serves exchanges (sync/center.py);
* a **trainer** runs the single-node `Trainer` (W Hogwild workers and the shadow or foreground sync) on its own share
  of the data, with its embedding rows from the servers (its node's shards zero-copy, the others through the lookup
  exchange with the trainer of the same local index on every other node, which serves them from its node's shards;
  prefetched; the hottest rows from its node's replica of them, which the node's first trainer synchronizes with the
  other nodes' in the background, hot_rows.py)
  and its dense sync over the trainers: MA/BMUF as the compiled DSL programs on the runtime's hierarchical
  communicator (shared memory within the node, gloo across nodes; the classes over the same path with
  --no-compiled-sync); EASGD against the sync servers.

At the end the trainers gather their results on trainer 0, which scores the final model on the held-out set (rows
looked up from the servers) and writes summary.json and metrics.jsonl. Nothing binds beyond loopback unless the
rendezvous endpoint is another address (then GLOO_SOCKET_IFNAME / TP_SOCKET_IFNAME name the interface).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from rich.console import Console

from cocosync.runtime.comm import gloo_device, native
from cocosync.runtime.comm.shm import ArenaFull, unlink_pending
from cocosync.shadowsync import thread_cpu
from cocosync.shadowsync.checkpoint import (
    BEST,
    CheckpointWriteError,
    Snapshot,
    Stateful,
    check_resumable,
    load_job,
    part_name,
    read_meta,
    resolve,
    save_job,
)
from cocosync.shadowsync.config import (
    EXCHANGES,
    UNLIMITED_WAIT,
    ClusterConfig,
    ConfigError,
    TrainConfig,
    check_paths,
    config_to_dict,
)
from cocosync.shadowsync.data.sources import (
    build_configs,
    eval_batches,
    trainer_source,
    with_init_ctr,
    with_schema,
)
from cocosync.shadowsync.job.build import (
    attach_job,
    build_job,
    data_plan,
    init_rpc,
    join_job,
    loopback_interfaces,
)
from cocosync.shadowsync.job.eval_curve import BestModel, describe
from cocosync.shadowsync.job.job import ExchangeGroups, Job
from cocosync.shadowsync.job.link import Link
from cocosync.shadowsync.job.lookups import hosts_exchange, trainer_transport
from cocosync.shadowsync.job.lookups import node_exchange as make_node_exchange
from cocosync.shadowsync.job.loss_across import LAST_CHECKPOINT, LossAcross, cross_timeout, machine_group
from cocosync.shadowsync.job.membership import (
    ABSENT,
    END,
    Join,
    Loss,
    ServerLoss,
    checkpoints_stopped,
    joins_open,
    record_change,
    record_checkpoints_stopped,
    restored_ranges,
    restored_shards,
)
from cocosync.shadowsync.job.node_join import (
    MachineJoins,
    NodeJoin,
    join_key,
    join_machines,
    joined,
    joined_nodes,
    rejoin_key,
    taken_in,
    wait_joined,
)
from cocosync.shadowsync.job.recovery import Recovery
from cocosync.shadowsync.job.roles import Roles
from cocosync.shadowsync.job.same_job import check_same_job, job_topology, present_nodes
from cocosync.shadowsync.job.summary import add_job_cpu, finite_mean, lookup_summary
from cocosync.shadowsync.job.trainer import CheckpointMarks, Trainer, TrainerFailure, TrainerState
from cocosync.shadowsync.metrics import MetricsLogger, evaluate, json_safe, plot_ne, read_metrics
from cocosync.shadowsync.model.embeddings import ShardedEmbeddings
from cocosync.shadowsync.model.hot_rows import HotSync
from cocosync.shadowsync.model.shard_mirror import ShardMirror
from cocosync.shadowsync.sync.center import RemoteCenter, served_ranges

__all__ = ["run_cluster", "run_restarted", "run_joined"]

#: seconds a failed server waits before it leaves, so that the trainers report the lost peer first
SERVER_EXIT_GRACE = 5.0


def run_cluster(cfg: TrainConfig, cluster: ClusterConfig, *, console: Any = None) -> dict | None:
    """Run this process's role of the job; returns the summary on trainer 0, None elsewhere."""
    console = console or Console(stderr=True)
    topo = job_topology()
    roles = Roles(topo, cluster.embedding_servers, cluster.sync_servers_for(cfg.sync.method, nodes=topo.nnodes),
                  present=present_nodes())
    cfg = dataclasses.replace(cfg, trainers=roles.trainers)  # validated again with the job's trainer count
    check_paths(cfg)
    cfg = with_init_ctr(with_schema(cfg))  # every process reads the same first rows: the same value
    resume = meta = None
    if cluster.resume is not None:  # checked on every rank before anything starts: all fail alike
        resume = resolve(cluster.resume)
        meta = read_meta(resume)
        check_resumable(meta, cfg, resume)
    loopback_interfaces()
    link = Link.from_env(topo.rank)
    # --timeout asks the trainers to stop (the launcher, else each trainer itself); the groups' own timeout comes
    # after that stop (without a --timeout: torch's default, a hung peer fails the job after it; the launcher's
    # heartbeats sooner)
    later = 300 if link is not None or cfg.timeout is not None else 0
    timeout = datetime.timedelta(seconds=(cfg.timeout or UNLIMITED_WAIT) + later)
    torch.set_num_threads(cfg.threads)
    # every group of the job on the process's one gloo device: one I/O thread, not one per group (gloo_device.py)
    dist.init_process_group(gloo_device.BACKEND, timeout=timeout)
    # RPC carries lookups to other machines' shards and EASGD's exchanges with its sync servers: a one-node job
    # without EASGD has none (its trainers use the node's shards in place) and starts no RPC agent
    uses_rpc = (topo.nnodes > 1 and cluster.lookup_transport == "rpc") or cfg.sync.method == "easgd"
    try:
        if topo.nnodes > 1:  # each machine parsed its own command line
            check_same_job(cfg, cluster, topo)
        if uses_rpc:
            init_rpc(cfg, roles)
        if (roles.role()[0] == "trainer" or hosts_exchange(cluster, roles)) and native.enabled():
            # built before training, not in its first sync
            if link is not None and roles.role()[1] == 0 and not native.is_built():
                link.set("status", "building the native module once on this machine (~20 s)")
            native.one_shot()
        data, model_cfg = build_configs(cfg)
        plan = data_plan(cfg, data, roles, resume, meta) if resume is not None else None
        job = build_job(cfg, cluster, roles, data, model_cfg, plan=plan, link=link,
                     resumed_from=int(meta["examples_seen"]) if meta is not None else 0)
        kind, index = roles.role()
        # one machine: the embedding servers leave the job's end to the trainers, so one lost meanwhile is survived
        leaving = _servers_leave(job)
        exchanged = None  # node-exchange: what this server's exchange did (the summary's exchange counters)
        run = _make_trainer(job, index, console) if kind == "trainer" else None
        part: Stateful = (job.shards[index] if kind == "embedding" else job.center if kind == "sync"
                          else run.trainer)  # what this rank saves in a checkpoint, and loads at a resume
        name, owner = part_name(kind, index), f"{kind}{index}"
        if resume is not None:
            load_job(kind, index, part, resume, meta, rowhash=job.rowhash, centre_numel=job.dense_params,
                     sync_servers=roles.sync_per_node * topo.nnodes, trainers=roles.trainers, workers=cfg.workers)
            dist.barrier()  # every part is back before a trainer reads a row
        # the hot rows' replica, before any row is read (with machines awaited: once the shards they would hold are
        # here, _start_without)
        if run is not None and run.hot_sync is not None and not roles.awaited:
            run.hot_sync.fill(job.shards, job.rowhash.servers)
            run.hot_sync.start()
        cpu0, threads0 = time.process_time(), thread_cpu.snapshot()
        if run is not None:
            _periodic_checkpoints(job, run, index)
            summary, alive, gone = _run_trainer(job, run, index)
            command = _command(job, "end", alive, leader=alive[0] if alive else 0, lost_servers=gone)
            alive, gone = command.alive, command.lost_servers
            _settle_hot(job, run, close=True)
            run.tables.close()  # serves the other nodes' lookups until every trainer is done with its own
            if run.machine is not None:  # (and a lost trainer's part of the exchange, where this one took it over)
                run.machine.close()
        else:  # servers serve, and save their part at each periodic checkpoint, until the trainers are done
            summary = None
            node_exchange = make_node_exchange(job) if job.exchange.group is not None else None
            mirror = _start_mirror(job, index) if kind == "embedding" else None
            while (command := _command(job, None)).name in ("checkpoint", "skip"):
                if command.name == "skip" or command.lost_servers or (kind == "embedding" and leaving):
                    continue  # none, or the trainers' own (_periodic_checkpoints)
                try:
                    _save_served(job, {name: part}, owner)
                except Exception as e:  # (a machine lost during the save: the trainers give this checkpoint up)
                    if job.membership is None or job.save_group is None:
                        raise
                    _leave_save(job, e)
                    if job.membership.wait_for_loss_across() is None:
                        raise
            alive, gone = command.alive, command.lost_servers
            if mirror is not None:
                _close_mirror(job, mirror, gone)
            if node_exchange is not None:  # serves the other nodes until every trainer of every node is done
                node_exchange.close()
                exchanged = {"rounds": node_exchange.rounds, "messages": node_exchange.rounds * (node_exchange.n - 1),
                             "wire_bytes": node_exchange.bytes_sent, "exchange_cpu_s": node_exchange.cpu_s,
                             "stale_sum": node_exchange.take_stale()}
            if kind == "embedding" and leaving:  # (its shard is in shared memory: the trainers save it)
                job.membership.server_left(index, [kind, time.process_time() - cpu0,
                                                   thread_cpu.role_cpu_since(threads0), exchanged])
                dist.destroy_process_group()
                return None
        # the rest runs over the ranks still in the job: every rank but lost trainers and servers (made by them
        # alone); the first trainer left writes the summary and the checkpoint's metadata (trainer 0 unless it was
        # lost)
        group, writer = None, roles.rank_of("trainer", alive[0] if alive else 0)
        if job.save_group is not None:  # (every rank holds as many groups as the others when the job's group is made)
            job.save_group.release()
        servers = list(range(job.rowhash.servers)) if leaving else gone
        if (alive is not None or servers) and job.membership is not None:
            live = alive if alive is not None else list(range(roles.trainers))
            group = job.membership.job_group(live, servers, held=job.held_groups)
        dist.barrier(group=group)
        if cfg.checkpoint:
            meta = _meta(job, summary["examples"] + summary["resumed_from"], summary["stopped"]) if summary else None
            saved = Snapshot(part.state_dict()) if run is not None else part  # (a trainer's between sync rounds)
            parts: dict[str, Stateful] = {name: saved}
            if summary is not None and summary["lost"]:
                parts.update(_lost_parts(job, summary, saved, meta))
            if run is not None and run.machine is not None:  # the shards this machine restored after a loss
                parts.update({part_name("embedding", s): shard for s, shard in run.machine.saved_here().items()})
            elif summary is not None:  # the shards of the servers not in the end, from shared memory (one machine)
                parts.update({part_name("embedding", s): job.shards[s] for s in servers})
            if kind == "sync":  # its range, and those it adopted from lost ones (EASGD across machines)
                parts[name] = Snapshot({k: v for c in served_ranges().values() for k, v in c.state_dict().items()})
            ckpt = save_job(parts, Path(cfg.out_dir), meta, owner=owner, writer=writer, group=group)
            if summary is not None:
                summary["checkpoint"] = str(ckpt)
        # the servers' CPU time since set-up, for the job's examples per CPU-second (servers included)
        cpu: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(cpu, (kind, time.process_time() - cpu0, thread_cpu.role_cpu_since(threads0), exchanged),
                               group=group)
        if summary is not None:
            if leaving:  # the servers' own records, or their losses (one may be lost while the job ends)
                left, lost = job.membership.servers_at_end(servers)
                cpu += left
                known = {x["server"] for x in summary["lost_servers"]}
                summary["lost_servers"] += [_server_loss(x) for x in lost if x.server not in known]
            add_job_cpu(summary, cpu, Path(job.cfg.out_dir))
        if link is not None and kind == "trainer":
            link.finish(index)
        if uses_rpc:
            # (a graceful shutdown waits for every worker, lost ones too)
            rpc.shutdown(graceful=alive is None and not gone)
    except BaseException:
        # a broken job: say why, then leave at once. A graceful RPC shutdown or a process-group teardown would
        # wait for the peer that is gone; torchrun reports this rank's exit and stops the others.
        err = sys.exc_info()[1]  # bad input found by a rank (a damaged checkpoint): its message says it all
        known = (ConfigError, ArenaFull, CheckpointWriteError, TrainerFailure)  # (their message says it all)
        text = str(err) if isinstance(err, known) else traceback.format_exc()
        if link is not None:
            link.failed(text)
        _record_error(text)
        unlink_pending()  # a segment a dead peer never mapped (os._exit skips the atexit hook that would)
        print(f"{roles.rpc_name()} (rank {topo.rank}, node {topo.node}) failed:\n{text}",
              file=sys.stderr, flush=True)  # plain text: rich would wrap it and parse the [brackets] of gloo's
        if roles.role()[0] != "trainer":
            # a server waiting for trainer 0's next command fails as soon as any peer's gloo connection closes,
            # which says only an address; its exit would make torchrun stop this node's trainer before that
            # trainer's next lookup names the lost server (seen in CI): give the trainers the first word
            time.sleep(SERVER_EXIT_GRACE)
        os._exit(1)
    dist.destroy_process_group()
    return summary


def _late_job(cfg: TrainConfig, cluster: ClusterConfig, build: Callable[..., Job], no_launcher: str) -> Job:
    """The `Job` of a trainer that joins a running job (a restart, or a machine in a lost one's place), built by
    `build` (attach_job, join_job) without any collective; its launcher's link is required (`no_launcher`: why)."""
    topo = job_topology()
    roles = Roles(topo, cluster.embedding_servers, cluster.sync_servers_for(cfg.sync.method, nodes=topo.nnodes))
    cfg = with_init_ctr(with_schema(dataclasses.replace(cfg, trainers=roles.trainers)))
    loopback_interfaces()
    link = Link.from_env(topo.rank)
    if link is None:
        raise RuntimeError(no_launcher)
    torch.set_num_threads(cfg.threads)
    resume = resolve(cluster.resume) if cluster.resume is not None else None
    meta = read_meta(resume) if resume is not None else None
    data, model_cfg = build_configs(cfg)
    plan = data_plan(cfg, data, roles, resume, meta) if resume is not None else None
    return build(cfg, cluster, roles, data, model_cfg, plan=plan, link=link,
                 resumed_from=int(meta["examples_seen"]) if meta is not None else 0)


def run_restarted(cfg: TrainConfig, cluster: ClusterConfig, restart: int, *, console: Any = None) -> None:
    """A lost trainer started again by its keeper (--max-restarts): it joins the running job without any collective
    of the job's start (job/recovery.py: it takes the dense model from a trainer in the job), reads the rest of its
    rows (or what the agreements give it), and leaves its measurements in the store for the trainer that finishes
    the job, which also saves its part of the last checkpoint. Across machines (a lone trainer lost as the job's
    first loss) it also makes its lookup exchange with the trainers of its local index once it has joined."""
    started = time.time()
    console = console or Console(stderr=True)
    job = _late_job(cfg, cluster, attach_job, "a restarted trainer needs the job's launcher (cocosync train)")
    roles, link, membership = job.roles, job.link, job.membership
    assert link is not None and membership is not None  # (_late_job's and attach_job's Job have them)
    t = roles.role()[1]
    across = roles.topo.nnodes > 1  # (its lookup exchange is made with its peers once it has joined)
    run = None if across else _make_trainer(job, t, console, restart)
    resumed = int(job.positions[t].sum())
    built = time.time()
    membership.record_start(t, resumed, restart)
    membership.store.add(ABSENT, -1)
    record_change(membership.store, "joined", t, pid=os.getpid(), restart=restart)
    if run is None:
        try:
            rejoined: Job | None = _rejoined_exchange(job, t, restart)
        except Exception:
            if joins_open(membership.store):
                raise
            rejoined = None  # (the others finished their own rows meanwhile, and admit no one: too late)
        if rejoined is not None:
            run = _make_trainer(rejoined, t, console, restart, joined=True)
            built = time.time()
    sync = None
    if run is not None:
        assert run.trainer.recovery is not None  # (attach_job's Job has a membership)
        sync = run.trainer.recovery.admit(run.trainer.sync, give_up=lambda: not joins_open(membership.store))
    if sync is None:  # the others finished their own rows meanwhile: they read this trainer's
        membership.store.add(ABSENT, 1)
        record_change(membership.store, "lost", t, pid=os.getpid(), signal="its restart came too late to join")
        print(f"trainer {t} (restart {restart}) did not join: the trainers had read their own rows", file=sys.stderr,
              flush=True)
        return
    trainer, recovery = run.trainer, run.trainer.recovery
    trainer.sync = sync
    admitted = time.time()
    result = trainer.train()
    membership.agree(END, t)
    result = {k: v for k, v in result.items() if k not in ("dense", "state")}
    # (its rows before this start were the lost process's: not resumed ones); published before its lookup exchange
    # closes, which waits for its peers, one of which may be the trainer that reads it
    membership.publish_result(t, restart, {**result, "resumed_from": 0, "restart": restart, "pid": os.getpid(),
                                           "started": started, "built": built, "admitted": admitted,
                                           "state_from": recovery.state_from,
                                           "reads_own": recovery.reads_own,
                                           **({"node": roles.topo.node} if across else {})})
    run.tables.close()
    link.finish(t)


def _rejoined_exchange(job: Job, t: int, restart: int) -> Job:
    """Across machines: the job of lone lost trainer `t` started again, with its lookup exchange made with the trainers
    of its local index on the other machines (node_join.py: `MachineJoins`), which serve its rows from then on."""
    machines = list(range(job.roles.topo.nnodes))  # (after a lone trainer's loss, every machine is in the job)
    group = machine_group(job, t, f"exchange/{rejoin_key(t, restart)}", machines)
    return dataclasses.replace(job, exchange=ExchangeGroups(group, machines=tuple(machines)))


def run_joined(cfg: TrainConfig, cluster: ClusterConfig, *, console: Any = None) -> None:
    """A trainer of a machine that joins the running job in a lost machine's place (job/node_join.py): it records its
    join, makes the lookup exchange (and, the machine's first trainer, the hot rows' sync) with the machines in the
    job, takes the dense model from a trainer there, reads the rest of its lost predecessor's rows, and leaves its
    measurements in the store for the trainer that finishes the job."""
    started = time.time()
    console = console or Console(stderr=True)
    job = _late_job(cfg, cluster, join_job, "a machine joins a running job through its launcher (cocosync train "
                    "--nnodes)")
    roles, topo, link = job.roles, job.roles.topo, job.link
    assert link is not None  # (_late_job's Job has one)
    t = roles.role()[1]
    membership = job.membership
    assert membership is not None  # (join_job's Job has one)
    published = membership.published_positions(t)
    if published is None and any(n.node == topo.node and n.awaited for n in membership.lost_nodes()):
        published = [0] * job.cfg.workers  # (a machine awaited since the job's start: none of its rows was read)
    if published is None:
        raise RuntimeError(f"trainer {t} of the lost machine never published its reader positions: its rows cannot "
                           "be read again from where it stopped")
    job.positions[t] = torch.tensor(published, dtype=torch.int64)
    restart = membership.restarts(t) + 1
    membership.record_start(t, sum(published), restart)
    membership.store.add(ABSENT, -1)
    record_change(membership.store, "joined", t, pid=os.getpid(), restart=restart, node=topo.node)
    joined(membership.store, t)  # (the agreements held for it from its machine's claim count it in now)
    if not taken_in(membership, topo.node):  # (too late: the trainers in the job read this place's rows)
        membership.store.add(ABSENT, 1)
        record_change(membership.store, "lost", t, pid=os.getpid(), signal="its machine came too late to join",
                      node=topo.node)
        print(f"trainer {t} did not join: the trainers in the job had read their own rows before they took its "
              "machine in (they read its place's rows)", file=sys.stderr, flush=True)
        wait_joined(membership, roles, topo.node)  # (its machine's segments stay until each trainer mapped them)
        link.finish(t)
        return
    [mine] = [j for j in joined_nodes(membership.store, topo.nnodes) if j.node == topo.node]
    machines, held = join_machines(membership.store, roles, upto=mine.seq)
    key = join_key(topo.node)
    group = machine_group(job, t, f"exchange/{key}", machines)
    owners = torch.tensor([machines.index(held[s]) for s in range(job.rowhash.servers)], dtype=torch.int64)
    hot_group = machine_group(job, t, f"hot/{key}", machines) if job.hot is not None and roles.is_first(t) else None
    job = dataclasses.replace(job, exchange=ExchangeGroups(group, machines=tuple(machines), owners=owners),
                              hot_group=hot_group)
    run = _make_trainer(job, t, console, restart, joined=True, machine_join=mine)
    trainer, recovery = run.trainer, run.trainer.recovery
    assert recovery is not None
    taken = f"hot-taken/{topo.node}"
    if run.hot_sync is not None:  # this machine's replica: the consensus, from a machine in the job
        run.hot_sync.take()
        run.hot_sync.start()
        membership.store.set(taken, "1")
    built = time.time()
    # (in the job from its join's record on: every agreement after it waits for it; its own rows may have been shared
    # out meanwhile, then it reads what the next agreements give it)
    sync = recovery.admit(trainer.sync, give_up=lambda: False)
    assert sync is not None
    trainer.sync = sync
    cut = recovery.cut_own() if recovery.reads_own else None
    if cut is not None:  # (the rest of its rows is shared out over every trainer at the first agreement)
        trainer.source = trainer_source(job.cfg, job.data, t, cut, streamed=True)
    while job.hot is not None and not membership.store.check([taken]):  # (no read of the replica before it is whole)
        time.sleep(0.02)
    admitted = time.time()
    result = trainer.train()
    membership.agree(END, t)
    result = {k: v for k, v in result.items() if k not in ("dense", "state")}
    # (its rows before this start were the lost process's: not resumed ones); published before the exchange and the
    # hot rows' sync close, which wait for the trainer that reads it
    membership.publish_result(t, restart, {**result, "resumed_from": 0, "restart": restart, "pid": os.getpid(),
                                           "started": started, "built": built, "admitted": admitted,
                                           "state_from": recovery.state_from, "reads_own": recovery.reads_own,
                                           "node": topo.node})
    if run.hot_sync is not None:
        run.hot_sync.close()
    run.tables.close()
    link.finish(t)


def _start_mirror(job: Job, server: int) -> ShardMirror | None:
    """Embedding server `server`'s mirroring of its shard with the other machine (--shard-mirror-interval)."""
    if job.mirror_group is None:
        return None
    E = job.roles.embedding_per_node
    peer = (1 - job.roles.topo.node) * E + server % E
    job.mirror_group.set_timeout(datetime.timedelta(seconds=cross_timeout(job.cfg.heartbeat_timeout)))
    mirror = ShardMirror(job.mirror_group, job.shards[server], job.mirrors[peer],
                         job.mirror_stamps[server % E:server % E + 1], interval=job.cluster.shard_mirror_interval)
    mirror.start()
    return mirror


def _close_mirror(job: Job, mirror: ShardMirror, gone: list[int]) -> None:
    """The job's end: the mirroring stops (with the other machine's server, unless it was lost with its machine)."""
    if any(s not in job.shards for s in gone):  # (its peer is gone: its thread failed, or gives up at the timeout)
        return
    mirror.close()
    if mirror.error is not None:
        raise RuntimeError(f"the mirroring of embedding shards with the other machine broke: {mirror.error}")


def _record_error(text: str) -> None:
    """Write why this rank failed to the elastic agent's error file, the root cause torchrun's failure report shows
    (else it shows an empty traceback for a rank that exited with status 1)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            Path(path).write_text(json.dumps({"message": text, "timestamp": int(time.time())}))
        except OSError:
            pass


@dataclasses.dataclass
class _TrainerRun:
    trainer: Trainer
    tables: ShardedEmbeddings
    center: RemoteCenter | None
    logger: MetricsLogger | None
    hot_sync: HotSync | None = None  # on a node's first trainer
    curve: _EvalCurve | None = None  # trainer 0's eval curve (--eval-every)
    machine: LossAcross | None = None  # where the job goes on after its first loss across machines


def _make_trainer(job: Job, t: int, console: Any, restart: int = 0, *, joined: bool = False,
                  machine_join: NodeJoin | None = None) -> _TrainerRun:
    """Trainer t's run (`restart` > 0: a lost trainer started again, which joins the job: job/recovery.py;
    `joined`: a lone lost trainer started again across machines, or (`machine_join`: its claim) a trainer of a machine
    that joined in a lost or awaited one's place, job/node_join.py)."""
    cfg, roles, data = job.cfg, job.roles, job.data
    E = roles.embedding_per_node * roles.topo.nnodes
    servers = [job.shards.get(s) or roles.rpc_name(roles.rank_of("embedding", s)) for s in range(E)]
    labels = [f"{roles.rpc_name(r)} (rank {r}, node {roles.node_of(r)}, host {job.hosts[r]})"
              for r in roles.ranks("embedding")]
    remote = trainer_transport(job, t, labels)
    hot, hot_sync = job.hot, None
    if hot is not None and job.hot_group is not None:
        firsts = roles.ranks("trainer")[0::roles.trainers_per_node]
        hot_sync = HotSync(hot, job.hot_group, interval=job.cluster.hot_sync_interval,
                           staleness=job.cluster.hot_staleness,
                           label=", ".join(f"{roles.rpc_name(r)} (host {job.hosts[r]})" for r in firsts))
    tables = ShardedEmbeddings(job.tables.table_rows, job.tables.width, servers, remote=remote, labels=labels,
                               group=job.cluster.lookup_batches, hot=hot, hot_sync=hot_sync,
                               start_window=cfg.workers * (job.cluster.prefetch + 1), awaiting=bool(roles.awaited))
    center = None
    if cfg.sync.method == "easgd":
        center = RemoteCenter(job.dense_params, [roles.rpc_name(r) for r in roles.ranks("sync")])
    state = TrainerState.new(cfg.trainers, cfg.workers, job.init_dense, positions=job.positions)
    across = job.membership is not None and roles.topo.nnodes > 1  # the job goes on without a lost machine
    if job.link is not None:  # (where another machine may read this trainer's rows after its loss: its positions)
        job.link.beat(t, state.stop, min(0.2, cfg.heartbeat_timeout / 10),
                      positions=job.positions[t] if across else None,
                      share_positions=job.share_positions[t] if across else None,
                      lost_key=(job.fence_key or f"lost-node/{roles.topo.node}") if across else None)
    elif cfg.timeout is not None:  # no launcher to ask (plain torchrun): the trainer keeps --timeout, from its start
        _stop_after(state.stop, cfg.timeout)
    source = trainer_source(cfg, data, t, job.plan, streamed=restart > 0)  # (a joining trainer trains at once)
    logger = None
    if t == 0 and not restart:  # (a restart's records go to the run's metrics through the trainer that finishes)
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        logger = MetricsLogger(out / "metrics.jsonl", append=job.cluster.resume is not None)
        if job.cluster.resume is None:  # a best model here belongs to an earlier run in this directory
            shutil.rmtree(out / "checkpoints" / BEST, ignore_errors=True)
        logger.log(event="start", name=_name(cfg, roles), config=config_to_dict(cfg), nodes=roles.topo.nnodes)
    emit = _progress(job, t, logger, console)
    stop_at = None
    if job.cluster.stop_after is not None:  # this trainer's share of the examples to stop at
        stop_at = max(0, job.cluster.stop_after - job.examples_before) // roles.trainers
    on_eval, every = None, None
    if t == 0 and not restart and job.cluster.eval_every is not None:  # trainer 0 scores its replica as it trains
        every = max(1, job.cluster.eval_every // roles.trainers)
        on_eval = _EvalCurve(job, tables, logger, console)
    recovery = Recovery(job, job.membership, t, restart) if job.membership is not None else None
    trainer = Trainer(cfg, t, state, source, group=job.dense_group, embeddings=tables, center=center,
                      prefetch=job.cluster.prefetch, emit=emit, stop_at=stop_at, on_eval=on_eval, eval_every=every,
                      recovery=recovery)
    machine = None
    if across and recovery is not None and (not joined or machine_join is not None):
        machine = LossAcross(job, t, tables, hot_sync, center=center, replica=trainer.flat.flat)
        tables.on_lost = machine
        admitted: tuple[NodeJoin, ...] = ()
        if machine_join is not None and job.membership is not None:  # (the joins up to its machine's: made)
            admitted = tuple(j for j in joined_nodes(job.membership.store, roles.topo.nnodes)
                             if j.seq <= machine_join.seq)
            machine.came_in(job.membership, [j.node for j in admitted])
        # a machine's loss, then maybe another's join in its place, before the sync re-forms
        recovery.before_regroup = MachineJoins(job, t, tables, hot_sync, machine, admitted).prepare
    return _TrainerRun(trainer, tables, center, logger, hot_sync, on_eval, machine)


class _EvalCurve:
    """Trainer 0's eval NE curve (dlrm's --test-freq): snapshots of its replica and of the tables scored on the
    held-out set, logged as `eval` records with the job's examples; the best kept as checkpoints/best."""

    def __init__(self, job: Job, tables: ShardedEmbeddings, logger: MetricsLogger, console: Any):
        self.job, self.tables, self.logger, self.console = job, tables, logger, console
        out = Path(job.cfg.out_dir) if job.cfg.checkpoint else None
        self.best = BestModel(job.cfg, job.data, job.model_cfg, eval_batches(job.cfg, job.data), out,
                              _meta(job, 0, True))

    def __call__(self, dense: torch.Tensor, read: int) -> None:
        seen = read * self.job.roles.trainers + self.job.examples_before  # the job's examples, from this trainer's
        rec = self.best.score(dense, self.tables.snapshot(), seen)
        self.logger.log(rec)
        self.console.print(describe(rec))


def _run_trainer(job: Job, run: _TrainerRun, t: int) -> tuple[dict | None, list[int] | None, list[int]]:
    """Train, gather the trainers' results on trainer 0 and (there) finish the job's summary; also returns the
    trainers left when some were lost (None: all of them) and (on the trainer that finishes the job) the embedding
    servers lost."""
    roles, membership = job.roles, job.membership
    resumed = int(run.trainer.state.positions[t].sum())
    if membership is not None:
        membership.record_start(t, resumed)
    # every trainer starts training at once: one that started early would be averaged with replicas still at their
    # starting point, pulling its progress back while the shared embeddings keep theirs (a jump in its NE)
    try:
        dist.barrier(group=job.trainer_group)
    except RuntimeError:
        if membership is not None and (losses := membership.losses(membership.wait_for_change(0, timeout=5.0) or 0)):
            raise TrainerFailure(f"{losses[0].describe()} before training started: the job goes on without a "
                                 "lost trainer once training runs; start it again") from None
        raise
    if roles.awaited:
        _start_without(job, run)
    if run.machine is not None:
        run.machine.bound_waits()
    result = run.trainer.train()
    if run.machine is not None:
        run.machine.training_over()
    result["resumed_from"] = resumed
    losses, group, alive, leader, joined = [], job.trainer_group, None, 0, []
    if membership is not None:  # the trainers left agree on the losses (a stopped job shared out none, maybe)
        epoch = membership.agree(END, t) or 0
        losses = membership.losses(epoch)
        if losses:  # the first trainer left of the job's start finishes it (trainer 0, unless it was lost)
            first = membership.first_live(epoch)
            if job.save_group is not None:  # (a trainer whose save failed with a lost machine released it already:
                job.save_group.release()  # torch names the group below by how many groups each member holds)
            group, alive, leader = membership.trainer_group(first), first, first[0]
            joined = [x for x in membership.live(epoch) if x not in first]  # (started again: results in the store)
    results: list[Any] = [None] * dist.get_world_size(group) if t == leader else []
    dist.gather_object(result, results if t == leader else None, dst=roles.rank_of("trainer", leader), group=group)
    if t != leader:
        return None, alive, []
    results += [membership.restarted_result(x) for x in joined]
    if run.logger is None:  # (trainer 0, which started the run's metrics, was lost)
        run.logger = MetricsLogger(Path(job.cfg.out_dir) / "metrics.jsonl", append=True)
    servers = membership.lost_servers() if membership is not None else []
    return _finish(job, run, results, losses, servers), alive, [x.server for x in servers]


def _start_without(job: Job, run: _TrainerRun) -> None:
    """The machines of the job's layout not there at its start (--nnodes MIN:MAX), recorded as lost before training
    (build.py), are handled as lost ones: their shards restored on the machines here from their initial rows (or the
    checkpoint resumed), the lookup exchange made among these, the dense sync formed among the trainers here by the
    path that takes a machine in later (Recovery.regroup); then the hot rows' replica is filled from the shards
    (restored ones included) and every trainer here starts at once."""
    recovery = run.trainer.recovery
    assert recovery is not None and run.machine is not None  # (such a job survives a machine's loss)
    sync = recovery.regroup(run.trainer.sync)
    if sync is None:
        raise RuntimeError(f"the machines awaited ({', '.join(map(str, job.roles.awaited))}) were not recorded in the "
                           "job's store before training")
    run.trainer.sync = sync
    if run.hot_sync is not None:
        run.hot_sync.fill({**job.shards, **run.machine.adopted}, job.rowhash.servers)
        run.hot_sync.start()
    dist.barrier(group=job.trainer_group)  # (no row read before the replica is filled)


def _servers_leave(job: Job) -> bool:
    """Whether this job's embedding servers may be lost and leave its checkpoints and its end to the trainers (one
    machine: `Survival.servers_leave_at_end`)."""
    return job.membership is not None and job.survival.servers_leave_at_end


def _server_loss(x: ServerLoss) -> dict:
    return {"server": x.server, "pid": x.pid, "signal": x.signal, "time": x.time}


def _membership_over_time(job: Job, start: float) -> list[dict]:
    """The trainers in the job over time: at the start (without the machines awaited then, --nnodes MIN:MAX), then
    after each loss and each join."""
    T = job.roles.trainers
    if job.membership is None:
        return [{"time": start, "trainers": T}]
    awaited = sorted(n.node for n in job.membership.lost_nodes() if n.awaited)
    before = [x for x in job.membership.changes() if isinstance(x, Loss) and x.node in awaited and x.pid == 0 and
              x.time <= start]  # (recorded as lost before training: never in the job)
    n = T - len(before)
    out = [{"time": start, "trainers": n, **({"awaited": awaited} if awaited else {})}]
    for x in job.membership.changes():
        if x in before:
            continue
        if isinstance(x, Join):
            n += 1
            out.append({"time": x.time, "trainers": n, "joined": x.trainer, "restart": x.restart})
        else:
            n -= 1
            out.append({"time": x.time, "trainers": n, "lost": x.trainer,
                        **({"node": x.node} if x.node is not None else {})})
    return out


def _meta(job: Job, seen: int, stopped: bool) -> dict:
    roles = job.roles
    return {"config": config_to_dict(job.cfg), "trainers": roles.trainers, "workers": job.cfg.workers,
            "embedding_servers": job.rowhash.servers, "sync_servers": roles.sync_per_node * roles.topo.nnodes,
            "nodes": roles.topo.nnodes, "dense_params": job.dense_params, "table_rows": list(job.tables.table_rows),
            "examples_seen": seen, "stopped": stopped,
            **({"data_plan": job.plan.as_json()} if job.plan is not None else {})}


def _lost_parts(job: Job, summary: dict, mine: Snapshot, meta: dict) -> dict[str, Stateful]:
    """Trainer 0's stand-ins for the lost trainers' parts of the last checkpoint: where every row was read (their
    unread rows too), each a copy of trainer 0's state with its reader positions at the end of its shards, so the
    checkpoint resumes (more --epochs) as any other; otherwise none, and the checkpoint says it cannot be resumed."""
    if summary["stopped"] or summary["short_by"]:
        meta["lost_trainers"] = [x["trainer"] for x in summary["lost"]]
        return {}
    out: dict[str, Stateful] = {}
    for x in summary["lost"]:
        state = dict(mine.state_dict())
        state["positions"] = torch.tensor(job.shard_rows(x["trainer"]), dtype=torch.int64)
        out[part_name("trainer", x["trainer"])] = Snapshot(state)
    return out


@dataclasses.dataclass(frozen=True)
class _Command:
    name: str  # 'checkpoint', 'skip' (a periodic checkpoint not taken: a trainer was lost) or 'end'
    alive: list[int] | None  # the trainers left after a loss (None: every trainer)
    lost_servers: list[int]  # the embedding servers lost


def _command(job: Job, cmd: str | None, alive: list[int] | None = None, leader: int = 0,
             lost_servers: list[int] = (), skip_if: Callable[[], bool] | None = None) -> _Command:
    """Trainer `leader` (0, or the first left after a loss) tells every rank what comes next ('checkpoint' or 'end',
    with `alive` and `lost_servers`); the others receive it. A trainer passes what it expects and fails if the leader
    said otherwise (their checkpoint marks would disagree). Through the launcher's store where there is one (a lost
    rank breaks no collective there), else a broadcast. `skip_if` (a periodic checkpoint, with the store): the command
    is 'skip' if it is true for the leader, or for a trainer still waiting for the leader (which may be lost)."""
    roles = job.roles
    src = roles.rank_of("trainer", leader)
    mine = {"name": cmd, "alive": alive, "lost_servers": list(lost_servers)} if roles.topo.rank == src else None
    if job.link is not None:
        skip = {"name": "skip", "alive": None, "lost_servers": []}
        if mine is not None and skip_if is not None and skip_if():
            mine = skip
        got = job.link.command(mine, fallback=skip if skip_if is not None else None, give_up=skip_if)
    else:
        obj = [mine]
        dist.broadcast_object_list(obj, src=src)
        got = obj[0]
    if cmd is not None and got["name"] not in (cmd, "skip" if skip_if is not None else cmd):
        raise RuntimeError(f"{roles.rpc_name()} expected {cmd!r} from trainer {leader}, got {got['name']!r}")
    return _Command(got["name"], got["alive"], got["lost_servers"])


def _periodic_checkpoints(job: Job, run: _TrainerRun, t: int) -> None:
    """Pause this trainer's workers at its share of every `checkpoint_every` examples and save with every rank."""
    cfg, roles, every = job.cfg, job.roles, job.cluster.checkpoint_every
    if not cfg.checkpoint or every is None:
        return
    trainer = run.trainer
    T, W = roles.trainers, cfg.workers
    per_trainer = max(1, every // T)
    leaving = _servers_leave(job)
    last = min(job.trainer_rows(i) for i in range(T)) - 1  # below every trainer's share: the end saves its own
    stopped: list[int] = []  # the first mark this trainer skipped

    def skipped(mark: int, why: str) -> None:
        """The periodic checkpoints stop at `mark` (this trainer's examples), for `why`: recorded for the launchers'
        monitors and the summary (the first trainer's record is the job's), and logged by a trainer that logs
        metrics."""
        membership = job.membership
        if stopped or membership is None:
            return
        stopped.append(mark)
        at = mark // per_trainer * every + job.examples_before
        record_checkpoints_stopped(membership.store, at, why)
        if run.logger is not None:
            run.logger.log(event="checkpoints-stopped", examples=at, reason=why)

    def save(mark: int) -> None:
        written: list[Path] = []  # the checkpoint's directory, once it is named
        try:
            save_at(mark, written)
        except Exception as e:
            if run.machine is None or job.save_group is None:
                raise
            _leave_save(job, e)
            if not run.machine.prepare():
                raise
            # a machine was lost during the save: this checkpoint is given up (`latest` still names the last one),
            # and the later ones are skipped (a loss was recorded)
            for path in written:
                shutil.rmtree(path, ignore_errors=True)

    def save_at(mark: int, written: list[Path]) -> None:
        membership = job.membership
        run.tables.flush()  # every row gradient of the batches before the mark is on its server
        # Every trainer's part is needed: after a change of the trainers (a loss, a restart's join) the command is
        # 'skip', for every rank alike (a trainer that saw no loss would otherwise wait for a command the others
        # never send). A trainer takes its state first (its sync paused in a round every trainer paused at: across
        # machines that round comes only once a lost machine is recorded, so no command is given while one is
        # silent), but gives the pause up once a change is recorded (a restart, in none of the job's groups, never
        # pauses). Where the embedding servers may be lost on one machine (`_servers_leave`), or after one was,
        # the trainers save without them: trainer 0 saves every shard from the machine's shared memory (a job with
        # EASGD's sync servers stops checkpointing after a server's loss: their centre is theirs alone).
        gone = membership.lost_servers() if membership is not None and t == 0 else []
        lost = (lambda: membership.epoch() > 0 or bool(trainer.state.stop[0])) if membership is not None else None
        state = trainer.checkpoint_state(give_up=lost) if lost is not None else trainer.checkpoint_state()
        command = _command(job, "checkpoint", lost_servers=[x.server for x in gone], skip_if=lost)
        centre_alone = bool(command.lost_servers) and roles.sync_per_node > 0
        if command.name == "skip" and not trainer.state.stop[0] and membership is not None and membership.epoch():
            skipped(mark, "the job's trainers changed since it started (a trainer or machine lost, awaited or joined), "
                    "and a periodic checkpoint takes every trainer's part")
        elif centre_alone:
            skipped(mark, "an embedding server was lost, and EASGD's centre lives on the sync servers alone")
        if command.name == "skip" or centre_alone:
            return
        if state is None:  # (a change after the leader's command: this checkpoint is saved as far as it can be)
            state = trainer.checkpoint_state()
        parts: dict[str, Stateful] = {part_name("trainer", t): Snapshot(state)}
        group = _save_group(job)
        if command.lost_servers or leaving:
            group = job.trainer_group
            if t == 0:
                parts.update({part_name("embedding", s): shard for s, shard in job.shards.items()})
        else:
            _settle_hot(job, run)
            dist.barrier(group=group)  # every node's hot rows are back in their shards before a server saves its shard
        seen = torch.tensor([int(state["positions"].sum())])
        dist.all_reduce(seen, group=job.trainer_group)
        seen += job.examples_before
        written.append(Path(cfg.out_dir) / "checkpoints" / f"seen-{int(seen)}")
        meta = _meta(job, int(seen), True) if t == 0 else None
        path = save_job(parts, Path(cfg.out_dir), meta, owner=f"trainer{t}", writer=roles.rank_of("trainer", 0),
                        group=group)
        if t == 0 and membership is not None:  # what a machine's lost shards are restored from
            membership.store.set(LAST_CHECKPOINT, json.dumps({"path": str(path), "examples": int(seen),
                                                               "time": time.time()}))
        if run.logger is not None:
            run.logger.log(event="checkpoint", examples=int(seen), path=str(path))

    trainer.checkpoints = CheckpointMarks(per_trainer, int(trainer.state.positions[t].sum()), last, W, save)


def _checkpoints_stopped_at(job: Job) -> int | None:
    """The examples of the job's first periodic checkpoint mark not saved, else None."""
    stopped = checkpoints_stopped(job.membership.store) if job.membership is not None else None
    return stopped.examples if stopped is not None else None


def _save_served(job: Job, parts: dict[str, Stateful], owner: str) -> None:
    """An embedding or sync server's part of a periodic checkpoint (collective with every rank)."""
    group = _save_group(job)
    dist.barrier(group=group)  # the hot rows are back in their shards (_settle_hot)
    save_job(parts, Path(job.cfg.out_dir), None, owner=owner, writer=job.roles.rank_of("trainer", 0), group=group)


def _save_group(job: Job) -> dist.ProcessGroup | None:
    """The group of a periodic checkpoint's collectives: the job's save group across machines, else the default."""
    return job.save_group.group if job.save_group is not None else None


def _leave_save(job: Job, error: BaseException) -> None:
    """A save failed with `error` (maybe a machine lost during it): release the save group, so that the ranks of this
    machine still waiting for this one in the save fail too instead of waiting for ever (a lost machine resets its
    own connections, not those between the ranks left). The error's frames hold the group: their locals go first."""
    seen: set[int] = set()
    errors: list[BaseException | None] = [error]
    while errors:  # the error, what it was raised from, and what a checkpoint error gathered (DCP's, per rank)
        e = errors.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        failures = getattr(e, "failures", None)  # (DCP's: rank -> (error, its stack summary))
        gathered = [f[0] if isinstance(f, tuple) and f else f for f in
                    (failures.values() if isinstance(failures, dict) else ())]
        errors += [e.__cause__, e.__context__, *(f for f in gathered if isinstance(f, BaseException))]
    assert job.save_group is not None
    job.save_group.release()


def _settle_hot(job: Job, run: _TrainerRun, *, close: bool = False) -> None:
    """Every trainer paused (after a `_command`): the node's first trainer makes its replica of the hot rows the
    consensus of the nodes and writes it into the owners' shards, which the checkpoint saves."""
    hot_sync = run.machine.hot_sync if run.machine is not None else run.hot_sync  # (taken over after a loss)
    if hot_sync is not None:
        hot_sync.settle(close=close)  # (nothing to settle once the other machine is lost)
        adopted = run.machine.adopted if run.machine is not None else {}
        job.hot.write_back({**job.shards, **adopted}, job.rowhash.servers)


def _lost_nodes(job: Job, run: _TrainerRun) -> list[dict]:
    """The machines lost, each with its shards as restored (where from, the rows' age)."""
    if job.membership is None or job.roles.topo.nnodes == 1:
        return []
    P, out = job.roles.sync_per_node, []
    shards = restored_shards(job.membership.store, job.rowhash.servers)
    adopted = restored_ranges(job.membership.store, P * job.roles.topo.nnodes)
    for n in job.membership.lost_nodes():
        restored = [r for r in shards if r.lost_with == n.node]
        ranges = [r for r in adopted if r.lost_with == n.node]
        out.append({**dataclasses.asdict(n), "restored": [
            {k: v for k, v in dataclasses.asdict(r).items() if k != "name"} for r in restored],
            **({"centre": [dataclasses.asdict(r) for r in ranges]} if P else {})})
    return out


def _name(cfg: TrainConfig, roles: Roles) -> str:
    return f"{cfg.sync.algorithm} T={roles.trainers} nodes={roles.topo.nnodes}"


def _progress(job: Job, t: int, logger: MetricsLogger | None, console: Any):
    """Trainer t's progress records: to the launcher's monitor (when there is one), and on trainer 0 to
    metrics.jsonl (the job's examples: every trainer's from the monitor's store, else this trainer's times T) and,
    without a launcher (plain torchrun), a line every 5 s on its output."""
    last = [0.0]
    roles, link = job.roles, job.link

    def emit(rec: dict) -> None:
        rec = json_safe({k: v for k, v in rec.items() if k != "kind"})
        if link is not None:
            link.set(f"progress/{t}", rec)
        if logger is None:
            return
        examples = rec["trainer_examples"] * roles.trainers
        if link is not None:
            found = link.get_all([f"progress/{i}" for i in range(roles.trainers)])
            examples = sum(r["trainer_examples"] for r in found)
        logger.log({"event": "train", "examples": examples + job.resumed_from, **rec})
        if link is None and time.time() - last[0] >= 5.0:  # (a launcher prints the whole job's progress)
            last[0] = time.time()
            console.print(f"trainer 0 of {roles.trainers}: {rec['trainer_examples']:,} examples, "
                          f"{rec['trainer_eps'] or 0:,.0f} examples/s, train NE "
                          + ("-" if rec["train_ne"] is None else f"{rec['train_ne']:.4f}"))
    return emit


def _stop_requested(job: Job, trainer: Trainer) -> bool:
    """Whether this run was asked to stop before the budget's end: --stop-after below it, or the stop flag."""
    stop_after = job.cluster.stop_after
    return bool(trainer.state.stop[0]) or (stop_after is not None and stop_after < job.cfg.total_examples)


def _stop_after(stop: torch.Tensor, seconds: float) -> None:
    """Raise the workers' stop flag after `seconds` (what a launcher's --timeout does through the store)."""
    timer = threading.Timer(seconds, stop.fill_, args=(1,))
    timer.daemon = True
    timer.start()


def _finish(job: Job, run: _TrainerRun, results: list[dict], losses: list[Loss], servers: list[ServerLoss]) -> dict:
    """Trainer 0 scores the final model (EASGD's centre, else its replica; on a snapshot of the tables), keeps it as
    the best model when it beats the eval curve, and logs the summary (with the trainers lost: what each had read
    before it was lost counts as trained, its Hogwild updates are in the tables)."""
    cfg, roles, trainer, logger = job.cfg, job.roles, run.trainer, run.logger
    lost = []
    membership = job.membership
    joins = membership.joins() if membership is not None else []
    for x in losses:
        restart = sum(1 for j in joins if j.trainer == x.trainer and j.seq < x.seq)  # (the process that was lost)
        start = membership.start(x.trainer, restart) if membership is not None else 0
        if any(j.trainer == x.trainer and j.seq > x.seq for j in joins):  # started again: it went on from there
            read = membership.start(x.trainer, restart + 1)
        elif trainer.recovery is not None:  # (a trainer lost while reading another lost trainer's rows)
            read = sum(trainer.recovery.positions(x.trainer)) + trainer.recovery.share_rows_read(x.trainer)
        else:
            read = int(job.positions[x.trainer].sum())
        lost.append({"trainer": x.trainer, "pid": x.pid, "signal": x.signal, "time": x.time,
                     "examples": read - start, "resumed_from": 0 if restart else start, "node": x.node,
                     "restart": restart})  # (a restart's start is where the process lost before it stopped)
        if x.node is None and roles.topo.nnodes > 1 and membership is not None:  # (a lone trainer: its machine went on)
            lost[-1]["served_by"] = membership.substitute(x.trainer)
    restarts = [{"trainer": r["trainer"], "restart": r["restart"], "pid": r["pid"], "started": r["started"],
                 "joined": r["admitted"], "trains_after_s": r["start"] - r["started"],
                 "built_in_s": r["built"] - r["started"], "joined_in_s": r["admitted"] - r["built"],
                 "state_from": r["state_from"],
                 "read_own_rows": r["reads_own"], "examples": r["examples"],
                 **({"node": r["node"]} if r.get("node") is not None else {})} for r in results if r.get("restart")]
    nodes = _lost_nodes(job, run)
    flat = run.center.values() if run.center is not None else trainer.flat.flat.clone()
    table = run.tables.snapshot()
    curve = run.curve.best if run.curve is not None else None
    scorer = curve or BestModel(cfg, job.data, job.model_cfg, [], None, {})
    ev = evaluate(scorer.load(flat, table), eval_batches(cfg, job.data))
    examples = sum(r["examples"] for r in results) + sum(x["examples"] for x in lost)
    seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    gaps = [r["sync_gap"] for r in results if math.isfinite(r["sync_gap"])]
    lk = [r["lookups"] for r in results]
    step_s = sum(r["seconds"] * cfg.workers for r in results)
    N, D = roles.topo.nnodes, trainer.flat.flat.numel()
    if cfg.sync.method in ("ma", "bmuf"):  # a ring all-reduce across the nodes of each trainer's slice of D + 1
        per_sync = 2 * (N - 1) / N * (D + 1) * 4 / roles.trainers_per_node
    elif cfg.sync.method == "easgd":  # the snapshot out, the elastic difference back; (N-1)/N of it off-node
        per_sync = 2 * D * 4 * (N - 1) / N
    else:
        per_sync = 0.0
    resumed = sum(r["resumed_from"] for r in results) + sum(x["resumed_from"] for x in lost) + job.examples_before
    seen = examples + resumed
    summary = {
        "name": _name(cfg, roles), "sync": cfg.sync.algorithm, "nodes": roles.topo.nnodes, "T": roles.trainers,
        # stopped: before the budget's end by a request (--stop-after, Ctrl-C, SIGTERM, --timeout); short_by: a run
        # that read its shards to their end and fell short of the budget (a byte range holding fewer lines)
        "resumed_from": resumed, "stopped": seen < cfg.total_examples and _stop_requested(job, trainer),
        "short_by": 0 if _stop_requested(job, trainer) else max(0, cfg.total_examples - seen),
        "W": cfg.workers, "embedding_servers": roles.embedding_per_node * roles.topo.nnodes,
        "sync_servers": roles.sync_per_node * roles.topo.nnodes, "prefetch": job.cluster.prefetch,
        "lookup_batches": job.cluster.lookup_batches,
        "examples": examples, "eps": examples / max(seconds, 1e-9),
        "eps_per_trainer": examples / max(seconds, 1e-9) / roles.trainers,  # the job's rate shared: x T = eps
        "eps_per_cpu": examples / max(sum(r["cpu_seconds"] for r in results), 1e-9),
        "trainer_cpu_seconds": sum(r["cpu_seconds"] for r in results),
        "train_ne": finite_mean([r["train_ne"] for r in results]),
        "eval_ne": ev["ne"], "auc": ev["auc"], "calibration": ev["calibration"], "bayes_ne": ev["bayes_ne"],
        "eval_examples_scored": ev["examples"],
        "excess_ne": ev["ne"] - ev["bayes_ne"] if math.isfinite(ev["bayes_ne"]) else float("nan"),
        "sync_gap": float(np.mean(gaps)) if gaps else float("nan"),
        "syncs": int(sum(r["syncs"] for r in results)), "seconds": seconds,
        "start_skew_s": max(r["start"] for r in results) - min(r["start"] for r in results),
        "sync_impl": results[0]["sync_impl"],  # CompiledSync (the DSL program), or the class that ran
        **lookup_summary(lk, examples, step_s, transport=job.cluster.lookup_transport if N > 1 else "local",
                         exchange=job.cluster.lookup_transport in EXCHANGES and N > 1,
                         hot_rows=len(job.hot) if job.hot is not None else 0),
        "dense_bytes_per_example": per_sync * sum(r["syncs"] for r in results) / max(examples, 1),
        "dense_params": D,
        "interrupted": bool(trainer.state.stop[0]),  # the launcher asked the trainers to stop (Ctrl-C, --timeout)
        # the trainers lost, each with what it had read (trained) before; the trainers left at the end
        "lost": lost, "trainers_left": len(results), "restarts": restarts,
        "lost_servers": [_server_loss(x) for x in servers],
        "lost_nodes": nodes,
        "joined_nodes": [dataclasses.asdict(j) for j in joined_nodes(job.membership.store, job.roles.topo.nnodes)]
        if job.membership is not None and job.roles.topo.nnodes > 1 else [],
        "membership": _membership_over_time(job, min(r["start"] for r in results)),
        "takeover_rows": sum(r.get("takeover_rows", 0) for r in results),
        # when every trainer left had re-formed its sync after the first loss (None: no sync was re-formed)
        "regrouped_at": max((r["regrouped_at"] for r in results if r.get("regrouped_at")), default=None),
        # the examples at the first periodic checkpoint mark not saved: none after it either (None: none skipped)
        "checkpoints_stopped_at": _checkpoints_stopped_at(job),
    }
    if curve is not None and cfg.checkpoint:  # the end beats the curve: the last model is the best
        curve.keep({"event": "eval", "examples": seen, "eval_ne": ev["ne"], "auc": ev["auc"],
                    "calibration": ev["calibration"]}, flat, table)
    if curve is not None and math.isfinite(curve.best):
        summary["best_eval_ne"] = curve.best
    logger.log(event="eval", examples=seen, eval_ne=ev["ne"], auc=ev["auc"], bayes_ne=ev["bayes_ne"])
    logger.log(event="summary", **json_safe(summary))
    logger.close()
    if cfg.plot:
        out = Path(cfg.out_dir)
        run = {"name": summary["name"], "records": read_metrics(out / "metrics.jsonl"),
               "bayes_ne": ev["bayes_ne"] if math.isfinite(ev["bayes_ne"]) else None}
        summary["plot"] = plot_ne([run], out / "ne.png", title=f"{summary['name']}: NE vs examples")
    return summary  # written by add_job_cpu once the servers' CPU time is known
