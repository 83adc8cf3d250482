"""`cocosync train --nnodes N`: this machine's ranks of a job across machines.

torchrun itself runs here: its own argument parser and launch configuration (c10d rendezvous at --rdzv-endpoint,
node 0 hosting the store), and torch's elastic agent, in this process. What differs from exec'ing torchrun is the
entrypoint the agent is handed: a function (rank_start.run_node_rank) instead of `python -m cocosync.shadowsync`, so
the ranks fork warm from the fork server (runtime/warm_start.py; no import of torch per rank) and stay in this
process's session, where torchrun would exec each in a session of its own (rank_start.py says why that matters).
The options (and a checkpoint to resume) are checked here, once, before the rendezvous: a bad one is one line naming
it, not a failure per rank.
Once the machines have met, this process watches the job as the one-machine launcher does (monitor.py, through the
rendezvous store): the whole job's progress, --timeout, this machine's trainers' heartbeats; Ctrl-C or SIGTERM on any
machine stops every trainer of the job with a checkpoint, where torchrun's agent would stop its ranks with SIGTERM and
fail the job, and every machine's command exits with the same status. `COCOSYNC_WARM_START=0` execs torchrun instead
(each rank cold, a session each: the plain torchrun job, unwatched).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from rich.console import Console
from rich.markup import escape
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import launch_agent
from torch.distributed.run import config_from_args, get_args_parser
from torch.multiprocessing import ProcessExitedException

from cocosync.runtime import warm_start
from cocosync.runtime.comm.shm import remove_named
from cocosync.shadowsync.config import ClusterConfig, ConfigError, NodeRange, TrainConfig
from cocosync.shadowsync.data.sources import with_range_lines
from cocosync.shadowsync.job.launch import check_resume, crowded_shadow_advice
from cocosync.shadowsync.job.link import MONITOR_HOST_ENV, MONITOR_PORT_ENV, PREFIX, SECRET_ENV
from cocosync.shadowsync.job.loss_across import remove_restored
from cocosync.shadowsync.job.membership import record_node_loss
from cocosync.shadowsync.job.monitor import FENCED, Monitor, exit_status
from cocosync.shadowsync.job.node_join import claim_node, fence_key, joined
from cocosync.shadowsync.job.rank_start import job_dict, mark_agent_keys, run_joined_rank, run_node_rank
from cocosync.shadowsync.job.same_job import JOB_NODES_ENV, PER_MACHINE, differences, job_options
from cocosync.shadowsync.job.segments import SEGMENTS_ID
from cocosync.shadowsync.job.survival import Survival

__all__ = ["torchrun_args", "run_node"]

_MODULE = "cocosync.shadowsync"
WAITING_EVERY = 30.0  # seconds between two lines while the rendezvous waits for the other machines
#: seconds the agent gets to report this machine's ranks once they have exited after another machine's loss (on the
#: machine that hosts the job's store; a third of it on the others)
EXIT_GRACE = 3.0
#: seconds the rendezvous of a range of machines (--nnodes MIN:MAX) waits for more once MIN have met
LAST_CALL = 3.0
#: the store key where node 0's launcher leaves the options the job was started with (`same_job.job_options`)
LAUNCH_OPTIONS = "launch-options"


class _RankKeys(DefaultLogsSpecs):
    """torchrun's logs (the ranks' output on this process's terminal) that also tell each forked rank which keys of
    its environment the agent set (rank_start.become_rank keeps those over its launcher's environment), and record
    the job's ranks on this machine (`ranks`: None until the rendezvous has numbered them)."""

    ranks: list[int] | None = None
    world_size = 0  # the ranks of the machines that met

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = super().reify(envs)
        for env in envs.values():
            mark_agent_keys(env)
            self.world_size = int(env["WORLD_SIZE"])
        self.ranks = sorted(int(env["RANK"]) for env in envs.values())
        return dest


def _agent_log_worth_showing(record: logging.LogRecord) -> bool:
    """Drop torch's warning that its agent, in a thread, registers no signal handlers (this process takes them),
    and the agent's traceback of its own join of a rank that exited with a status (`ProcessExitedException`: the
    failed rank printed why, and torchrun's failure table names it). A rank that raised keeps its traceback."""
    if record.getMessage().startswith("Failed to register signal handlers since torchelastic"):
        return False
    return not (record.exc_info and isinstance(record.exc_info[1], ProcessExitedException))


def torchrun_args(nnodes: int | str | NodeRange, node_rank: int, nproc_per_node: int, rdzv_endpoint: str,
                  local_addr: str | None, run_id: str) -> list[str]:
    """torchrun's arguments for this machine (before the module and its arguments). c10d numbers the nodes itself;
    `node_rank` says which machine hosts the rendezvous store (`is_host`). `local_addr`: the address the other
    machines reach this one's ranks at; default 127.0.0.1 on a loopback rendezvous, else what torchrun resolves
    (the hostname). A range of machines (MIN:MAX) closes the rendezvous LAST_CALL seconds after MIN have met (torch's
    default: 30 s): a machine that comes later joins the running job instead."""
    host = rdzv_endpoint.rsplit(":", 1)[0]
    loopback = host in ("127.0.0.1", "localhost")
    # only node 0 hosts the store. On a loopback endpoint torch lets any machine whose name matches host it (every
    # one does): a node > 0 started with a wrong port hosted a store on every interface and waited there. (Node 0's
    # is left to torch there: an explicit is_host=1 on loopback kept a job with --timeout from starting to train.)
    conf = ["is_host=0"] if node_rank > 0 else [] if loopback else ["is_host=1"]
    machines = nnodes if isinstance(nnodes, NodeRange) else NodeRange.parse(str(nnodes))
    if machines.elastic:
        conf.append(f"last_call_timeout={LAST_CALL:g}")
    addr = local_addr or ("127.0.0.1" if loopback else None)
    return ["--nnodes", str(machines), "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", run_id, "--max-restarts", "0",
            *(["--rdzv-conf", ",".join(conf)] if conf else []),
            *(["--local-addr", addr] if addr else [])]


def run_node(launch: list[str], cfg: TrainConfig, cluster: ClusterConfig, json_out: bool, *, node_rank: int = 0,
             warm: bool = True, progress: bool = True) -> int:
    """Run this machine's ranks of the job `cfg`, `cluster` (checked before any process starts): `launch` is
    torchrun's arguments (`torchrun_args`). Returns the exit status: 0; 1 with torchrun's account of the failed ranks
    (or the monitor's: a trainer of this machine stopped responding) on stderr; 130 / 143 / 124 after Ctrl-C /
    SIGTERM / --timeout on any machine stopped the job with a checkpoint. With `warm` False this process becomes
    torchrun running `python -m cocosync.shadowsync --job FILE` (FILE: <out>/job-node<node_rank>.json) and does not
    return. `progress`: a line on the whole
    job every 5 s.

    The agent runs in a thread (a thread cannot take signals), so that Ctrl-C and SIGTERM reach this one: the first
    asks every trainer of every machine to stop with a checkpoint, through the job's rendezvous store (link.py), as
    the one-machine launcher does through its own; the second aborts (the ranks die with their launcher)."""
    args = get_args_parser().parse_args([*launch, "-m", _MODULE])
    machines = NodeRange.parse(args.nnodes)
    nnodes = machines.high  # (the job's layout: machines not there at its start join it later)
    trainers = _trainers_per_node(cfg, cluster, nnodes, int(args.nproc_per_node)) * nnodes
    if machines.elastic:
        _check_range(machines, cfg, cluster, trainers // nnodes)
    if cluster.shard_mirror_interval > 0 and nnodes > 2:
        shown = f"{cluster.shard_mirror_interval * 1e3:g}"
        raise ConfigError(f"--shard-mirror-interval {shown}: each machine mirrors its shards on the other of two "
                          f"machines (this job has --nnodes {nnodes}); leave it at 0")
    if cfg.max_restarts and nnodes > 1:
        per_node = trainers // nnodes
        if not Survival.of(cfg, cluster, nnodes, per_node, True).restarts:
            raise ConfigError(f"--max-restarts {cfg.max_restarts}: a lost trainer of a job across machines is started "
                              "again where the job goes on without it, with the lookup exchange and MA or BMUF (this "
                              f"job: --lookup-transport {cluster.lookup_transport}, --sync {cfg.sync.algorithm}, "
                              f"--min-trainers {cfg.min_trainers}, {per_node} trainers a machine); leave it at 0")
    if cluster.resume is None:  # (each machine counts its own copy, whose contents the ranks compare)
        cfg = dataclasses.replace(with_range_lines(dataclasses.replace(cfg, trainers=trainers)), trainers=cfg.trainers)
    job = job_dict(cfg, cluster)
    cfg = dataclasses.replace(cfg, trainers=trainers, progress=progress)
    if cluster.resume is not None:  # (on this machine's file system, where its ranks will read it)
        check_resume(cfg, cluster, work_left=False)
    advice = crowded_shadow_advice(cfg, cfg.trainers // nnodes)
    if advice is not None:
        Console(stderr=True).print(f"[yellow]{escape(advice)}", soft_wrap=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if not warm:  # the plain torchrun job: its ranks read the job from a file of this machine's
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        job_file = out / f"job-node{node_rank}.json"
        job_file.write_text(json.dumps(job, indent=2) + "\n")
        rank_args = ["--job", str(job_file), *(["--json"] if json_out else [])]
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *launch, "-m", _MODULE, *rank_args])
    if node_rank > 0:  # a running job that lost a machine: this one joins in its place (job/node_join.py)
        host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
        node = _node_to_join(host, port, nnodes, int(args.nproc_per_node), node_rank, trainers // nnodes, cfg,
                             cluster)
        if node is not None:
            return _run_joined(job, cfg, cluster, nnodes, int(args.nproc_per_node), node, host, port)
    warm_start.start()  # (imports while the rendezvous waits for the other machines)
    # the agent's error files, in a directory of ours removed at the end: torch's default is a /tmp/torchelastic_*
    # per logs spec, left behind by every run
    args.log_dir = tempfile.mkdtemp(prefix="cocosync-agent-")
    # one OpenMP thread per rank unless the user set it (each rank sets its own torch threads: --threads); torchrun
    # would set it too, with a four-line warning on every machine
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    logs = config.logs_specs = _RankKeys(log_dir=args.log_dir)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_agent_log_worth_showing)
    host, port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=29400)
    os.environ.update({MONITOR_HOST_ENV: host, MONITOR_PORT_ENV: str(port)})  # the ranks' link: the rendezvous store
    os.environ.pop(SECRET_ENV, None)  # (no per-run secret across machines: they would have to share it)
    os.environ[JOB_NODES_ENV] = str(nnodes)  # (the ranks' layout, whatever number of machines met)
    outcome: dict[str, BaseException] = {}

    def agent(launcher_env: dict[str, str]) -> None:
        try:
            with warm_start.main_not_rerun():
                launch_agent(config, run_node_rank, [job, json_out, launcher_env, os.getpid()])
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    signals: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _: signals.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=agent, args=(dict(os.environ),), name="cocosync-elastic-agent", daemon=True)
    console = Console(stderr=True)
    monitor = None
    try:
        thread.start()
        t0 = last = time.monotonic()
        if config.max_nodes > 1:
            count = f"{machines.low} to {machines.high}" if machines.elastic else str(machines.high)
            console.print(f"waiting for the {count} machines of the job at {config.rdzv_endpoint} (c10d "
                          f"rendezvous, up to {config.rdzv_configs.get('timeout', 900):g} s) ...", soft_wrap=True)
        while thread.is_alive() and logs.ranks is None:  # the rendezvous: nothing trains yet, a signal aborts
            thread.join(0.2)
            if time.monotonic() - last >= WAITING_EVERY:
                last = time.monotonic()
                console.print(f"still waiting for the rendezvous at {config.rdzv_endpoint} ({last - t0:.0f} s)",
                              soft_wrap=True)
            if signals:
                name = signal.Signals(signals[0]).name
                print(f"{'Ctrl-C' if name == 'SIGINT' else name} before the machines met: aborting", file=sys.stderr,
                      flush=True)
                _abort(128 + signals[0], args.log_dir)
        if thread.is_alive():
            monitor = _monitor(cfg, cluster, nnodes, config.nproc_per_node, logs.ranks or [], host, port, console,
                               hosts_store=node_rank == 0)
            if node_rank == 0:  # what a machine that joins later must have been started with
                for n in range(logs.world_size // config.nproc_per_node, nnodes):  # (the ranks record them too)
                    record_node_loss(monitor.store, monitor.roles, n, 0.0, awaited=True)
                monitor.store.set(LAUNCH_OPTIONS, _options_json(cfg, cluster, config.nproc_per_node))
            monitor.run(thread)  # (takes SIGINT and SIGTERM while it runs)
            if monitor.failure is not None:
                console.print(f"[red]{escape(monitor.failure)}", soft_wrap=True)
                _first_failure(monitor, console)
                if monitor.presses >= 2:
                    _abort(128 + signal.Signals[monitor.signal_name], args.log_dir)
                monitor.kill_ranks()
                thread.join(30)
                return 1
            if monitor.lost_nodes:
                # every rank here finished: a failed one ends the agent at once, one that succeeded leaves it in its
                # exit barrier, which waits (300 s) for the lost machine's agent, which never comes
                # (the machine that hosts the store leaves last: the others' agents fail loudly once it is gone)
                thread.join(EXIT_GRACE if node_rank == 0 else EXIT_GRACE / 3)
                if thread.is_alive():
                    return 0
        thread.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(args.log_dir, ignore_errors=True)  # (a failure's error files were read when it was seen)
        if monitor is not None:  # what this machine's ranks restored and left named, once they are gone
            remove_restored(monitor.verified_pids())
            if monitor.segments is not None:  # this machine's named segments of the job, its ranks gone
                remove_named(f"{monitor.segments}-n{node_rank}-*")
    error = outcome.get("error")
    if isinstance(error, ChildFailedError) and monitor is not None and monitor.fenced():
        console.print(f"[red]{escape(FENCED)}", soft_wrap=True)  # (its trainers left as they saw it)
        return 1
    if isinstance(error, ChildFailedError) and monitor is not None and _leaves_the_job(monitor, error):
        rank, failure = error.get_first_failure()
        print(error.format_msg(), file=sys.stderr, flush=True)
        console.print(f"[yellow]{escape(monitor.label(rank))} was killed by {failure.signal_name()}: this machine "
                      "leaves the job (its agent stopped its other ranks), and the machine that hosts the job's store "
                      "goes on without it", soft_wrap=True)
        return 1
    if isinstance(error, ChildFailedError):
        if monitor is not None:  # (before this machine falls silent: the others must not take it for a lost one)
            rank, failure = error.get_first_failure()
            monitor.report(rank, f"exited with status {failure.exitcode} (its machine's torchrun agent stopped the "
                                 "machine's ranks)")
        print(error.format_msg(), file=sys.stderr, flush=True)
        if monitor is not None:
            _first_failure(monitor, console)
        return 1
    if error is not None:
        raise error
    if monitor is not None and monitor.interrupted:
        return exit_status(monitor.stop_reason)
    return 0


def _check_range(machines: NodeRange, cfg: TrainConfig, cluster: ClusterConfig, per_node: int) -> None:
    """A job of a range of machines goes on without those that have not joined, as without lost ones, and takes them
    in as it takes a lost one's replacement: a ConfigError naming what keeps this job from it."""
    survives = Survival.of(cfg, cluster, machines.high, per_node, True).machine_loss
    if not survives or cfg.sync.method not in ("ma", "bmuf") or cluster.shard_mirror_interval > 0:
        raise ConfigError(f"--nnodes {machines}: machines join a running job with MA or BMUF, the lookup exchange and "
                          f"--min-trainers at most a machine's trainers (this job: --sync {cfg.sync.algorithm}, "
                          f"--lookup-transport {cluster.lookup_transport}, --min-trainers {cfg.min_trainers}, "
                          f"{per_node} trainers a machine) and no shard mirror (--shard-mirror-interval "
                          f"{cluster.shard_mirror_interval * 1e3:g}); give one number of machines, e.g. --nnodes "
                          f"{machines.high}")
    if cfg.max_restarts:
        raise ConfigError(f"--max-restarts {cfg.max_restarts}: a job of a range of machines (--nnodes {machines}) "
                          "starts no lost trainer again; leave it at 0")


def _options_json(cfg: TrainConfig, cluster: ClusterConfig, nproc: int) -> str:
    """The options every machine of the job must share (same_job.job_options), as the store holds them."""
    return json.dumps(job_options(cfg, cluster, nproc), default=str, sort_keys=True)


def _node_to_join(host: str, port: int, nnodes: int, nproc: int, node_rank: int, trainers_per_node: int,
                  cfg: TrainConfig, cluster: ClusterConfig) -> int | None:
    """The lost machine of a running job at the endpoint whose place this machine takes (node_join.claim_node), or
    None where no job runs there yet (this machine goes to the rendezvous). A ConfigError where a job runs there
    that this machine cannot join (every machine is in it; too late; a sync a machine cannot join; other options
    than the job's, named as the machines' check at the job's start names them)."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:  # (no store yet: the machine that hosts it has not started)
        return None
    store = dist.PrefixStore(PREFIX, dist.TCPStore(host, port, is_master=False,
                                                   timeout=datetime.timedelta(seconds=30)))
    if store.check([LAUNCH_OPTIONS]):  # (the job's: its ranks compared theirs; a joining machine is in none of that)
        theirs = json.loads(store.get(LAUNCH_OPTIONS))
        diff = differences({0: theirs, node_rank: json.loads(_options_json(cfg, cluster, nproc))})
        if diff:
            raise ConfigError(f"the job at {host}:{port} runs with other options than this machine's; start it with "
                              "the job's (only " + ", ".join(sorted(PER_MACHINE)) + " may differ):\n  "
                              + "\n  ".join(diff))
    if cfg.sync.method not in ("ma", "bmuf") and any(store.check([f"lost-node/{n}"]) for n in range(1, nnodes)):
        raise ConfigError(f"--sync {cfg.sync.algorithm}: a machine joins a running job in a lost one's place with MA "
                          "or BMUF (EASGD's sync servers are not started again)")
    node, why = claim_node(store, nnodes, trainers_per_node, socket.gethostname())
    if node is not None:
        return node
    if store.check(["pid/0"]) or store.check([LAUNCH_OPTIONS]):  # (the job's ranks run: a rendezvous would restart
        # every one of them)
        raise ConfigError(f"the job at {host}:{port} is running and this machine cannot join it: {why}")
    return None


def _run_joined(job: dict, cfg: TrainConfig, cluster: ClusterConfig, nnodes: int, nproc: int, node: int, host: str,
                port: int) -> int:
    """Start this machine's trainers in lost node `node`'s place (its servers' shards stay where the machines in the
    job restored them) and watch them as any machine's launcher does (monitor.py: the job's progress, --timeout, the
    trainers' heartbeats; Ctrl-C or SIGTERM asks every trainer of the job to stop with a checkpoint, a second
    aborts). Returns the exit status: 0 once they are done; 1 if one failed or stopped responding (the others are
    stopped); 130 / 143 / 124 after a stop."""
    console = Console(stderr=True)
    E, S = cluster.embedding_servers, cluster.sync_servers_for(cfg.sync.method, nodes=nnodes)
    Tn = nproc - E - S
    ranks = [node * nproc + local for local in range(E + S, nproc)]
    raw = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))
    store = dist.PrefixStore(PREFIX, raw)
    awaited = bool(json.loads(store.get(f"lost-node/{node}")).get("awaited"))
    trainers = ", ".join(str(t) for t in range(node * Tn, (node + 1) * Tn))
    console.print(f"node {node} of the job at {host}:{port} " + (
        f"has not joined: this machine joins as node {node} with trainers {trainers} (the machines in the job keep the "
        "shards they held for it)" if awaited else
        f"was lost: this machine joins in its place with trainers {trainers} (the machines in the job keep its "
        "shards)"), soft_wrap=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update({MONITOR_HOST_ENV: host, MONITOR_PORT_ENV: str(port)})
    os.environ.pop(SECRET_ENV, None)
    launcher_env = dict(os.environ)
    for rank in ranks:  # (the lost machine's ranks said theirs: the monitor reads each rank's pid there)
        store.delete_key(f"pid/{rank}")
    procs: dict[int, Any] = {}
    # forked from this process, which imported what a trainer runs and runs no thread yet (the fork server would
    # import it all again first: seconds before the trainers train)
    context = multiprocessing.get_context("fork")
    for local, rank in zip(range(E + S, nproc), ranks):
        env = {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(nnodes * nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nnodes),
               "MASTER_ADDR": host, "MASTER_PORT": str(port)}
        proc = context.Process(target=run_joined_rank, args=(job, launcher_env, env, os.getpid()),
                               name=f"cocosync-joined-rank{rank}", daemon=False)
        proc.start()
        procs[rank] = proc

    def wait_failed() -> None:  # (the monitor watches while this runs: until every trainer exits, or one failed)
        while any(p.is_alive() for p in procs.values()):
            for p in procs.values():
                p.join(0.1)
            if any(p.exitcode not in (None, 0) for p in procs.values()):
                return

    waiter = threading.Thread(target=wait_failed, name="cocosync-joined-ranks", daemon=True)
    monitor = Monitor(cfg, f"{cfg.sync.algorithm} T={cfg.trainers} nodes={nnodes}", raw, nproc, cluster, console,
                      nodes=nnodes, ranks=ranks, bar=False, tail=False, hosts_store=False, fence_key=fence_key(node))
    try:
        waiter.start()
        monitor.run(waiter)
        failed = [r for r, p in procs.items() if p.exitcode not in (None, 0)]
        if monitor.failure is not None or failed:
            why = monitor.failure or f"trainer rank {failed[0]} exited with status {procs[failed[0]].exitcode}"
            console.print(f"[red]the machine that joined in node {node}'s place stops: {escape(why)}",
                          soft_wrap=True)
            _first_failure(monitor, console)
            return 1
        if monitor.interrupted:
            return exit_status(monitor.stop_reason)
        return 0
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)
        for t in range(node * Tn, (node + 1) * Tn):  # (one that failed before its join holds no agreement)
            joined(store, t)
        if store.check([SEGMENTS_ID]):  # (what its trainers made and left named)
            remove_named(f"{store.get(SEGMENTS_ID).decode()}-n{node}-joined-*")


def _abort(status: int, log_dir: str) -> None:
    """Exit now (the ranks die with their launcher), leaving no directory of the agent's behind."""
    shutil.rmtree(log_dir, ignore_errors=True)
    os._exit(status)


