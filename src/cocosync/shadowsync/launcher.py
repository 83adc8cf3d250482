"""Launching a ShadowSync run on one machine: spawn T trainer processes around the shared state (state.py),
monitor them (progress bar, JSON-lines metrics, one handler per message kind, Ctrl-C: first stop and keep what was
measured, second abort; a dead trainer becomes a TrainerFailure naming it), tear down (no process outlives the
run), then finish: score the final model on the held-out set, write summary.json, checkpoint.pt and the NE plot.
The trainer processes are in trainer_process.py, the Trainer in trainer.py."""

from __future__ import annotations

import fcntl
import json
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cocosync.runtime.comm.store import LoopbackStore
from cocosync.shadowsync.checkpoint import check_resumable, read_checkpoint, write_checkpoint
from cocosync.shadowsync.config import DataConfig
from cocosync.shadowsync.embeddings import SharedEmbeddings
from cocosync.shadowsync.eval_curve import BEST_NAME, describe, previous_best
from cocosync.shadowsync.metrics import MetricsLogger, evaluate, plot_ne, read_metrics
from cocosync.shadowsync.model import DLRM
from cocosync.shadowsync.sources import FileSource, build_configs, eval_batches, make_source, with_init_ctr
from cocosync.shadowsync.state import SharedState, build_model, build_shared_state
from cocosync.shadowsync.sync import FlatParams
from cocosync.shadowsync.train_config import (
    COLLECTIVE_METHODS,
    ConfigError,
    TrainConfig,
    check_paths,
    config_from_dict,
    config_to_dict,
)
from cocosync.shadowsync.trainer import TrainerFailure, json_safe
from cocosync.shadowsync.trainer_process import TrainerPlan, plan_trainers, trainer_main

__all__ = ["RunResult", "run_training", "load_checkpoint_model"]


# ---------------------------------------------------------------------------------------------- spawn
class _Interrupts:
    """Counts SIGINTs: the first asks the trainers to stop, the second aborts."""

    def __init__(self) -> None:
        self.count = 0
        self.previous: Any = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count >= 3:
            raise KeyboardInterrupt


@dataclass
class Trainers:
    """The spawned trainer processes and the read ends of their message pipes (conn -> trainer rank)."""

    procs: list[mp.process.BaseProcess]
    conns: dict[Connection, int]
    interrupts: _Interrupts
    main_thread: bool


def spawn_trainers(cfg: TrainConfig, state: SharedState, source: Any, store_port: int | None,
                   plan: TrainerPlan | None = None) -> Trainers:
    """Start the T trainers. They are spawned with SIGINT blocked and ignore it: the launcher owns Ctrl-C (its
    handler counts presses from here on; teardown restores the previous one)."""
    ctx = mp.get_context("spawn")
    interrupts = _Interrupts()
    trainers = Trainers([], {}, interrupts, threading.current_thread() is threading.main_thread())
    if trainers.main_thread:
        interrupts.previous = signal.signal(signal.SIGINT, interrupts)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for r in range(cfg.trainers):
            rd, wr = ctx.Pipe(duplex=False)
            p = ctx.Process(target=trainer_main, name=f"cocosync-trainer{r}", daemon=True,
                            args=(r, cfg, state, source, store_port, wr, plan or TrainerPlan()))
            p.start()
            wr.close()
            trainers.procs.append(p)
            trainers.conns[rd] = r
    finally:
        if trainers.main_thread:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    return trainers


# ---------------------------------------------------------------------------------------------- monitor
class _NoBar:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _progress(cfg: TrainConfig, console: Any) -> Any:
    if not cfg.progress:
        return _NoBar()
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("EPS {task.fields[eps]}"), TextColumn("train NE {task.fields[ne]}"),
                    TimeElapsedColumn(), console=console)


