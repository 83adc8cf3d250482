"""`cocosync train` on one machine: the multi-machine job (rank.py) with one node, its ranks started by torch's
elastic agent (what `torchrun --standalone` runs) in a thread of this process, on a rendezvous store that listens on
127.0.0.1 only (TCPStore's own server would listen on every interface).

This process is the job's launcher and monitor, not one of its ranks: it validates everything a run reads before a
process starts, holds the output directory's lock, and watches the ranks through the store (link.py): progress (a
bar on a terminal, a line every few seconds elsewhere), heartbeats (a trainer silent for --heartbeat-timeout is named
and the job stopped), Ctrl-C (the first asks the trainers to stop and keeps what was measured, with a checkpoint; the
second aborts), --timeout (stops like the first Ctrl-C). Ranks write their output under <out>/logs/; a failed rank's
message, or torchrun's account of a rank that died, names it. Trainer 0 writes summary.json, metrics.jsonl, ne.png
and the checkpoints, as it does across machines.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.launcher.api import LaunchConfig, launch_agent

from cocosync.runtime import warm_start
from cocosync.runtime.comm.shm import SHM_DIR, format_size, shm_space
from cocosync.runtime.comm.store import LOOPBACK, LoopbackStore
from cocosync.shadowsync.checkpoint import check_resumable, read_meta, resolve
from cocosync.shadowsync.config import (
    UNLIMITED_WAIT,
    ClusterConfig,
    ConfigError,
    TrainConfig,
    check_paths,
)
from cocosync.shadowsync.data.criteo import CriteoFormatError
from cocosync.shadowsync.data.sources import (
    build_configs,
    open_reader,
    tabular_schema,
    with_init_ctr,
    with_range_lines,
    with_schema,
)
from cocosync.shadowsync.data.tabular import TabularError, count_rows
from cocosync.shadowsync.job.link import MONITOR_PORT_ENV, SECRET_ENV, job_prefix
from cocosync.shadowsync.job.monitor import Monitor
from cocosync.shadowsync.job.rank_start import job_dict, mark_agent_keys, run_rank
from cocosync.shadowsync.job.run_model import run_model
from cocosync.shadowsync.job.segments import remove_job_segments
from cocosync.shadowsync.job.survival import Survival
from cocosync.shadowsync.job.trainer import TrainerFailure
from cocosync.shadowsync.metrics import read_metrics

__all__ = ["RunResult", "run_training", "OutputLock", "crowded_shadow_advice"]

_BACKEND = "cocosync-loopback"
_STORES: dict[int, LoopbackStore] = {}  # port -> the store a run in this process owns


class _LoopbackRendezvous(DynamicRendezvousHandler):
    """torch's c10d rendezvous on our loopback store; the workers' bootstrap store is that same store (torch would
    start another TCPStore server for them, on every interface)."""

    loopback: LoopbackStore

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> Any:
        return self.loopback.store


class _LoopbackBackend(C10dRendezvousBackend):
    @property
    def name(self) -> str:
        return _BACKEND


def _create_handler(params: RendezvousParameters) -> _LoopbackRendezvous:
    port = int(params.endpoint.rsplit(":", 1)[1])
    loopback = _STORES[port]
    backend = _LoopbackBackend(loopback.store, params.run_id)
    handler = _LoopbackRendezvous.from_backend(params.run_id, loopback.store, backend, params.min_nodes,
                                               params.max_nodes, local_addr=LOOPBACK)
    handler.loopback = loopback
    return handler


try:
    rendezvous_handler_registry.register(_BACKEND, _create_handler)
except ValueError:  # registered by an earlier import of this module (importlib.reload)
    pass


class _RankLogs(LogsSpecs):
    """Every rank's stdout and stderr in <out>/logs/rank<R>.{out,err}, its error file beside them."""

    def __init__(self, log_dir: Path):
        super().__init__(log_dir=str(log_dir))
        self.dir = log_dir

    @property
    def root_log_dir(self) -> str:
        return str(self.dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        self.dir.mkdir(parents=True, exist_ok=True)
        dest = LogsDest()
        for r, env in envs.items():
            dest.stdouts[r], dest.stderrs[r] = str(self.dir / f"rank{r}.out"), str(self.dir / f"rank{r}.err")
            dest.error_files[r] = str(self.dir / f"rank{r}.error.json")
            env["TORCHELASTIC_ERROR_FILE"] = dest.error_files[r]
            mark_agent_keys(env)  # what a forked rank keeps over its launcher's environment
            Path(dest.error_files[r]).unlink(missing_ok=True)
        return dest


class OutputLock:
    """One run per output directory: an flock on <out>/.lock (released by the kernel even if the run is killed),
    holding the pid of the run that owns it, so a second run is refused naming the first."""

    def __init__(self, out: Path):
        self.path = out / ".lock"
        self.fd = -1

    def __enter__(self) -> "OutputLock":
        import fcntl

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise ConfigError(f"output directory {str(self.path.parent)!r} is in use by another run (pid {owner}); "
                              "wait for it to finish or pass another --out") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)  # releases the lock


