"""ShadowSync trainers on one machine: T trainer processes x W Hogwild worker threads, shared embeddings,
and one dense synchronization per trainer (shadow thread, foreground every k iterations, or none).

`Trainer` is one trainer process: `train_step(batch)` is one lock-free Hogwild iteration (dense replica +
shared embedding rows), `train()` runs the W workers over this trainer's shards and the sync of its replica.
`launcher.run_training(cfg)` is the launcher: it creates the shared state in the parent (embeddings, EASGD center,
counters; all `share_memory_()` tensors, which under torch's file-descriptor strategy never have a name in
/dev/shm), spawns the trainers, shows progress, writes JSON-lines metrics, handles Ctrl-C (first: stop and
keep what was measured; second: abort), turns a dead trainer into a `TrainerFailure` naming it, then scores
the final model on the held-out set and writes summary.json, checkpoint.pt and the NE plot.

Workers are threads (not processes): torch ops release the GIL, and on this 2-core machine T=2 trainers
already fill the cores; see the README for the measurement.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from .config import DataConfig, ModelConfig
from .embeddings import SharedEmbeddings
from .sync import FlatParams, ShadowThread, make_sync
from .train_config import ConfigError, TrainConfig

__all__ = ["Trainer", "TrainerFailure", "SharedState", "build_configs", "make_source", "eval_batches", "json_safe"]


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