class Monitor:
    """Reads the trainers' messages until each has reported its result, or something failed (`failures`)."""

    def __init__(self, cfg: TrainConfig, name: str, state: SharedState, trainers: Trainers, logger: MetricsLogger,
                 console: Any, resumed_from: int, save: Callable[[dict[int, dict]], None] | None = None):
        """`save(states)`: write a periodic checkpoint from every trainer's state (all paused at one mark)."""
        self.cfg, self.name, self.state, self.trainers = cfg, name, state, trainers
        self.logger, self.console, self.resumed_from, self.save = logger, console, resumed_from, save
        self.marks: dict[int, dict[int, dict]] = {}  # mark -> trainer -> its state, while they wait at the mark
        self.results: dict[int, dict] = {}
        self.failures: list[str] = []
        self.latest: dict[int, dict] = {}  # each trainer's last progress message
        self.ready = 0
        self.t_start = time.time()
        self.bar: Any = None
        self.task: Any = None
        self.handlers: dict[str, Callable[[int, dict], None]] = {
            "train": self._on_train, "ready": self._on_ready, "result": self._on_result, "error": self._on_error,
            "checkpoint": self._on_checkpoint, "eval": self._on_eval}
        self.best_eval = previous_best(Path(cfg.out_dir))  # the lowest eval NE of the curve (its model: best.pt)

    def run(self) -> None:
        t_launch = time.time()
        interrupts = self.trainers.interrupts
        try:
            with _progress(self.cfg, self.console) as self.bar:
                if self.bar:
                    self.task = self.bar.add_task(self.name, total=self.cfg.total_examples, ne="-", eps="-")
                while len(self.results) < self.cfg.trainers and not self.failures:
                    if interrupts.count and not self.state.stop[0]:
                        self.state.stop[0] = 1
                        self.console.print("[yellow]Ctrl-C: stopping the trainers (Ctrl-C again to abort)...")
                    if interrupts.count >= 2:
                        self.failures.append("aborted by a second Ctrl-C")
                        break
                    if time.time() - t_launch > self.cfg.timeout:
                        self.failures.append(f"run timed out after {self.cfg.timeout:.0f}s (TrainConfig.timeout)")
                        break
                    stalled = self._stalled()
                    if stalled:
                        self.failures.append(stalled)
                        break
                    self._poll(timeout=0.2)
                    self._release_marks()
                    if self.bar:
                        self.bar.update(self.task, completed=int(self.state.positions.sum()))
        except KeyboardInterrupt:
            self.failures.append("aborted by Ctrl-C")

    def _stalled(self) -> str | None:
        """The first trainer (not yet finished) whose heartbeat is older than cfg.heartbeat_timeout."""
        now = time.monotonic()
        for r, p in enumerate(self.trainers.procs):
            last = float(self.state.heartbeat[r])
            if r not in self.results and last > 0 and now - last > self.cfg.heartbeat_timeout:
                return (f"trainer {r} (pid {p.pid}) stopped responding: no heartbeat for {now - last:.0f}s "
                        f"(TrainConfig.heartbeat_timeout={self.cfg.heartbeat_timeout:g}s; the process is stopped, "
                        "hung or not scheduled)")
        return None

    def _poll(self, timeout: float) -> None:
        conns = self.trainers.conns
        for c in wait(list(conns), timeout=timeout):
            r = conns[c]
            try:
                msg = c.recv()
            except (EOFError, OSError):  # the trainer is gone: fine after its result, a failure before it
                del conns[c]
                if r not in self.results:
                    self.trainers.procs[r].join(2)
                    self.failures.append(_describe_exit(r, self.trainers.procs[r]))
                continue
            self.handlers[msg["kind"]](r, msg)

    def _on_train(self, r: int, msg: dict) -> None:
        self.latest[r] = msg
        total = self.resumed_from + sum(m["trainer_examples"] for m in self.latest.values())
        nes = [m["train_ne"] for m in self.latest.values() if math.isfinite(m["train_ne"])]
        rec = {"event": "train", "examples": total, "train_ne": float(np.mean(nes)) if nes else None,
               "eps": total / max(time.time() - self.t_start, 1e-9), "trainer": r,
               "trainer_examples": msg["trainer_examples"], "trainer_ne": msg["train_ne"],
               "trainer_eps": msg["trainer_eps"], "syncs": msg["syncs"]}
        self.logger.log(json_safe(rec))
        if self.bar:
            self.bar.update(self.task, completed=int(self.state.positions.sum()),
                            ne=f"{rec['train_ne']:.4f}" if rec["train_ne"] else "-", eps=f"{rec['eps']:,.0f}")

    def _on_ready(self, r: int, msg: dict) -> None:
        self.ready += 1
        if self.ready == self.cfg.trainers:  # start together: EPS is measured over a common window
            self.state.go[0] = 1
            self.t_start = time.time()

    def _on_eval(self, r: int, msg: dict) -> None:
        rec = {k: v for k, v in msg.items() if k != "kind"}
        self.logger.log(json_safe(rec))
        if rec.get("best"):
            self.best_eval = rec["eval_ne"]
        self.console.print(describe(rec))

    def _on_result(self, r: int, msg: dict) -> None:
        self.results[r] = msg

    def _on_checkpoint(self, r: int, msg: dict) -> None:
        self.marks.setdefault(msg["mark"], {})[r] = msg["state"]

    def _release_marks(self) -> None:
        """Write the checkpoint of a mark once every trainer waits at it; let it pass unwritten if a trainer cannot
        come (its workers are done, or the run stops: the end writes a checkpoint anyway)."""
        T = self.cfg.trainers
        for mark in sorted(self.marks):
            states = self.marks[mark]
            if len(states) == T and not self.state.stop[0]:
                self.save(states)
            elif not (self.state.stop[0] or any(self.state.done[r] for r in range(T) if r not in states)):
                return  # some trainer is still on its way to this mark
            del self.marks[mark]
            self.state.released[0] = mark

    def _on_error(self, r: int, msg: dict) -> None:
        self.failures.append(f"trainer {r} raised:\n{msg['traceback']}")