@dataclass
class RunResult:
    """What a run measured: the summary (summary.json), the metric records, and where its files are."""

    name: str
    summary: dict
    records: list[dict]
    out_dir: str
    checkpoint: str | None = None
    plot: str | None = None
    interrupted: bool = False
    stop_reason: str | None = None  # what stopped it early: "Ctrl-C", "SIGTERM", "--timeout N s reached"


def run_training(cfg: TrainConfig, *, console: Any = None, resume: str | os.PathLike | None = None,
                 checkpoint_every: int | None = None, stop_after: int | None = None, eval_every: int | None = None,
                 cluster: ClusterConfig | None = None, name: str | None = None) -> RunResult:
    """Train `cfg` on this machine: 1 embedding server + `cfg.trainers` trainers (+ EASGD's sync server), W Hogwild
    workers each, as the multi-machine job with one node. `resume`: a checkpoint directory or a run directory
    (its latest checkpoint; another trainer or worker count is planned onto); `checkpoint_every`: also checkpoint
    every this many examples; `stop_after`: stop with a checkpoint once the run (the runs it resumed included) has seen
    this many examples; `eval_every`: score trainer 0's replica on the held-out set every this many examples (an eval
    curve; the best model is kept as checkpoints/best). `cluster` sets the rest (servers, prefetch, ...)."""
    console = console or Console(stderr=True)
    cluster = cluster or ClusterConfig()
    for key, v in (("checkpoint_every", checkpoint_every), ("stop_after", stop_after), ("eval_every", eval_every)):
        if v is not None:
            setattr(cluster, key, v)
    if resume is not None:
        cluster.resume = str(resume)
    ClusterConfig.__post_init__(cluster)  # the values set above are checked as the constructor checks them
    if cfg.max_restarts and not Survival.of(cfg, cluster, 1, cfg.trainers, True).losses:
        why = ("DS-Sync needs every trainer" if cfg.sync.method == "dssync"
               else f"--min-trainers {cfg.min_trainers} of {cfg.trainers} trainers")
        raise ConfigError(f"--max-restarts {cfg.max_restarts}: this job does not go on without a lost trainer ({why}), "
                          "so none is started again; leave it at 0, or use more trainers than --min-trainers")
    sync_servers = cluster.sync_servers_for(cfg.sync.method, nodes=1)
    nproc = cluster.embedding_servers + sync_servers + cfg.trainers
    check_paths(cfg)  # everything a rank reads is checked before a process starts
    if cluster.resume is not None:
        cluster.resume = str(check_resume(cfg, cluster))
    # (reads the data's first rows: a file that is not Criteo's is named here)
    cfg = with_init_ctr(with_schema(cfg))
    if cluster.resume is None:  # (a resumed run keeps its run's counts: its shards' rows stay as they were)
        cfg = with_range_lines(cfg)
    cfg = _fit_examples_to_data(cfg, console)
    _describe_data(cfg, console)
    _check_eval_data(cfg)
    _check_shared_memory(cfg, cluster)
    if warm_start.warm():  # (after the checks: a run_training refused starts no process; the `cocosync` command
        # started it before its imports, and a server started so dies with a command refused: server_exit.py)
        warm_start.start()  # the server imports while the rendezvous is set up
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with OutputLock(out):
        job = out / "job.json"
        job.write_text(json.dumps(job_dict(cfg, cluster), indent=2) + "\n")
        (out / "summary.json").unlink(missing_ok=True)  # what the end reads is this run's
        if cluster.resume is None:
            (out / "metrics.jsonl").unlink(missing_ok=True)
        return _launch(cfg, cluster, nproc, job, console, name)