def _leaves_the_job(monitor: Monitor, error: ChildFailedError) -> bool:
    """Whether this machine's failure is the loss of a rank killed by a signal (kill -9, the OOM killer) on a machine
    the job goes on without (not the one that hosts the job's store: Survival.machine_loss): the machine
    then leaves the job, reporting nothing, and the others take it for a lost machine. A rank that raised, or any
    failure where the job cannot lose the machine, stops the job as before."""
    _, failure = error.get_first_failure()
    return monitor.survival.machine_loss and not monitor.hosts_store and failure.exitcode < 0


def _first_failure(monitor: Monitor, console: Console) -> None:
    """Name the failure the job's ranks and launchers reported first (maybe on another machine: what this machine's
    failures followed from)."""
    if monitor.first_failure is not None:
        console.print(f"[red]the first failure reported in the job: {escape(monitor.first_failure)}", soft_wrap=True)


def _trainers_per_node(cfg: TrainConfig, cluster: ClusterConfig, nnodes: int, nproc: int) -> int:
    """Trainers per machine of the job (roles.py: servers first), or a ConfigError naming what leaves none."""
    E, S = cluster.embedding_servers, cluster.sync_servers_for(cfg.sync.method, nodes=nnodes)
    if nproc - E - S < 1:
        raise ConfigError(f"--nproc-per-node={nproc} leaves no trainer on a machine with embedding_servers={E} and "
                          f"sync_servers={S} (sync {cfg.sync.algorithm!r}): expected nproc-per-node >= {E + S + 1}")
    return nproc - E - S


def _monitor(cfg: TrainConfig, cluster: ClusterConfig, nnodes: int, nproc: int, ranks: list[int], host: str,
             port: int, console: Console, *, hosts_store: bool) -> Monitor:
    """The one-machine launcher's monitor over the job's rendezvous store, for this machine's `ranks`."""
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))
    return Monitor(cfg, f"{cfg.sync.algorithm} T={cfg.trainers} nodes={nnodes}", store, nproc, cluster, console,
                   nodes=nnodes, ranks=ranks, bar=False, tail=False, hosts_store=hosts_store)