# ---------------------------------------------------------------------------------------------- teardown
def _describe_exit(rank: int, proc: mp.process.BaseProcess) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code} without reporting a result"
    return f"trainer {rank} (pid {proc.pid}) {how}"


def _stop_processes(procs: list, grace: float) -> None:
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def teardown(trainers: Trainers, state: SharedState, failed: bool) -> None:
    """Stop every trainer (after a failure at once, else after a grace period for them to finish), close the
    pipes, give Ctrl-C back to its previous handler."""
    if failed:
        state.stop[0] = 1
    _stop_processes(trainers.procs, grace=3.0 if failed else 30.0)
    for c in trainers.conns:
        c.close()
    if trainers.main_thread:
        signal.signal(signal.SIGINT, trainers.interrupts.previous)


# ---------------------------------------------------------------------------------------------- the run
@dataclass
class RunResult:
    """What a run measured: the summary row, the metric records (for plots), and where its files are."""

    name: str
    summary: dict
    records: list[dict] = field(default_factory=list)
    out_dir: str = ""
    checkpoint: str | None = None
    plot: str | None = None
    interrupted: bool = False


@dataclass
class _Run:
    """What the end of a run needs of its set-up."""

    cfg: TrainConfig
    name: str
    data: DataConfig
    model: DLRM
    flat: FlatParams
    state: SharedState
    logger: MetricsLogger
    out: Path
    extra: dict


def run_training(cfg: TrainConfig, *, name: str | None = None, console: Any = None,
                 extra_summary: dict | None = None, resume: str | os.PathLike | None = None,
                 checkpoint_every: int | None = None, stop_after: int | None = None,
                 eval_every: int | None = None) -> RunResult:
    """Train T trainers x W workers as configured; returns the measurements (see module doc).

    `resume`: a checkpoint of a run with the same data, budget, T and W (one stopped by Ctrl-C or --stop-after, or
    the last periodic checkpoint of a run that was killed): every trainer restarts from its replica, dense
    optimizer and sync state, the tables from their weights and accumulators, the readers at their positions.
    `checkpoint_every`: also write checkpoint.pt every this many examples of the run (every trainer pauses at its
    share of the mark; a killed run loses at most that much). `stop_after`: stop once the run (earlier sessions
    included) has seen this many examples, with a checkpoint. `eval_every`: trainer 0 scores its replica every this
    many examples of the run (an eval NE curve in metrics.jsonl) and keeps the best model as best.pt."""
    for key, v in (("checkpoint_every", checkpoint_every), ("stop_after", stop_after), ("eval_every", eval_every)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"{key}={v!r} is invalid: expected a number of examples >= 1")
    console = console or Console(stderr=True)
    name = name or f"{cfg.sync.algorithm} T={cfg.trainers}"
    check_paths(cfg)  # before anything is spawned
    cfg = with_init_ctr(cfg)
    data, model_cfg = build_configs(cfg)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _OutputLock(out):
        return _run(cfg, name, console, data, model_cfg, out, extra_summary, resume, checkpoint_every, stop_after,
                    eval_every)