def check_resume(cfg: TrainConfig, cluster: ClusterConfig, *, work_left: bool = True) -> Path:
    """The checkpoint `cluster.resume` names (a run directory: its latest), checked before a process starts: a
    damaged or crafted one, another data set, budget, seed or model, or (with `work_left`) nothing left to train
    is a ConfigError naming it. (Across machines a resume with nothing left is a reshard: it saves the checkpoint
    again on the job's servers and trainers.)"""
    from cocosync.shadowsync.safe_reader import SafeReader

    path = resolve(cluster.resume)
    SafeReader(str(path)).read_metadata()
    meta = read_meta(path)
    check_resumable(meta, cfg, path)
    if work_left:
        _check_work_left(int(meta.get("examples_seen", 0)), cfg, cluster.stop_after, path)
    return path


def _check_work_left(seen: int, cfg: TrainConfig, stop_after: int | None, path: Path) -> None:
    """A resume with nothing left to train is refused before a rank starts (it would rewrite the run's summary with
    an empty session)."""
    end = min(cfg.total_examples, stop_after or cfg.total_examples)
    if seen >= end:
        what = (f"--stop-after {stop_after:,}" if stop_after and stop_after < cfg.total_examples
                else f"the budget ({cfg.examples:,} examples x {cfg.epochs} epochs)")
        raise ConfigError(f"nothing left to train: {str(path)!r} has seen {seen:,} examples, {what} is "
                          f"{end:,}; score it with `cocosync eval {path}`, or resume with more --epochs or a "
                          "later --stop-after")


def _describe_data(cfg: TrainConfig, console: Any) -> None:
    """The run's first lines: a Parquet/CSV file's schema (its tables sized from the data) and the model's tables."""
    data, model_cfg = build_configs(cfg)
    schema = tabular_schema(data)
    if schema is not None:
        console.print(escape(f"{cfg.data}: {schema.format}, {schema.describe()}"), soft_wrap=True)
    if schema is not None or cfg.model_factory != "dlrm":
        model = run_model(cfg, data, model_cfg)
        console.print(escape(f"model {cfg.model_factory}: {sum(p.numel() for p in model.dense_parameters()):,} dense "
                             f"parameters\n{model.plan.describe()}"), soft_wrap=True)


def _count_lines(path: str) -> int:
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            n, last = n + chunk.count(b"\n"), chunk[-1:]
    return n + (last != b"\n")


def _fit_examples_to_data(cfg: TrainConfig, console: Any) -> TrainConfig:
    """--examples caps a plain data file, it does not pad it: a file with fewer lines trains on all of them (said
    before training); without --eval-data the held-out rows are the file's after the budget, so a file with none left
    is refused now rather than after training. (A .gz file is not counted: it would be read once more in full.)"""
    data, _ = build_configs(cfg)
    if data.train_path is None or str(data.train_path).endswith(".gz"):
        return cfg
    tabular = tabular_schema(data) is not None
    rows = (count_rows(data.train_path) if tabular else sum(data.range_lines) if data.range_lines is not None
            else _count_lines(data.train_path))
    unit = "rows" if tabular else "lines"
    if data.eval_path is None and rows <= cfg.examples:
        raise ConfigError(f"{data.train_path!r} has {rows:,} {unit} and --examples is {cfg.examples:,}: no rows are "
                          "left after the budget for the held-out set; pass --eval-data, or --examples below "
                          f"{rows:,}")
    if rows < cfg.examples:
        console.print(f"[yellow]{escape(str(data.train_path))} has {rows:,} {unit}, fewer than --examples "
                      f"{cfg.examples:,}: training on all {rows:,}", soft_wrap=True)
        return dataclasses.replace(cfg, examples=rows)
    return cfg


def _check_eval_data(cfg: TrainConfig) -> None:
    """A held-out file (--eval-data) is read as Criteo lines before training, not found unreadable after it."""
    data, _ = build_configs(cfg)
    if data.eval_path is None:
        return
    try:
        first = next(iter(open_reader(data.eval_path, data, batch_size=1024, max_rows=1024)), None)
    except (CriteoFormatError, TabularError) as e:
        raise ConfigError(f"--eval-data {data.eval_path!r} cannot be scored on: {e}") from None
    if first is None:
        raise ConfigError(f"--eval-data {data.eval_path!r} has no readable rows")


