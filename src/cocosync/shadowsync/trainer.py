"""ShadowSync trainers on one machine: T trainer processes x W Hogwild worker threads, shared embeddings,
and one dense synchronization per trainer (shadow thread, foreground every k iterations, or none).

`Trainer` is one trainer process: `train_step(batch)` is one lock-free Hogwild iteration (dense replica +
shared embedding rows), `train()` runs the W workers over this trainer's shards and the sync of its replica.
`run_training(cfg)` is the launcher: it creates the shared state in the parent (embeddings, EASGD center,
counters; all `share_memory_()` tensors, which under torch's file-descriptor strategy never have a name in
/dev/shm), spawns the trainers, shows progress, writes JSON-lines metrics, handles Ctrl-C (first: stop and
keep what was measured; second: abort), turns a dead trainer into a `TrainerFailure` naming it, then scores
the final model on the held-out set and writes summary.json, checkpoint.pt and the NE plot.

Workers are threads (not processes): torch ops release the GIL, and on this 2-core machine T=2 trainers
already fill the cores; see the README for the measurement.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from .config import DataConfig, ModelConfig
from .embeddings import SharedEmbeddings
from .sync import FlatParams, ShadowThread, make_sync
from .train_config import ConfigError, TrainConfig, config_to_dict

__all__ = ["Trainer", "TrainerFailure", "RunResult", "SharedState", "run_training", "build_configs",
           "make_source", "eval_batches", "load_checkpoint_model", "json_safe"]


def json_safe(obj: Any) -> Any:
    """`obj` with NaN/inf floats replaced by None (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


class TrainerFailure(RuntimeError):
    """A trainer process raised, died, or the run timed out; the message names the trainer and the cause."""


# ---------------------------------------------------------------------------------------------- configs
def build_configs(cfg: TrainConfig) -> tuple[DataConfig, ModelConfig]:
    """DataConfig and ModelConfig of a run (TrainConfig fields + the `data_options` / `model` overrides)."""
    try:
        data_kw = {"batch_size": cfg.batch_size, "seed": cfg.seed, "eval_rows": cfg.eval_examples,
                   "train_rows": cfg.examples, **cfg.data_options}
        if cfg.data != "synthetic":
            data_kw.setdefault("train_path", cfg.data)
        data = DataConfig(**data_kw)
        model_kw = {"seed": cfg.seed, **cfg.model}
        for k in ("bottom_mlp", "top_mlp"):
            if isinstance(model_kw.get(k), list):
                model_kw[k] = tuple(model_kw[k])
        model = ModelConfig(**model_kw)
    except TypeError as e:
        raise ConfigError(f"bad data_options/model override: {e}") from None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return data, model


# ---------------------------------------------------------------------------------------------- data
class InMemorySource:
    """A synthetic training set held in (shared) tensors; shard s of S is the s-th contiguous block."""

    def __init__(self, dataset: Any):
        self.dense, self.sparse, self.label, self.prob = dataset.dense, dataset.sparse, dataset.label, dataset.prob
        self.rows = int(self.label.shape[0])

    def share_memory_(self) -> "InMemorySource":
        for t in (self.dense, self.sparse, self.label, self.prob):
            if t is not None:
                t.share_memory_()
        return self

    def shard_rows(self, shard: int, shards: int) -> int:
        return (shard + 1) * self.rows // shards - shard * self.rows // shards

    def batches(self, shard: int, shards: int, batch_size: int, start: int = 0) -> Iterator[Any]:
        from .data.criteo import Batch

        lo, hi = shard * self.rows // shards, (shard + 1) * self.rows // shards
        for i in range(lo + start, hi, batch_size):
            s = slice(i, min(i + batch_size, hi))
            yield Batch(self.dense[s], self.sparse[s], self.label[s], None if self.prob is None else self.prob[s])


class FileSource:
    """Criteo-format file(s) read by `CriteoReader`, shard s of S interleaved, `examples // S` rows each."""

    def __init__(self, data: DataConfig, examples: int):
        self.data, self.rows = data, examples

    def shard_rows(self, shard: int, shards: int) -> int:
        return self.rows // shards

    def batches(self, shard: int, shards: int, batch_size: int, start: int = 0) -> Iterator[Any]:
        from .data.criteo import CriteoReader

        n = self.shard_rows(shard, shards)
        yield from CriteoReader(self.data.train_path, self.data, shard=(shard, shards), batch_size=batch_size,
                                skip_rows=start, max_rows=max(0, n - start))


def make_source(cfg: TrainConfig, data: DataConfig) -> InMemorySource | FileSource:
    if data.train_path is None:
        from .data.synth import TRAIN, make_synthetic_dataset

        return InMemorySource(make_synthetic_dataset(cfg.examples, data.seed, data, split=TRAIN))
    return FileSource(data, cfg.examples)


def eval_batches(cfg: TrainConfig, data: DataConfig) -> list[Any]:
    """The held-out set: a synthetic draw from another stream, `eval_path`, or the rows of PATH after the
    training budget."""
    if data.train_path is None and data.eval_path is None:
        from .data.synth import EVAL, make_synthetic_dataset

        return list(make_synthetic_dataset(data.eval_rows, data.seed, data, split=EVAL).batches(4096))
    from .data.criteo import CriteoReader

    if data.eval_path is not None:
        reader = CriteoReader(data.eval_path, data, batch_size=4096, max_rows=data.eval_rows)
    else:
        reader = CriteoReader(data.train_path, data, batch_size=4096, skip_rows=cfg.examples, max_rows=data.eval_rows)
    out = list(reader)
    if not out:
        raise ConfigError(f"no held-out examples: {data.train_path!r} has no rows after the first "
                          f"{cfg.examples} (set data_options.eval_path or lower examples)")
    return out


# ---------------------------------------------------------------------------------------------- shared state
@dataclass
class SharedState:
    """What the parent shares with every trainer (all shared-memory tensors, created before spawning)."""

    embeddings: SharedEmbeddings
    center: torch.Tensor | None  # EASGD central copy of the dense parameters
    positions: torch.Tensor  # int64 [T, W]: rows consumed by each worker shard (the reader position)
    iterations: torch.Tensor  # int64 [T]: worker iterations of each trainer
    syncs: torch.Tensor  # int64 [T]: syncs of each trainer
    stop: torch.Tensor  # int32 [1]: set by the parent (Ctrl-C, failure) -> trainers finish now
    go: torch.Tensor  # int32 [1]: set by the parent once every trainer is built -> all start together
    init_dense: torch.Tensor  # the common starting point of every dense replica (fresh init or a checkpoint)

    @classmethod
    def create(cls, cfg: TrainConfig, embeddings: SharedEmbeddings, init_flat: torch.Tensor) -> "SharedState":
        T, W = cfg.trainers, cfg.workers
        center = init_flat.clone().share_memory_() if cfg.sync.method == "easgd" else None
        return cls(embeddings.share_memory_(), center, torch.zeros(T, W, dtype=torch.int64).share_memory_(),
                   torch.zeros(T, dtype=torch.int64).share_memory_(), torch.zeros(T, dtype=torch.int64).share_memory_(),
                   torch.zeros(1, dtype=torch.int32).share_memory_(), torch.zeros(1, dtype=torch.int32).share_memory_(),
                   init_flat.clone().share_memory_())


def _new_embeddings(cfg: TrainConfig, data: DataConfig, model: ModelConfig) -> SharedEmbeddings:
    return SharedEmbeddings(data.table_sizes, model.embedding_dim, optimizer=cfg.embedding_optimizer,
                            lr=cfg.embedding_lr, init_std=model.embedding_init_std, seed=model.seed)


def _build_model(data: DataConfig, model: ModelConfig, embeddings: SharedEmbeddings):
    from .model import DLRM

    return DLRM(model, data, embedding_weights=embeddings.tables, sparse=True)


# ---------------------------------------------------------------------------------------------- trainer
class Trainer:
    """One trainer: a dense replica updated by W Hogwild worker threads, synced by `cfg.sync`."""

    def __init__(self, cfg: TrainConfig, rank: int, state: SharedState, source: Any, *,
                 group: Any = None, emit: Callable[[dict], None] = lambda rec: None):
        self.cfg, self.rank, self.state, self.source, self.emit = cfg, rank, state, source, emit
        self.data, self.model_cfg = build_configs(cfg)
        self.model = _build_model(self.data, self.model_cfg, state.embeddings)
        self.dense = self.model.dense_parameters()
        self.emb_params = self.model.embedding_parameters()
        self.flat = FlatParams(self.dense)
        self.flat.flat.copy_(state.init_dense)  # every replica starts from the same point
        self.accumulator = torch.zeros_like(self.flat.flat)  # dense Adagrad state (local to the trainer)
        self.sync = make_sync(self.flat.flat, cfg.sync, center=state.center, group=group)
        self._counter = itertools.count(1)
        self._sync_lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        self._loss = np.zeros(cfg.window)
        self._ctr = np.zeros(cfg.window)
        self._n = np.zeros(cfg.window)
        self._slot = 0
        self.examples = 0
        self.active_syncs = 0
        self.errors: list[str] = []

    # -- one Hogwild iteration ----------------------------------------------------------------------------
    def train_step(self, batch: Any) -> float:
        """Forward, backward, and lock-free updates of the dense replica and the shared embedding rows."""
        logits = self.model(batch.dense, batch.sparse)
        loss = F.binary_cross_entropy_with_logits(logits, batch.label)
        grads = torch.autograd.grad(loss, self.dense + self.emb_params)
        with torch.no_grad():
            g = self.flat.flatten_grads(grads[:len(self.dense)])
            if self.cfg.dense_optimizer == "adagrad":
                self.accumulator.addcmul_(g, g)
                self.flat.flat.addcdiv_(g, self.accumulator.sqrt().add_(1e-8), value=-self.cfg.dense_lr)
            else:
                self.flat.flat.add_(g, alpha=-self.cfg.dense_lr)
        self.state.embeddings.apply_grads(list(grads[len(self.dense):]))
        value = float(loss.detach())
        n = len(batch)
        with self._metrics_lock:
            i = self._slot % self.cfg.window
            self._loss[i], self._ctr[i], self._n[i] = value * n, float(batch.label.sum()), n
            self._slot += 1
            self.examples += n
        return value

    def window_ne(self) -> float:
        """NE of the last `window` batches (log loss over the entropy of their click rate)."""
        with self._metrics_lock:
            n = self._n.sum()
            if n == 0:
                return float("nan")
            p = self._ctr.sum() / n
            if not 0 < p < 1:
                return float("nan")
            return float(self._loss.sum() / n / -(p * math.log(p) + (1 - p) * math.log(1 - p)))

    # -- the W workers + sync ------------------------------------------------------------------------------
    def _worker(self, w: int) -> None:
        shards = self.cfg.trainers * self.cfg.workers
        shard = self.rank * self.cfg.workers + w
        pos = self.state.positions[self.rank]
        fr = self.cfg.sync.mode == "foreground"
        try:
            for batch in self.source.batches(shard, shards, self.cfg.batch_size, int(pos[w])):
                if self.state.stop[0] or self.errors:
                    break
                self.train_step(batch)
                pos[w] += len(batch)
                it = next(self._counter)
                self.state.iterations[self.rank] = it
                if fr and it % self.cfg.sync.every == 0:
                    with self._sync_lock:
                        self.sync.sync(True)
                        self.active_syncs += 1
                        self.state.syncs[self.rank] += 1
        except BaseException:
            self.errors.append(f"trainer {self.rank} worker {w}:\n{traceback.format_exc()}")

    def train(self) -> dict:
        """Run the workers to the end of this trainer's data (or a stop), finish the sync protocol, and return
        this trainer's measurements and final dense parameters."""
        W = self.cfg.workers
        workers = [threading.Thread(target=self._worker, args=(w,), name=f"worker{w}", daemon=True) for w in range(W)]
        done = threading.Event()
        shadow = None
        if self.cfg.sync.mode == "shadow":
            def on_active() -> bool:
                return not done.is_set()

            shadow = ShadowThread(self.sync, interval=self.cfg.sync.interval, is_active=on_active,
                                  iterations=lambda: int(self.state.iterations[self.rank]))
        t0, cpu0 = time.time(), time.process_time()
        for t in workers:
            t.start()
        if shadow is not None:
            shadow.start()
        last_log = time.time()
        while any(t.is_alive() for t in workers):
            for t in workers:
                t.join(timeout=0.05)
            if shadow is not None:
                self.state.syncs[self.rank] = self.sync.syncs
                if shadow.error is not None:
                    self.errors.append(f"trainer {self.rank} shadow sync: {shadow.error!r}")
                    self.state.stop[0] = 1
            if time.time() - last_log >= self.cfg.log_every:
                last_log = time.time()
                self._log(t0)
        t_end, cpu_end = time.time(), time.process_time()
        done.set()
        if self.errors:
            if shadow is not None:
                shadow.abort()
            raise TrainerFailure("\n".join(self.errors))
        if shadow is not None:  # keeps joining collectives until every trainer is done
            while not shadow.join(timeout=1.0):
                pass
            if shadow.error is not None:
                raise TrainerFailure(f"trainer {self.rank} shadow sync failed: {shadow.error!r}")
            self.active_syncs = shadow.active_syncs
        elif self.sync.collective:
            while self.sync.sync(False) != 0:
                pass
        iterations = int(self.state.iterations[self.rank])
        self.state.syncs[self.rank] = self.sync.syncs
        self._log(t0)
        return {
            "trainer": self.rank, "examples": self.examples, "iterations": iterations,
            "seconds": t_end - t0, "start": t0, "end": t_end, "cpu_seconds": cpu_end - cpu0, "syncs": self.sync.syncs,
            "active_syncs": self.active_syncs,
            "sync_gap": iterations / self.active_syncs if self.active_syncs else float("nan"),
            "train_ne": self.window_ne(), "dense": self.flat.flat.numpy().copy(),
        }

    def _log(self, t0: float) -> None:
        elapsed = max(time.time() - t0, 1e-9)
        self.emit({"kind": "train", "trainer": self.rank, "trainer_examples": self.examples,
                   "train_ne": self.window_ne(), "trainer_eps": self.examples / elapsed,
                   "syncs": self.sync.syncs})


# ---------------------------------------------------------------------------------------------- process side
def _die_with_parent() -> None:
    try:  # Linux: SIGKILL this trainer if the launcher dies, so no orphan survives a killed run
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _trainer_main(rank: int, cfg: TrainConfig, state: SharedState, source: Any, store_port: int | None,
                  conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns Ctrl-C and tells us through state.stop
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent()
    torch.set_num_threads(cfg.threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo between trainers stays on loopback
    group_ready = False
    try:
        group = None
        if store_port is not None:
            import datetime

            import torch.distributed as dist

            timeout = datetime.timedelta(seconds=min(cfg.timeout, 120))
            store = dist.TCPStore("127.0.0.1", store_port, cfg.trainers, False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.trainers, timeout=timeout)
            group_ready = True
        trainer = Trainer(cfg, rank, state, source, group=group, emit=conn.send)
        conn.send({"kind": "ready", "trainer": rank})
        while not state.go[0] and not state.stop[0]:  # start together: EPS is measured over a common window
            time.sleep(0.001)
        result = trainer.train()
        conn.send({"kind": "result", **result})
    except BaseException:
        try:
            conn.send({"kind": "error", "trainer": rank, "traceback": traceback.format_exc()})
        except OSError:
            pass
        conn.close()
        os._exit(1)  # do not wait on gloo/threads of a broken run
    finally:
        if group_ready:
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception:
                pass
    conn.close()


# ---------------------------------------------------------------------------------------------- launcher
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


class _Interrupts:
    """Counts SIGINTs: the first asks the trainers to stop, the second aborts."""

    def __init__(self) -> None:
        self.count = 0
        self.previous: Any = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count >= 3:
            raise KeyboardInterrupt


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


def run_training(cfg: TrainConfig, *, name: str | None = None, console: Any = None,
                 extra_summary: dict | None = None, resume: str | os.PathLike | None = None) -> RunResult:
    """Train T trainers x W workers as configured; returns the measurements (see module doc).

    `resume`: a checkpoint of a run with the same data, budget, T and W (e.g. one stopped by Ctrl-C):
    training restarts from its dense and embedding weights at its reader positions."""
    from rich.console import Console

    from .metrics import MetricsLogger

    console = console or Console(stderr=True)
    name = name or f"{cfg.sync.algorithm} T={cfg.trainers}"
    data, model_cfg = build_configs(cfg)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    source = make_source(cfg, data)
    if isinstance(source, InMemorySource):
        source.share_memory_()
    ckpt = _resume_checkpoint(resume, cfg) if resume is not None else None
    embeddings = _new_embeddings(cfg, data, model_cfg)
    if ckpt is not None:
        embeddings.weight.copy_(ckpt["embeddings"]["weight"])
        embeddings.accumulator.copy_(ckpt["embeddings"]["accumulator"])
    model = _build_model(data, model_cfg, embeddings)
    if ckpt is not None:
        model.load_state_dict(ckpt["dense"], strict=False)
    parent_flat = FlatParams(model.dense_parameters())
    state = SharedState.create(cfg, embeddings, parent_flat.flat)
    resumed_from = 0
    if ckpt is not None:
        state.positions.copy_(ckpt["positions"])
        resumed_from = int(ckpt["positions"].sum())
        extra_summary = {**(extra_summary or {}), "resumed_from": resumed_from}
    T = cfg.trainers
    store = None
    if cfg.sync.method in ("ma", "bmuf") and T > 1:
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=120),
                              wait_for_workers=False)
    logger = MetricsLogger(out / "metrics.jsonl", append=ckpt is not None)
    logger.log(event="start", name=name, config=config_to_dict(cfg), resumed_from=resumed_from)
    ctx = mp.get_context("spawn")
    procs, conns = [], {}
    interrupts = _Interrupts()
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:  # children are spawned with SIGINT blocked and ignore it: the launcher owns Ctrl-C
        interrupts.previous = signal.signal(signal.SIGINT, interrupts)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for r in range(T):
            rd, wr = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_trainer_main, name=f"cocosync-trainer{r}", daemon=True,
                            args=(r, cfg, state, source, store.port if store else None, wr))
            p.start()
            wr.close()
            procs.append(p)
            conns[rd] = r
    finally:
        if main_thread:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    results: dict[int, dict] = {}
    failures: list[str] = []
    latest: dict[int, dict] = {}
    t_start = t_launch = time.time()
    ready = 0
    try:
        with _progress(cfg, console) as bar:
            task = bar.add_task(name, total=cfg.examples, ne="-", eps="-") if bar else None
            while len(results) < T and not failures:
                if interrupts.count and not state.stop[0]:
                    state.stop[0] = 1
                    console.print("[yellow]Ctrl-C: stopping the trainers (Ctrl-C again to abort)...")
                if interrupts.count >= 2:
                    failures.append("aborted by a second Ctrl-C")
                    break
                if time.time() - t_launch > cfg.timeout:
                    failures.append(f"run timed out after {cfg.timeout:.0f}s (TrainConfig.timeout)")
                    break
                for c in wait(list(conns), timeout=0.2):
                    r = conns[c]
                    try:
                        msg = c.recv()
                    except (EOFError, OSError):
                        del conns[c]
                        if r not in results:
                            procs[r].join(2)
                            failures.append(_describe_exit(r, procs[r]))
                        continue
                    if msg["kind"] == "train":
                        latest[r] = msg
                        total = resumed_from + sum(m["trainer_examples"] for m in latest.values())
                        nes = [m["train_ne"] for m in latest.values() if math.isfinite(m["train_ne"])]
                        rec = {"event": "train", "examples": total, "train_ne": float(np.mean(nes)) if nes else None,
                               "eps": total / max(time.time() - t_start, 1e-9), "trainer": r,
                               "trainer_examples": msg["trainer_examples"], "trainer_ne": msg["train_ne"],
                               "trainer_eps": msg["trainer_eps"], "syncs": msg["syncs"]}
                        logger.log(json_safe(rec))
                        if bar:
                            bar.update(task, completed=int(state.positions.sum()),
                                       ne=f"{rec['train_ne']:.4f}" if rec["train_ne"] else "-",
                                       eps=f"{rec['eps']:,.0f}")
                    elif msg["kind"] == "ready":
                        ready += 1
                        if ready == T:
                            state.go[0] = 1
                            t_start = time.time()
                    elif msg["kind"] == "result":
                        results[r] = msg
                    elif msg["kind"] == "error":
                        failures.append(f"trainer {r} raised:\n{msg['traceback']}")
                if bar:
                    bar.update(task, completed=int(state.positions.sum()))
    except KeyboardInterrupt:
        failures.append("aborted by Ctrl-C")
    finally:
        if failures:
            state.stop[0] = 1
        _stop_processes(procs, grace=3.0 if failures else 30.0)
        for c in conns:
            c.close()
        if main_thread:
            signal.signal(signal.SIGINT, interrupts.previous)
        if store is not None:
            del store
    if failures:
        logger.log(event="failed", error=failures[0])
        logger.close()
        raise TrainerFailure(f"training failed: {failures[0]}" +
                             (f"\n(and {len(failures) - 1} consequential error(s))" if len(failures) > 1 else ""))
    interrupted = bool(state.stop[0])
    return _finish(cfg, name, data, model, parent_flat, state, results, logger, out, interrupted,
                   [dict(r) for r in _records_of(out / "metrics.jsonl")], extra_summary or {})


