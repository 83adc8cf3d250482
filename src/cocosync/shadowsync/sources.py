"""The data side of a run: DataConfig/ModelConfig from a TrainConfig, the training rows (in memory or streamed
from Criteo files, sharded among the trainers' workers) and the held-out set."""

from __future__ import annotations

from typing import Any, Iterator

from cocosync.shadowsync.config import DataConfig, ModelConfig
from cocosync.shadowsync.data.criteo import Batch, CriteoReader
from cocosync.shadowsync.data.synth import EVAL, TRAIN, SyntheticStream, make_synthetic_dataset
from cocosync.shadowsync.train_config import ConfigError, TrainConfig

__all__ = ["build_configs", "InMemorySource", "FileSource", "make_source", "trainer_source", "eval_batches"]


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


class InMemorySource:
    """A synthetic training set held in (shared) tensors; shard s of S is the s-th contiguous block.

    `offset`/`rows`: the tensors hold rows [offset, offset + len) of a data set of `rows` rows (a trainer that
    generated only its own shards); shards are numbered over the whole data set either way."""

    def __init__(self, dataset: Any, *, offset: int = 0, rows: int | None = None):
        self.dense, self.sparse, self.label, self.prob = dataset.dense, dataset.sparse, dataset.label, dataset.prob
        self.offset = offset
        self.rows = int(self.label.shape[0]) if rows is None else rows

    def share_memory_(self) -> "InMemorySource":
        for t in (self.dense, self.sparse, self.label, self.prob):
            if t is not None:
                t.share_memory_()
        return self

    def shard_rows(self, shard: int, shards: int) -> int:
        return (shard + 1) * self.rows // shards - shard * self.rows // shards

    def batches(self, shard: int, shards: int, batch_size: int, start: int = 0) -> Iterator[Any]:
        lo, hi = shard * self.rows // shards, (shard + 1) * self.rows // shards
        if lo < self.offset or hi - self.offset > self.label.shape[0]:
            raise ValueError(f"shard {shard} of {shards} (rows {lo}..{hi}) is not in this source's rows "
                             f"{self.offset}..{self.offset + self.label.shape[0]}")
        for i in range(lo + start - self.offset, hi - self.offset, batch_size):
            s = slice(i, min(i + batch_size, hi - self.offset))
            yield Batch(self.dense[s], self.sparse[s], self.label[s], None if self.prob is None else self.prob[s])


class FileSource:
    """Criteo-format file(s) read by `CriteoReader`, shard s of S interleaved, `examples // S` rows each."""

    def __init__(self, data: DataConfig, examples: int):
        self.data, self.rows = data, examples

    def shard_rows(self, shard: int, shards: int) -> int:
        return self.rows // shards

    def batches(self, shard: int, shards: int, batch_size: int, start: int = 0) -> Iterator[Any]:
        n = self.shard_rows(shard, shards)
        yield from CriteoReader(self.data.train_path, self.data, shard=(shard, shards), batch_size=batch_size,
                                skip_rows=start, max_rows=max(0, n - start))


def make_source(cfg: TrainConfig, data: DataConfig) -> InMemorySource | FileSource:
    if data.train_path is None:
        return InMemorySource(make_synthetic_dataset(cfg.examples, data.seed, data, split=TRAIN))
    return FileSource(data, cfg.examples)


def trainer_source(cfg: TrainConfig, data: DataConfig, trainer: int) -> InMemorySource | FileSource:
    """The training rows of one trainer only (its W shards of T*W): a synthetic trainer generates just those rows,
    the same ones `make_source` would give it."""
    if data.train_path is not None:
        return FileSource(data, cfg.examples)
    shards = cfg.trainers * cfg.workers
    lo = trainer * cfg.workers * cfg.examples // shards
    hi = (trainer + 1) * cfg.workers * cfg.examples // shards
    stream = SyntheticStream(data, seed=data.seed, split=TRAIN, rows=cfg.examples, batch_size=hi - lo, skip_rows=lo,
                             max_rows=hi - lo)
    b = next(iter(stream))
    return InMemorySource(b, offset=lo, rows=cfg.examples)


def eval_batches(cfg: TrainConfig, data: DataConfig) -> list[Any]:
    """The held-out set: a synthetic draw from another stream, `eval_path`, or the rows of PATH after the
    training budget."""
    if data.train_path is None and data.eval_path is None:
        return list(make_synthetic_dataset(data.eval_rows, data.seed, data, split=EVAL).batches(4096))
    if data.eval_path is not None:
        reader = CriteoReader(data.eval_path, data, batch_size=4096, max_rows=data.eval_rows)
    else:
        reader = CriteoReader(data.train_path, data, batch_size=4096, skip_rows=cfg.examples, max_rows=data.eval_rows)
    out = list(reader)
    if not out:
        raise ConfigError(f"no held-out examples: {data.train_path!r} has no rows after the first "
                          f"{cfg.examples} (set data_options.eval_path or lower examples)")
    return out