def _check_shared_memory(cfg: TrainConfig, cluster: ClusterConfig) -> None:
    """Refuse, before a process starts, a job whose tables cannot fit /dev/shm: the embedding shards (weights, row-wise
    Adagrad accumulator, row versions) plus the trainers' dense sync buffers (a few copies of the dense parameters
    each; an estimate: the ranks check every segment again as they create it)."""
    data, model_cfg = build_configs(cfg)
    model = run_model(cfg, data, model_cfg)
    rows, dim = model.plan.total_rows, model.plan.width
    dense = sum(p.numel() for p in model.dense_parameters())
    tables = rows * (dim * 4 + 4 + 8)
    need = tables + 4 * cfg.trainers * dense * 4
    free, total = shm_space()
    if need > free:
        raise ConfigError(f"this run needs about {format_size(need)} of shared memory ({rows:,} embedding rows x "
                          f"{dim} floats with their accumulators: {format_size(tables)}; the dense sync's buffers), "
                          f"and {SHM_DIR} has {format_size(free)} free of {format_size(total)}: free space there, give "
                          "the container more shared memory (docker --shm-size), or shrink --table-size / "
                          "--embedding-dim")
    available = _memory_available()
    if available is not None and need > available:  # /dev/shm's size can exceed the memory behind it
        raise ConfigError(f"this run needs about {format_size(need)} of shared memory for its tables and sync "
                          f"buffers, and the machine has {format_size(available)} of memory available: shrink "
                          "--table-size / --embedding-dim")


def _memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# Eval NE against one trainer at T=16 on 2 cores, 3.2M examples, 20 runs each (10 for shadow-bmuf; BENCHMARKS.md)
_CROWDED_NE = {"shadow-ma": "+1.06%", "shadow-easgd": "+0.83%", "shadow-dssync": "+0.98%"}
_CROWDED_PICKS = "shadow-bmuf +0.15%, fr-ma +0.29%"