def _resume_checkpoint(path: str | os.PathLike, cfg: TrainConfig) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"cannot resume: no checkpoint at {str(p)!r}")
    ckpt = torch.load(p, map_location="cpu", weights_only=False)
    old = ckpt["config"]
    for key in ("data", "examples", "trainers", "workers", "seed", "batch_size", "model", "data_options"):
        new = config_to_dict(cfg)[key]
        if old[key] != new:
            raise ConfigError(f"cannot resume {str(p)!r}: it was trained with {key}={old[key]!r}, this run has "
                              f"{key}={new!r} (the reader positions only mean something for the same data and shards)")
    if ckpt["embeddings"]["optimizer"] != cfg.embedding_optimizer:
        raise ConfigError(f"cannot resume {str(p)!r}: embedding_optimizer {ckpt['embeddings']['optimizer']!r} "
                          f"!= {cfg.embedding_optimizer!r}")
    return ckpt


def _records_of(path: Path) -> list[dict]:
    from .metrics import read_metrics

    return read_metrics(path)


class _NoBar:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _progress(cfg: TrainConfig, console: Any) -> Any:
    if not cfg.progress:
        return _NoBar()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("EPS {task.fields[eps]}"), TextColumn("train NE {task.fields[ne]}"),
                    TimeElapsedColumn(), console=console)


