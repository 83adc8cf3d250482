"""The data side of a run: DataConfig/ModelConfig from a TrainConfig, the training rows (in memory or streamed
from Criteo files, sharded among the trainers' workers) and the held-out set."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterator

from cocosync.shadowsync.config import ConfigError, DataConfig, ModelConfig, TrainConfig
from cocosync.shadowsync.data.criteo import Batch, CriteoFormatError, CriteoReader
from cocosync.shadowsync.data.plan import DataPlan, PlannedSource
from cocosync.shadowsync.data.ranges import even_share, even_start, filled_shares, range_lines
from cocosync.shadowsync.data.synth import EVAL, TRAIN, SyntheticStream, make_synthetic_dataset
from cocosync.shadowsync.data.tabular import TabularError, TabularReader, TabularSchema, data_format, infer_schema
from cocosync.shadowsync.model.inputs import Feature, ModelInputs

__all__ = ["build_configs", "model_inputs", "with_schema", "tabular_schema", "open_reader", "with_init_ctr",
           "estimate_ctr", "InMemorySource", "FileSource", "Epochs", "make_source", "base_shard_rows", "trainer_source",
           "eval_batches", "first_sparse"]


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


@functools.lru_cache(maxsize=8)
def _filled(rows: int, lines: tuple[int, ...]) -> tuple[int, ...]:
    """`filled_shares`, once per budget and line counts (every shard's rows are asked for, shard by shard)."""
    return tuple(filled_shares(rows, list(lines)))


def with_range_lines(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with the lines of each reader shard's byte range counted (DataConfig.range_lines, for trainers x workers
    shards) where its training file is split by bytes; one pass over the file at memory speed. The launcher counts
    them for a fresh run; a resumed one keeps its run's."""
    data, _ = build_configs(cfg)
    if data.train_path is None or data.reader_split != "bytes":
        return cfg
    paths = list(data.train_path) if isinstance(data.train_path, tuple) else [data.train_path]
    if any(data_format(p) != "criteo" for p in paths):  # (Parquet shards take contiguous rows: no lines to count)
        return cfg
    lines = range_lines(paths, cfg.trainers * cfg.workers)
    return dataclasses.replace(cfg, data_options={**cfg.data_options, "range_lines": lines})


def tabular_schema(data: DataConfig) -> TabularSchema | None:
    """The schema of a Parquet/CSV run (None: Criteo-format or synthetic data)."""
    return TabularSchema.from_dict(data.schema) if data.schema is not None else None


def model_inputs(cfg: TrainConfig, data: DataConfig, model_cfg: ModelConfig) -> ModelInputs:
    """What the run's model is built for: the data's dense columns and categorical features (a Parquet/CSV file's
    schema; Criteo layout: I1..In and C1..Cm, each hashed into its table's rows)."""
    schema = tabular_schema(data)
    if schema is not None:
        return ModelInputs(tuple(d.name for d in schema.dense),
                           tuple(Feature(f.name, f.rows, f.multi_valued) for f in schema.features), model_cfg)
    features = tuple(Feature(f"C{i + 1}", rows) for i, rows in enumerate(data.table_sizes))
    return ModelInputs(tuple(f"I{i + 1}" for i in range(data.num_dense)), features, model_cfg)


def with_schema(cfg: TrainConfig) -> TrainConfig:
    """cfg with the schema of its Parquet/CSV data (`data_options.schema`) found from the file when not given, so
    that every rank, the saved config and a later scoring read the file alike; cfg itself for other data."""
    if cfg.data == "synthetic" or data_format(cfg.data) == "criteo" or "schema" in cfg.data_options:
        return cfg
    data, _ = build_configs(cfg)
    table_size = cfg.data_options.get("table_size")
    try:
        schema = infer_schema(cfg.data, label=data.label_column, categorical=data.categorical_columns,
                              list_columns=data.list_columns, dense=data.dense_columns,
                              dense_transform=data.dense_transform, max_table_rows=data.max_table_rows,
                              table_size=table_size if table_size is not None else None)
    except TabularError as e:
        raise ConfigError(str(e)) from None
    return dataclasses.replace(cfg, data_options={**cfg.data_options, "schema": schema.to_dict()})


def open_reader(paths: Any, data: DataConfig, **kw: Any) -> Any:
    """A reader of `paths` in the run's format: TabularReader for a Parquet/CSV run, else CriteoReader (keywords:
    shard, batch_size, skip_rows, max_rows, split)."""
    schema = tabular_schema(data)
    if schema is None:
        return CriteoReader(paths, data, **kw)
    kw.pop("split", None)
    kw.setdefault("batch_size", data.batch_size)
    return TabularReader(paths, schema, **kw)


def estimate_ctr(data: DataConfig, rows: int = 100_000) -> float:
    """The click rate of the first `rows` training rows (of the budget), or the synthetic teacher's."""
    if data.train_path is None:
        return data.synth.ctr
    clicks = seen = 0
    try:
        for b in open_reader(data.train_path, data, batch_size=8192, max_rows=min(rows, data.train_rows or rows)):
            clicks, seen = clicks + float(b.label.sum()), seen + len(b)
    except (CriteoFormatError, TabularError) as e:  # found before any process starts: one line, not a traceback
        raise ConfigError(f"data={data.train_path!r} cannot be trained on: {e}") from None
    if not seen:
        raise ConfigError(f"{data.train_path!r} has no readable training rows")
    return min(max(clicks / seen, 1e-4), 1 - 1e-4)


def with_init_ctr(cfg: TrainConfig) -> TrainConfig:
    """cfg with `model.init_ctr` (the output bias starts at its logit) estimated from the data when not given, as
    dlrm and TorchRec users expect of a data set whose click rate is not Criteo's; given or estimated once here,
    the run's saved config carries the value."""
    if "init_ctr" in cfg.model:
        return cfg
    data, _ = build_configs(cfg)
    return dataclasses.replace(cfg, model={**cfg.model, "init_ctr": round(estimate_ctr(data), 6)})


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


class StreamedSource:
    """The synthetic training set generated as it is read, the same rows as `InMemorySource` holds: shard s of S
    streams its rows from where its reader starts. A trainer that joins a running job trains at once this way, where
    generating its whole share first took seconds (the rows cost the same CPU, spread over its training)."""

    def __init__(self, data: DataConfig, rows: int):
        self.data, self.rows = data, rows

    def shard_rows(self, shard: int, shards: int) -> int:
        return (shard + 1) * self.rows // shards - shard * self.rows // shards

    def batches(self, shard: int, shards: int, batch_size: int, start: int = 0) -> Iterator[Any]:
        lo, hi = shard * self.rows // shards, (shard + 1) * self.rows // shards
        if lo + start >= hi:
            return iter(())
        return iter(SyntheticStream(self.data, seed=self.data.seed, split=TRAIN, rows=self.rows,
                                    batch_size=batch_size, skip_rows=lo + start, max_rows=hi - lo - start))


class FileSource:
    """Data file(s) read by `CriteoReader` or `TabularReader`, `examples` rows over S shards: shard s reads its
    line-aligned byte range of each file (its rows as counted by the launcher, `DataConfig.range_lines`: a range
    holding fewer lines than its share leaves the rest to the others), every S-th line from line s, or (Parquet) a
    contiguous range of rows; together the shards read every row of the budget once."""

    def __init__(self, data: DataConfig, examples: int):
        self.data, self.rows = data, examples

    def shard_rows(self, shard: int, shards: int) -> int:
        lines = self.data.range_lines
        if self.data.reader_split == "bytes" and lines is not None and len(lines) == shards:
            return _filled(self.rows, tuple(lines))[shard]
        return even_share(self.rows, shards, shard)

    def batches(self, shard: int, shards: int, batch_size: int, start: int = 0) -> Iterator[Any]:
        n = self.shard_rows(shard, shards)
        lo = even_start(self.rows, shards, shard)
        extra = {"row_range": (lo, lo + n)} if tabular_schema(self.data) is not None else {}
        yield from open_reader(self.data.train_path, self.data, shard=(shard, shards), batch_size=batch_size,
                               skip_rows=start, max_rows=max(0, n - start), split=self.data.reader_split, **extra)


class Epochs:
    """`epochs` passes over a source (dlrm's and TorchRec's --epochs): each shard reads its rows that many times in
    the same order; a reader position counts rows over all passes, so checkpoints resume inside any pass."""

    def __init__(self, inner: InMemorySource | FileSource | StreamedSource, epochs: int):
        self.inner, self.epochs = inner, epochs

    def share_memory_(self) -> "Epochs":
        if isinstance(self.inner, InMemorySource):
            self.inner.share_memory_()
        return self

    def shard_rows(self, shard: int, shards: int) -> int:
        return self.epochs * self.inner.shard_rows(shard, shards)

    def batches(self, shard: int, shards: int, batch_size: int, start: int = 0) -> Iterator[Any]:
        n = self.inner.shard_rows(shard, shards)
        for epoch in range(start // n if n else self.epochs, self.epochs):
            yield from self.inner.batches(shard, shards, batch_size, max(0, start - epoch * n))


def _passes(source: InMemorySource | FileSource | StreamedSource, cfg: TrainConfig) -> Any:
    return source if cfg.epochs == 1 else Epochs(source, cfg.epochs)


def make_source(cfg: TrainConfig, data: DataConfig) -> Any:
    if data.train_path is None:
        return _passes(InMemorySource(make_synthetic_dataset(cfg.examples, data.seed, data, split=TRAIN)), cfg)
    return _passes(FileSource(data, cfg.examples), cfg)


def base_shard_rows(cfg: TrainConfig, data: DataConfig, shard: int, shards: int) -> int:
    """Rows shard `shard` of `shards` of the run's training source holds (all passes), without building it."""
    if data.train_path is not None:
        return cfg.epochs * FileSource(data, cfg.examples).shard_rows(shard, shards)
    return cfg.epochs * ((shard + 1) * cfg.examples // shards - shard * cfg.examples // shards)


def trainer_source(cfg: TrainConfig, data: DataConfig, trainer: int, plan: DataPlan | None = None, *,
                   streamed: bool = False) -> Any:
    """The training rows of one trainer only (its W shards of T*W): a synthetic trainer generates just those rows,
    the same ones `make_source` would give it. `plan`: the job resumed on another trainer count reads its shards'
    segments of the original sharding (data/plan.py); a synthetic trainer generates the base shards they touch.
    `streamed`: synthetic rows are generated as they are read (`StreamedSource`), not all before training."""
    W = cfg.workers
    if streamed and data.train_path is None:
        base = _passes(StreamedSource(data, cfg.examples), cfg)
        return base if plan is None else PlannedSource(base, plan.base_shards, plan.shards)
    if plan is None:
        shards, mine = cfg.trainers * W, range(trainer * W, (trainer + 1) * W)
    else:
        shards = plan.base_shards
        mine = sorted({b for s in range(trainer * W, (trainer + 1) * W) for b, _, _ in plan.shards[s]})
    if data.train_path is not None:
        base = _passes(FileSource(data, cfg.examples), cfg)
    elif not mine:  # a resumed trainer with nothing left to read
        base = None
    else:
        lo, hi = mine[0] * cfg.examples // shards, (mine[-1] + 1) * cfg.examples // shards
        stream = SyntheticStream(data, seed=data.seed, split=TRAIN, rows=cfg.examples, batch_size=hi - lo,
                                 skip_rows=lo, max_rows=hi - lo)
        base = _passes(InMemorySource(next(iter(stream)), offset=lo, rows=cfg.examples), cfg)
    return base if plan is None else PlannedSource(base, plan.base_shards, plan.shards)


def first_sparse(cfg: TrainConfig, data: DataConfig, rows: int) -> Any:
    """The sparse ids [n, tables] of the first `rows` training rows (fewer if the budget or the file has fewer)."""
    n = max(1, min(rows, cfg.examples))
    if data.train_path is not None:
        got = [b.sparse for b in open_reader(data.train_path, data, batch_size=n, max_rows=n)]
        return got[0] if got else None
    return next(iter(SyntheticStream(data, seed=data.seed, split=TRAIN, rows=cfg.examples, batch_size=n,
                                     max_rows=n))).sparse


def eval_batches(cfg: TrainConfig, data: DataConfig) -> list[Any]:
    """The held-out set: a synthetic draw from another stream, `eval_path`, or the rows of PATH after the
    training budget."""
    if data.train_path is None and data.eval_path is None:
        return list(make_synthetic_dataset(data.eval_rows, data.seed, data, split=EVAL).batches(4096))
    if data.eval_path is not None:
        reader = open_reader(data.eval_path, data, batch_size=4096, max_rows=data.eval_rows)
    else:
        reader = open_reader(data.train_path, data, batch_size=4096, skip_rows=cfg.examples, max_rows=data.eval_rows)
    out = list(reader)
    if not out:
        raise ConfigError(f"no held-out examples: {data.train_path!r} has no rows after the first "
                          f"{cfg.examples} (set data_options.eval_path or lower examples)")
    return out