def _cores() -> int:
    """The cores this process may run on (its CPU affinity, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def crowded_shadow_advice(cfg: TrainConfig, trainers_here: int, cores: int | None = None) -> str | None:
    """A warning when this machine's trainers outnumber its cores (`cores`: this process's CPU affinity by default)
    and `cfg` syncs with a plain shadow average, which lost about a point of NE there while shadow-bmuf and fr-ma did
    not; None otherwise. For MA the cause is measured: a round waits for every trainer's shadow thread to be
    scheduled, and the steps taken meanwhile use a replica about to be averaged (BENCHMARKS.md, "the steps in flight
    during a round")."""
    measured = _CROWDED_NE.get(cfg.sync.algorithm)
    cores = cores if cores is not None else _cores()
    if measured is None or trainers_here <= cores:
        return None
    return (f"{trainers_here} trainers share {cores} core{'s' if cores > 1 else ''} on this machine: with more "
            f"trainers than cores {cfg.sync.algorithm} measured {measured} eval NE over one trainer at T=16 on 2 "
            f"cores ({_CROWDED_PICKS}; BENCHMARKS.md). Consider --sync shadow-bmuf or fr-ma, or fewer --trainers.")


def _launch(cfg: TrainConfig, cluster: ClusterConfig, nproc: int, job: Path, console: Any,
            name: str | None) -> RunResult:
    out = Path(cfg.out_dir)
    store = LoopbackStore(timeout=max(cfg.timeout or UNLIMITED_WAIT, 60.0))
    _STORES[store.port] = store
    servers = f"{cluster.embedding_servers} embedding server" + ("s" if cluster.embedding_servers > 1 else "")
    sync = nproc - cluster.embedding_servers - cfg.trainers
    advice = crowded_shadow_advice(cfg, cfg.trainers)
    if advice is not None:
        console.print(f"[yellow]{escape(advice)}", soft_wrap=True)
    console.print(f"starting {nproc} processes on this machine ({servers}, "
                  + (f"{sync} sync server, " if sync else "") + f"{cfg.trainers} trainer"
                  + ("s" if cfg.trainers > 1 else "") + f"; their output: {escape(str(out))}/logs/) ...")
    warm = warm_start.warm()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"cocosync-{uuid.uuid4().hex[:8]}",
                          rdzv_backend=_BACKEND, rdzv_endpoint=f"{LOOPBACK}:{store.port}", max_restarts=0,
                          monitor_interval=0.1, local_addr=LOOPBACK, logs_specs=_RankLogs(out / "logs"),
                          start_method="forkserver")
    outcome: dict[str, Any] = {}

    def agent(launcher_env: dict[str, str]) -> None:
        try:
            if warm:  # the ranks fork from the warm server, handed this environment (the server's is older)
                with warm_start.main_not_rerun():
                    outcome["returns"] = launch_agent(config, run_rank, [str(job), launcher_env, os.getpid()])
            else:
                outcome["returns"] = launch_agent(config, sys.executable, ["-u", "-m", "cocosync.shadowsync", "--job",
                                                                           str(job)])
        except ChildFailedError as e:
            outcome["failures"] = e.failures
        except BaseException as e:  # noqa: BLE001 - reported by the monitor
            outcome["error"] = e

    saved = {k: os.environ.get(k) for k in (MONITOR_PORT_ENV, SECRET_ENV, "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")}
    os.environ[MONITOR_PORT_ENV] = str(store.port)
    secret = os.environ[SECRET_ENV] = secrets.token_hex(16)  # (the ranks' environment: not on a command line)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    # the agent's own logging (a thread cannot take signals, rendezvous rounds, worker events, a failed rank's
    # traceback as the agent saw it, the others stopped): the monitor says what failed, naming the rank
    quiet = {logging.getLogger(name): level for name, level in (("torch.distributed.elastic", logging.CRITICAL),
                                                                ("torch.multiprocessing.spawn", logging.ERROR),
                                                                ("torchelastic-events-null", logging.ERROR))}
    levels = [q.level for q in quiet]
    for q, level in quiet.items():
        q.setLevel(level)
    thread = threading.Thread(target=agent, args=(dict(os.environ),), name="cocosync-elastic-agent", daemon=True)
    monitor = Monitor(cfg, name or f"{cfg.sync.algorithm} T={cfg.trainers}", store.store, nproc, cluster, console,
                      prefix=job_prefix(secret))
    try:
        thread.start()
        monitor.run(thread)
    finally:
        if thread.is_alive():  # aborted: no rank outlives the run
            monitor.kill_ranks()
            thread.join(30)
        remove_job_segments(monitor.store)  # (named while the job ran: a restarted trainer maps them)
        for q, level in zip(quiet, levels):
            q.setLevel(level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _STORES.pop(store.port, None)
        store.close()
    failure = monitor.failure or _describe_failure(outcome, monitor)
    summary_path = out / "summary.json"
    if failure is not None or not summary_path.is_file():
        failure = failure or "the job ended without a summary (see the ranks' output in " + str(out / "logs") + ")"
        try:
            with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:  # no rank writes any more
                f.write(json.dumps({"time": time.time(), "event": "failed", "error": failure}) + "\n")
        except OSError:  # (a full or read-only disk: the failure is said on the terminal all the same)
            pass
        raise TrainerFailure(f"training failed: {failure}")
    summary = json.loads(summary_path.read_text())
    return RunResult(name=summary["name"], summary=summary, records=read_metrics(out / "metrics.jsonl"),
                     out_dir=str(out), checkpoint=summary.get("checkpoint"), plot=summary.get("plot"),
                     interrupted=monitor.interrupted, stop_reason=monitor.stop_reason)


def _describe_failure(outcome: dict, monitor: Monitor) -> str | None:
    """Why the job failed, naming the rank that started it: a rank killed by a signal other than the agent's SIGTERM,
    else the earliest message a failing rank left, else torchrun's account of any rank."""
    if "error" in outcome:  # (a rank's own message first: e.g. a full disk also leaves its error file empty)
        messages = monitor.failure_messages()
        return messages[0][1] if messages else f"the elastic agent failed: {outcome['error']!r}"
    failures = outcome.get("failures")
    if not failures:
        return None
    killed = [(r, f) for r, f in failures.items() if f.exitcode is not None and f.exitcode < 0
              and f.signal_name() not in ("SIGTERM", "SIGINT")]
    messages = monitor.failure_messages()
    if killed:
        r, f = min(killed, key=lambda rf: rf[1].timestamp)  # (a trainer under a keeper: the trainer's own pid)
        text = f"{monitor.label(r)} (pid {monitor.pid_of(r) or f.pid}) was killed by signal {f.signal_name()}"
    elif messages:
        r, text = messages[0]
    else:
        r, f = min(failures.items(), key=lambda rf: rf[1].timestamp)
        text = f"{monitor.label(r)} (pid {f.pid}) exited with code {f.exitcode}"
    others = len(failures) - 1
    return text + (f"\n(and {others} consequential error(s); the ranks' output: {monitor.logs})" if others else "")