class _OutputLock:
    """One run per output directory: an flock on <out>/.lock (released by the kernel even if the run is killed),
    holding the pid of the run that owns it, so a second run is refused naming the first."""

    def __init__(self, out: Path):
        self.path = out / ".lock"
        self.fd = -1

    def __enter__(self) -> "_OutputLock":
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


def _run(cfg: TrainConfig, name: str, console: Any, data: DataConfig, model_cfg: Any, out: Path,
         extra_summary: dict | None, resume: str | os.PathLike | None, checkpoint_every: int | None,
         stop_after: int | None, eval_every: int | None) -> RunResult:
    torch.manual_seed(cfg.seed)
    source = make_source(cfg, data)
    if not isinstance(source, FileSource):
        source.share_memory_()
    ckpt = None
    if resume is not None:
        ckpt = read_checkpoint(resume)
        check_resumable(ckpt, cfg, Path(resume))
    model, flat, state = build_shared_state(cfg, data, model_cfg, ckpt)
    resumed_from = int(ckpt["positions"].sum()) if ckpt is not None else 0
    if ckpt is None:  # a best.pt here belongs to an earlier run in this directory
        (out / BEST_NAME).unlink(missing_ok=True)
    extra = {**(extra_summary or {}), **({"resumed_from": resumed_from} if ckpt is not None else {})}
    store = None  # the trainers' rendezvous for gloo (MA, BMUF): loopback only
    if cfg.sync.method in COLLECTIVE_METHODS and cfg.trainers > 1:
        store = LoopbackStore(timeout=120)
    logger = MetricsLogger(out / "metrics.jsonl", append=ckpt is not None)
    logger.log(event="start", name=name, config=config_to_dict(cfg), resumed_from=resumed_from)
    run = _Run(cfg, name, data, model, flat, state, logger, out, extra)
    saved = ckpt.get("trainers") if ckpt is not None else None  # absent in checkpoints of earlier versions
    resume_states = [{k: v.numpy() for k, v in t.items()} for t in saved] if saved is not None else None
    plan = plan_trainers(cfg, state.positions, resume_states, checkpoint_every, stop_after, eval_every)
    trainers = spawn_trainers(cfg, state, source, store.port if store else None, plan)

    def save(states: dict[int, dict]) -> None:
        path = _write_checkpoint(run, states)
        logger.log(event="checkpoint", examples=int(state.positions.sum()), path=str(path))

    monitor = Monitor(cfg, name, state, trainers, logger, console, resumed_from, save)
    try:
        monitor.run()
    finally:
        teardown(trainers, state, failed=bool(monitor.failures))
        if store is not None:
            store.close()
    if monitor.failures:
        failures = monitor.failures
        logger.log(event="failed", error=failures[0])
        logger.close()
        raise TrainerFailure(f"training failed: {failures[0]}" +
                             (f"\n(and {len(failures) - 1} consequential error(s))" if len(failures) > 1 else ""))
    stopped = (stop_after is not None and stop_after < cfg.total_examples
               and int(state.positions.sum()) >= plan.stop_at * cfg.trainers)
    return _finish(run, monitor.results, interrupted=bool(state.stop[0]), stopped=stopped,
                   best_eval=monitor.best_eval)


def _write_checkpoint(run: _Run, states: dict[int, dict], summary: dict | None = None) -> Path:
    """checkpoint.pt from every trainer's state (Trainer.checkpoint_state, one mark or the end) and the tables."""
    cfg, state = run.cfg, run.state
    trainers = [{k: torch.from_numpy(np.asarray(v)) for k, v in states[r].items()} for r in range(cfg.trainers)]
    run.flat.flat.copy_(state.center if state.center is not None else trainers[0]["flat"])
    ckpt = {
        "config": config_to_dict(cfg), "name": run.name,
        "dense": {k: v.clone() for k, v in run.model.state_dict().items() if not k.startswith("embeddings.")},
        "embeddings": state.embeddings.state_dict(),
        "positions": torch.stack([t.pop("positions") for t in trainers]), "shards": cfg.trainers * cfg.workers,
        "trainers": trainers, **({"summary": summary} if summary is not None else {}),
    }
    path = run.out / "checkpoint.pt"
    write_checkpoint(path, ckpt)
    return path