def _finish(cfg: TrainConfig, name: str, data: DataConfig, model: Any, flat: FlatParams, state: SharedState,
            results: dict[int, dict], logger: Any, out: Path, interrupted: bool, records: list[dict],
            extra: dict) -> RunResult:
    from .metrics import evaluate, plot_ne

    T = cfg.trainers
    final = state.center if state.center is not None else torch.from_numpy(results[0]["dense"])
    flat.flat.copy_(final)
    ev = evaluate(model, eval_batches(cfg, data))
    examples = sum(r["examples"] for r in results.values())
    seconds = max(r["end"] for r in results.values()) - min(r["start"] for r in results.values())
    gaps = [r["sync_gap"] for r in results.values() if math.isfinite(r["sync_gap"])]
    summary = {
        "name": name, "sync": cfg.sync.algorithm, "T": T, "W": cfg.workers, "examples": examples,
        "eps": examples / max(seconds, 1e-9),
        "eps_per_trainer": float(np.mean([r["examples"] / max(r["seconds"], 1e-9) for r in results.values()])),
        "eps_per_cpu": examples / max(sum(r["cpu_seconds"] for r in results.values()), 1e-9),
        "train_ne": float(np.nanmean([r["train_ne"] for r in results.values()])),
        "eval_ne": ev["ne"], "auc": ev["auc"], "bayes_ne": ev["bayes_ne"],
        "excess_ne": ev["ne"] - ev["bayes_ne"] if math.isfinite(ev["bayes_ne"]) else float("nan"),
        "sync_gap": float(np.mean(gaps)) if gaps else float("nan"),
        "syncs": int(sum(r["syncs"] for r in results.values())),
        "seconds": seconds, "interrupted": interrupted, **extra,
    }
    seen = examples + int(extra.get("resumed_from", 0))  # the x axis of the plots counts earlier sessions too
    logger.log(event="eval", examples=seen, eval_ne=ev["ne"], auc=ev["auc"], bayes_ne=ev["bayes_ne"])
    logger.log(event="summary", **summary)
    logger.close()
    (out / "summary.json").write_text(json.dumps(json_safe(summary), indent=2, default=str) + "\n")
    result = RunResult(name=name, summary=summary, records=records + [{"examples": seen, "eval_ne": ev["ne"]}],
                       out_dir=str(out), interrupted=interrupted)
    if cfg.checkpoint:
        ckpt = {
            "config": config_to_dict(cfg), "name": name,
            "dense": {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")},
            "embeddings": state.embeddings.state_dict(),
            "positions": state.positions.clone(), "shards": T * cfg.workers, "summary": summary,
        }
        tmp = out / "checkpoint.pt.tmp"
        torch.save(ckpt, tmp)
        os.replace(tmp, out / "checkpoint.pt")
        result.checkpoint = str(out / "checkpoint.pt")
    if cfg.plot:
        run = {"name": name, "records": result.records, "bayes_ne": ev["bayes_ne"] if math.isfinite(ev["bayes_ne"]) else None}
        result.plot = plot_ne([run], out / "ne.png", title=f"{name}: NE vs examples")
    return result


def load_checkpoint_model(path: str | os.PathLike) -> tuple[Any, TrainConfig, DataConfig, dict]:
    """(model with the checkpoint's dense + embedding weights, its TrainConfig, DataConfig, raw checkpoint)."""
    from .train_config import config_from_dict

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(p)!r} (a run writes <out_dir>/checkpoint.pt)")
    ckpt = torch.load(p, map_location="cpu", weights_only=False)
    cfg = config_from_dict(ckpt["config"])
    data, model_cfg = build_configs(cfg)
    emb = SharedEmbeddings.from_state_dict(ckpt["embeddings"])
    model = _build_model(data, model_cfg, emb)
    missing, unexpected = model.load_state_dict(ckpt["dense"], strict=False)
    if unexpected or [k for k in missing if not k.startswith("embeddings.")]:
        raise ValueError(f"checkpoint {str(p)!r} does not match the model: missing {missing}, unexpected {unexpected}")
    return model, cfg, data, ckpt