def _finish(run: _Run, results: dict[int, dict], interrupted: bool, stopped: bool = False,
            best_eval: float = math.inf) -> RunResult:
    cfg, name, state, out, extra = run.cfg, run.name, run.state, run.out, run.extra
    T = cfg.trainers
    final = state.center if state.center is not None else torch.from_numpy(results[0]["dense"])
    run.flat.flat.copy_(final)
    ev = evaluate(run.model, eval_batches(cfg, run.data))
    examples = sum(r["examples"] for r in results.values())
    seconds = max(r["end"] for r in results.values()) - min(r["start"] for r in results.values())
    gaps = [r["sync_gap"] for r in results.values() if math.isfinite(r["sync_gap"])]
    summary = {
        "name": name, "sync": cfg.sync.algorithm, "T": T, "W": cfg.workers, "examples": examples,
        "eps": examples / max(seconds, 1e-9),
        "eps_per_trainer": float(np.mean([r["examples"] / max(r["seconds"], 1e-9) for r in results.values()])),
        "eps_per_cpu": examples / max(sum(r["cpu_seconds"] for r in results.values()), 1e-9),
        "train_ne": float(np.nanmean([r["train_ne"] for r in results.values()])),
        "eval_ne": ev["ne"], "auc": ev["auc"], "calibration": ev["calibration"], "bayes_ne": ev["bayes_ne"],
        "eval_examples_scored": ev["examples"],
        "excess_ne": ev["ne"] - ev["bayes_ne"] if math.isfinite(ev["bayes_ne"]) else float("nan"),
        "sync_gap": float(np.mean(gaps)) if gaps else float("nan"),
        "syncs": int(sum(r["syncs"] for r in results.values())),
        "seconds": seconds, "interrupted": interrupted, "stopped": stopped, **extra,
        **({"best_eval_ne": min(best_eval, ev["ne"])} if math.isfinite(best_eval) else {}),
    }
    seen = examples + int(extra.get("resumed_from", 0))  # the x axis of the plots counts earlier sessions too
    run.logger.log(event="eval", examples=seen, eval_ne=ev["ne"], auc=ev["auc"], bayes_ne=ev["bayes_ne"])
    run.logger.log(event="summary", **summary)
    run.logger.close()
    tmp = out / "summary.json.tmp"  # atomic: a reader never sees half a file
    tmp.write_text(json.dumps(json_safe(summary), indent=2, default=str) + "\n")
    os.replace(tmp, out / "summary.json")
    records = read_metrics(out / "metrics.jsonl") + [{"examples": seen, "eval_ne": ev["ne"]}]
    result = RunResult(name=name, summary=summary, records=records, out_dir=str(out), interrupted=interrupted)
    if cfg.checkpoint:
        result.checkpoint = str(_write_checkpoint(run, {r: results[r]["state"] for r in range(T)}, summary))
        if math.isfinite(best_eval) and ev["ne"] < best_eval:  # the end beats the curve: the last model is the best
            best = {**read_checkpoint(result.checkpoint), "name": "best eval", "eval": {
                "event": "eval", "examples": seen, "eval_ne": ev["ne"], "auc": ev["auc"],
                "calibration": ev["calibration"]}}
            write_checkpoint(out / BEST_NAME, best)
    if cfg.plot:
        run = {"name": name, "records": result.records,
               "bayes_ne": ev["bayes_ne"] if math.isfinite(ev["bayes_ne"]) else None}
        result.plot = plot_ne([run], out / "ne.png", title=f"{name}: NE vs examples")
    return result


def load_checkpoint_model(path: str | os.PathLike) -> tuple[Any, TrainConfig, DataConfig, dict]:
    """(model with the checkpoint's dense + embedding weights, its TrainConfig, DataConfig, raw checkpoint)."""
    p = Path(path)
    ckpt = read_checkpoint(p)
    cfg = config_from_dict(ckpt["config"])
    data, model_cfg = build_configs(cfg)
    emb = SharedEmbeddings.from_state_dict(ckpt["embeddings"])
    model = build_model(data, model_cfg, emb)
    missing, unexpected = model.load_state_dict(ckpt["dense"], strict=False)
    if unexpected or [k for k in missing if not k.startswith("embeddings.")]:
        raise ValueError(f"checkpoint {str(p)!r} does not match the model: missing {missing}, unexpected {unexpected}")
    return model, cfg, data, ckpt
