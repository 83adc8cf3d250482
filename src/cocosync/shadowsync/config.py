"""The configuration of a ShadowSync job, in one place: every setting, its default, its check and its help text.

- `DataConfig` (with `SynthConfig`, the synthetic teacher): where examples come from and how rows become tensors;
- `ModelConfig`: the DLRM's sizes and initialization;
- `SyncConfig`: how the trainers' dense replicas are synchronized;
- `TrainConfig`: one run (data budget, trainers, workers, optimizers, outputs), with `sync` and the `model` and
  `data_options` overrides of the two above;
- `ClusterConfig`: how the run's processes are laid out and talk (servers, lookup transport, hot rows) and the
  session's checkpoint, eval and stop marks.

Each is a `@dataclass(kw_only=True, slots=True)` whose `__post_init__` raises `ConfigError` naming the bad field, its
value and what is allowed; each field's docstring is its documentation and its `--help` text. A field with `opt(...)`
metadata is a command-line option (cli/options.py generates the options from these classes); config files
(`load_train_config`: TOML, JSON, YAML) take the TrainConfig fields with the same nesting::

    trainers = 2
    examples = 200000
    [sync]
    algorithm = "shadow-bmuf"
    [model]
    embedding_dim = 16
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cocosync.shadowsync.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["ConfigError", "DataConfig", "SynthConfig", "ModelConfig", "SyncConfig", "TrainConfig", "ClusterConfig",
           "Opt", "opt", "load_train_config", "load_job_config", "read_config_file", "config_from_dict",
           "config_to_dict", "check_paths", "resume_value", "SYNC_ALGORITHMS", "COLLECTIVE_METHODS",
           "FOREGROUND_EVERY", "OPTIMIZERS", "TRANSPORTS", "EXCHANGES", "CRITEO_NUM_DENSE", "CRITEO_NUM_SPARSE",
           "UNLIMITED_WAIT", "NodeRange"]


@dataclass(frozen=True)
class Opt:
    """How a config field appears on the command line (cli/options.py builds the click option from it)."""

    flag: str  # the option's name, e.g. '--sync'; a bool field gets '--x/--no-x'
    section: str  # the heading it is listed under in --help
    short: str | None = None  # a one-letter alias, e.g. '-T'
    choices: tuple[str, ...] | None = None  # the values allowed
    scale: float = 1.0  # config value = typed value x scale (1e-3: typed in milliseconds, held in seconds)
    shown: str | None = None  # what --help shows as the default where the field's default is not it
    path: bool = False  # the value is a file path


def opt(flag: str, section: str, **kw: Any) -> dict[str, Opt]:
    """The field metadata that makes a config field a command-line option."""
    return {"opt": Opt(flag, section, **kw)}


CRITEO_NUM_DENSE = 13  # integer features I1..I13 of the Criteo Kaggle display-advertising data
CRITEO_NUM_SPARSE = 26  # hashed categorical features C1..C26


def _positive_int(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r}: expected a positive integer")


def _fraction(owner: str, name: str, value: object, *, lo: float = 0.0, hi: float = 1.0) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{owner}.{name}={value!r}: expected a number in [{lo}, {hi}]")


def _per_feature(owner: str, name: str, value: object, count: int, check) -> tuple:
    """Normalize a scalar-or-sequence field to a tuple of `count` values, each passing `check`."""
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * count
    if len(values) != count:
        raise ValueError(f"{owner}.{name} has {len(values)} entries: expected one per feature ({count})")
    for i, v in enumerate(values):
        check(owner, f"{name}[{i}]", v)
    return values


@dataclass(kw_only=True, slots=True)
class SynthConfig:
    """The hidden "teacher" that generates synthetic Criteo-format data with known click probabilities.

    logit = bias + sum_d a_d f_d(dense_d) + sum_t s_t e_t[c_t] + sum_(t,u) <U_t[c_t], V_u[c_u]> + dense_0 * w[c_2]
    where categories follow a Zipf law per feature; `bias` is calibrated so the mean click rate is `ctr`.
    """

    teacher_seed: int = 0
    """Seed of the hidden teacher (embeddings, weights, category strings). Train and eval sets share it."""
    num_dense: int = CRITEO_NUM_DENSE
    """Integer features per row."""
    num_sparse: int = CRITEO_NUM_SPARSE
    """Categorical features per row."""
    vocab_sizes: tuple[int, ...] | int = (
        3, 4, 6, 10, 16, 25, 40, 60, 100, 150, 250, 400, 600,
        1000, 1500, 2500, 30, 50, 80, 120, 200, 300, 500, 800, 1200, 3000,
    )
    """Distinct categories per categorical feature (one int, or one per feature). Keep them below the
    hash-table sizes so that hashing collisions stay rare and the Bayes NE stays reachable."""
    zipf_exponent: float = 1.1
    """Category frequency ~ 1 / (rank + 1) ** zipf_exponent (power law); 0 means uniform."""
    ctr: float = 0.04
    """Target mean click-through rate; the teacher's intercept is calibrated to it."""
    signal: float = 1.0
    """Multiplies every teacher weight: larger = more predictable clicks (lower Bayes NE)."""
    num_important: int = 8
    """Categorical features with a strong main effect (the smallest vocabularies first); the others are weak."""
    num_interactions: int = 4
    """Pairwise categorical interactions <U_t[c_t], V_u[c_u]> in the teacher logit."""
    interaction_dim: int = 4
    """Rank of each pairwise interaction."""
    dense_missing: float = 0.1
    """Probability that an integer feature is empty (missing)."""
    sparse_missing: float = 0.05
    """Probability that a categorical feature is empty (missing)."""

    def __post_init__(self) -> None:
        o = "SynthConfig"
        for name in ("num_dense", "num_sparse", "interaction_dim"):
            _positive_int(o, name, getattr(self, name))
        self.vocab_sizes = _per_feature(o, "vocab_sizes", self.vocab_sizes, self.num_sparse, _positive_int)
        _fraction(o, "zipf_exponent", self.zipf_exponent, hi=10.0)
        _fraction(o, "ctr", self.ctr, lo=1e-4, hi=0.5)
        _fraction(o, "signal", self.signal, hi=10.0)
        _fraction(o, "dense_missing", self.dense_missing, hi=0.99)
        _fraction(o, "sparse_missing", self.sparse_missing, hi=0.99)
        if not isinstance(self.num_important, int) or not 0 <= self.num_important <= self.num_sparse:
            raise ValueError(f"{o}.num_important={self.num_important!r}: expected an int in [0, {self.num_sparse}]")
        max_pairs = self.num_sparse * (self.num_sparse - 1) // 2
        if not isinstance(self.num_interactions, int) or not 0 <= self.num_interactions <= max_pairs:
            raise ValueError(f"{o}.num_interactions={self.num_interactions!r}: expected an int in [0, {max_pairs}]")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where examples come from and how rows become tensors (Criteo Kaggle format, or the synthetic teacher)."""

    num_dense: int = field(default=CRITEO_NUM_DENSE, metadata=opt("--num-dense", "Data"))
    """Integer features per row (columns 2..1+num_dense); log-transformed as log(1 + max(x, 0))."""
    num_sparse: int = field(default=CRITEO_NUM_SPARSE, metadata=opt("--num-sparse", "Data"))
    """Categorical features per row (the last num_sparse columns); hashed into their table."""
    table_size: int | tuple[int, ...] = field(default=10_000, metadata=opt("--table-size", "Model"))
    """Hash buckets per embedding table: one int for all tables, or one per categorical feature.
    Bucket 0 is reserved for a missing (empty) categorical; values hash into [1, size)."""
    batch_size: int = 256
    """Examples per batch, unless a reader is given its own batch_size."""
    max_bad_fraction: float = 0.1
    """A reader raises once more than this fraction of lines are malformed (after the first 1000 lines):
    a wrong file should fail loudly rather than train on nothing. Set 1.0 to only count and report."""
    train_path: str | tuple[str, ...] | None = None
    """Criteo-format training file(s) (.gz allowed); None = the embedded synthetic teacher (`synth`)."""
    eval_path: str | tuple[str, ...] | None = field(default=None, metadata=opt("--eval-data", "Data", path=True))
    """Held-out file(s) in the training data's format; unset: a synthetic held-out set drawn from the same teacher, or
    the training file's rows after the budget."""
    train_rows: int | None = None
    """Cap on training examples (per whole data set, before sharding); None = the whole file, or an
    endless synthetic stream."""
    eval_rows: int = 50_000
    """Held-out examples to evaluate on (a cap for files; the size of the synthetic held-out set)."""
    seed: int = 0
    """Sampling seed of the synthetic stream (the held-out set uses a different, derived stream)."""
    split: str = field(default="auto", metadata=opt("--data-split", "Data", choices=("auto", "bytes", "lines")))
    """How the workers share training files: 'bytes' (each reads only its line-aligned byte range; plain files, with
    held-out data given), 'lines' (interleaved lines; every reader scans the whole file; .gz works), 'auto' (bytes
    where it applies, else lines). With bytes a shard whose range holds fewer lines than its share of the budget ends
    a little early."""
    synth: SynthConfig = field(default_factory=SynthConfig)
    """The synthetic teacher, used where a path is None."""
    label_column: str | None = field(default=None, metadata=opt("--label", "Data", shown="label, click or target"))
    """Parquet/CSV: the label column (0/1)."""
    categorical_columns: tuple[str, ...] = field(default=(), metadata=opt("--categorical", "Data",
                                                                          shown="strings and *_id integers"))
    """Parquet/CSV: the categorical columns, comma-separated (hashed into their table's rows)."""
    list_columns: tuple[str, ...] = field(default=(), metadata=opt("--list-columns", "Data", shown="list-typed"))
    """Parquet/CSV: the columns holding lists of categorical values (a CSV cell joins them with '|')."""
    dense_columns: tuple[str, ...] = field(default=(), metadata=opt("--dense", "Data", shown="the other numbers"))
    """Parquet/CSV: the dense columns, comma-separated."""
    dense_transform: str = field(default="standardize", metadata=opt("--dense-transform", "Data"))
    """Parquet/CSV: the dense columns' transform, 'standardize', 'log' (sign(x) log(1 + |x|)) or 'none', for all or
    per column ('age=log,price=none'; the others standardize)."""
    max_table_rows: int = field(default=1 << 20, metadata=opt("--max-table-rows", "Model"))
    """Parquet/CSV: the most rows a table sized from the data gets (32 x its distinct values in the first 100k rows,
    rounded up to a power of two); --table-size sets the rows instead."""
    schema: dict | None = None
    """Parquet/CSV: the file's schema (TabularSchema.to_dict(): label, dense columns, features and their rows), found
    from the file when the run starts and kept in the run's config."""
    range_lines: tuple[int, ...] | None = None
    """split 'bytes': the lines in each reader shard's byte range (data/ranges.py), counted by the launcher when the
    run starts and kept in the run's config, so that a range holding fewer lines than its share leaves the rest to
    the others and the run trains its whole budget."""

    def __post_init__(self) -> None:
        o = "DataConfig"
        for name in ("categorical_columns", "list_columns", "dense_columns"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = tuple(v.strip() for v in value.split(",") if v.strip())
            if isinstance(value, list):
                value = tuple(value)
            if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"{o}.{name}={value!r}: expected column names")
            setattr(self, name, value)
        _positive_int(o, "max_table_rows", self.max_table_rows)
        if self.schema is not None:
            if not isinstance(self.schema, dict) or not isinstance(self.schema.get("features"), list):
                raise ValueError(f"{o}.schema={self.schema!r}: expected a data schema table")
            self.num_dense = len(self.schema["dense"])
            self.num_sparse = len(self.schema["features"])
            self.table_size = tuple(int(f["rows"]) for f in self.schema["features"])
        for name in ("num_dense", "num_sparse", "batch_size", "eval_rows"):
            if not (name == "num_dense" and self.schema is not None and self.num_dense == 0):
                _positive_int(o, name, getattr(self, name))
        if self.train_rows is not None:
            _positive_int(o, "train_rows", self.train_rows)
        self.table_size = _per_feature(o, "table_size", self.table_size, self.num_sparse, _check_table_size)
        if len(set(self.table_size)) == 1:
            self.table_size = self.table_size[0]
        _fraction(o, "max_bad_fraction", self.max_bad_fraction)
        for name in ("train_path", "eval_path"):
            value = getattr(self, name)
            if isinstance(value, list):
                value = tuple(value)
                setattr(self, name, value)
            paths = value if isinstance(value, tuple) else (value,)
            if value is not None and (not paths or not all(isinstance(p, str) and p for p in paths)):
                raise ValueError(f"{o}.{name}={value!r}: expected None, a path, or a non-empty tuple of paths")
        if self.range_lines is not None:
            value = tuple(self.range_lines) if isinstance(self.range_lines, (list, tuple)) else None
            if not value or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value):
                raise ValueError(f"{o}.range_lines={self.range_lines!r}: expected line counts (non-negative "
                                 "integers), one per reader shard")
            self.range_lines = value
        if self.split not in ("auto", "lines", "bytes"):
            raise ValueError(f"{o}.split={self.split!r}: expected 'auto', 'lines' or 'bytes'")
        if self.split == "bytes" and self.train_path is not None:
            paths = self.train_path if isinstance(self.train_path, tuple) else (self.train_path,)
            if gz := [p for p in paths if p.endswith(".gz")]:
                raise ValueError(f"{o}.split='bytes': {gz[0]!r} is gzip and cannot be split by bytes (decompress it, "
                                 "or use split='lines')")
            if self.eval_path is None:
                raise ValueError(f"{o}.split='bytes' spreads each trainer's rows over the whole file, so its rows "
                                 "after the training budget are not held out; give the held-out data (--eval-data "
                                 "PATH, data_options.eval_path) or use split='lines'")
        if not isinstance(self.synth, SynthConfig):
            raise ValueError(f"{o}.synth={self.synth!r}: expected a SynthConfig")
        if self.train_path is None and (  # a file's held-out set defaults to its rows after the budget, not synthetic
            self.synth.num_dense != self.num_dense or self.synth.num_sparse != self.num_sparse
        ):
            raise ValueError(
                f"{o}: synthetic data has {self.synth.num_dense} dense / {self.synth.num_sparse} sparse features "
                f"but num_dense={self.num_dense}, num_sparse={self.num_sparse}; make them agree"
            )

    @property
    def reader_split(self) -> str:
        """The split the training readers use ('auto' resolved)."""
        if self.split != "auto":
            return self.split
        paths = self.train_path if isinstance(self.train_path, tuple) else (self.train_path,)
        plain = self.train_path is not None and not any(p.endswith(".gz") for p in paths)
        return "bytes" if plain and self.eval_path is not None else "lines"

    @property
    def table_sizes(self) -> tuple[int, ...]:
        """Hash buckets of each of the `num_sparse` tables."""
        ts = self.table_size
        return ts if isinstance(ts, tuple) else (ts,) * self.num_sparse


def _check_table_size(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise ValueError(f"{owner}.{name}={value!r}: expected an int >= 2 (bucket 0 is reserved for missing)")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """DLRM sizes: bottom MLP on dense features, one embedding table per categorical, dot interaction, top MLP."""

    embedding_dim: int = field(default=16, metadata=opt("--embedding-dim", "Model"))
    """Width of every embedding vector (and of the bottom MLP's output, which joins the interaction)."""
    bottom_mlp: tuple[int, ...] = field(default=(64, 16), metadata=opt("--bottom-mlp", "Model"))
    """Hidden widths of the bottom MLP (ReLU after each); the last must equal embedding_dim."""
    top_mlp: tuple[int, ...] = field(default=(64, 32), metadata=opt("--top-mlp", "Model"))
    """Hidden widths of the top MLP (ReLU after each); a final linear layer gives one logit."""
    sparse_gradients: bool = False
    """Embedding tables produce sparse gradients (torch.sparse), as Hogwild/sparse optimizers want."""
    embedding_init_std: float = 0.05
    """Embedding rows start N(0, std^2); dense layers start with PyTorch's default init."""
    init_ctr: float | None = field(
        default=0.04, metadata=opt("--init-ctr", "Model", shown="estimated from the data's first 100k rows"))
    """Start the output bias at logit(init_ctr) so that step 0 predicts a plausible click rate; None: 0. A run that does
    not set it estimates it from its data."""
    seed: int = 0
    """Initialization seed: every trainer built from the same config starts from the same weights."""

    def __post_init__(self) -> None:
        o = "ModelConfig"
        _positive_int(o, "embedding_dim", self.embedding_dim)
        for name in ("bottom_mlp", "top_mlp"):
            value = getattr(self, name)
            if isinstance(value, list):
                value = tuple(value)
                setattr(self, name, value)
            if not isinstance(value, tuple):
                raise ValueError(f"{o}.{name}={value!r}: expected a tuple of layer widths")
            for i, w in enumerate(value):
                _positive_int(o, f"{name}[{i}]", w)
        if not self.bottom_mlp or self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"{o}.bottom_mlp={self.bottom_mlp!r}: its last width must equal embedding_dim="
                f"{self.embedding_dim} (the bottom MLP output is dotted with the embeddings)"
            )
        _fraction(o, "embedding_init_std", self.embedding_init_std, hi=10.0)
        if self.init_ctr is not None:
            _fraction(o, "init_ctr", self.init_ctr, lo=1e-6, hi=1 - 1e-6)
        if not isinstance(self.seed, int):
            raise ValueError(f"{o}.seed={self.seed!r}: expected an int")


#: fr-*: worker iterations per sync when `every` is not set (the best measured at T=8; a sync every iteration lost
#: 1.2-1.9% NE). BMUF's block momentum grows with the block (`momentum_for`), so its best block is the longest.
FOREGROUND_EVERY = {"fr-bmuf": 8, "fr-ma": 4, "fr-easgd": 4}

#: every value accepted by `--sync` / `SyncConfig.algorithm`
SYNC_ALGORITHMS = ("shadow-bmuf", "shadow-ma", "shadow-easgd", "shadow-dssync", "fr-bmuf", "fr-ma", "fr-easgd",
                   "fr-dssync", "none")
#: the methods whose sync() is a collective every trainer joins (gloo among the trainers)
COLLECTIVE_METHODS = ("ma", "bmuf", "dssync")
OPTIMIZERS = ("adagrad", "sgd")
UNLIMITED_WAIT = 1800.0  # seconds a process group or store waits when the run has no timeout (torch's default)


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: expected {allowed}")


def _is_number(v: Any) -> bool:
    """A finite int or float (not a bool, not a string that looks like a number)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    """How each trainer's dense replica is synchronized with the others."""

    algorithm: str = field(default="shadow-bmuf", metadata=opt("--sync", "Sync", choices=SYNC_ALGORITHMS))
    """'shadow-*' syncs in a background thread, 'fr-*' every `every` worker iterations inside the training loop, 'none'
    never (independent trainers: the reference)."""
    every: int | None = field(default=None, metadata=opt("--sync-every", "Sync"))
    """fr-* only: sync after every this many worker iterations of the trainer (the paper's k); unset: fr-bmuf 8, fr-ma
    and fr-easgd 4 (FOREGROUND_EVERY, the best measured at T=8)."""
    interval: float = field(default=0.02, metadata=opt("--sync-interval", "Sync"))
    """shadow-* only: seconds the shadow thread sleeps between two syncs (0 = back-to-back syncs)."""
    alpha: float | None = field(default=None, metadata=opt("--alpha", "Sync"))
    """EASGD elasticity in (0, 1]: how far the replica and the centre move toward each other per sync; unset: min(0.5,
    2/T) for shadow-easgd (the centre meets each replica in turn, so it shrinks with T), 0.5 for fr-easgd."""
    block_momentum: float | None = field(default=None, metadata=opt("--block-momentum", "Sync"))
    """BMUF block momentum in [0, 1); unset: 1 - 1/sqrt(T) for shadow-bmuf (each replica's Adagrad already takes
    ~sqrt(T) longer steps than one trainer's), scaled by (1 - 1/every) for fr-bmuf."""
    block_lr: float = field(default=1.0, metadata=opt("--block-lr", "Sync"))
    """BMUF block learning rate, > 0."""
    replica_lr_scale: float = field(default=1.0, metadata=opt("--replica-lr-scale", "Sync"))
    """factor (> 0) on the trainers' dense learning rate while they sync; 1 keeps the rate as set (the better choice in
    long runs, BENCHMARKS.md)."""
    nesterov: bool = True
    """BMUF: restart trainers from x_global + block_momentum * delta (Nesterov) instead of x_global."""
    groups: int = field(default=2, metadata=opt("--sync-groups", "Sync"))
    """DS-Sync: the trainers are split into this many groups each round, each averaging within itself only."""
    shuffle_seed: int = 0
    """DS-Sync: seed of the per-round shuffle of the groups (the same on every trainer)."""
    compiled: bool = field(default=True, metadata=opt("--compiled-sync", "Sync"))
    """MA/BMUF as compiled DSL programs on shared memory (sync/compiled.py) and DS-Sync's groups on the `cocosync`
    backend; off: the sync classes on gloo (they also run across machines and are the tests' reference). Both learn
    alike; the compiled form is faster (BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        _check(self.algorithm in SYNC_ALGORITHMS, "sync.algorithm", self.algorithm, f"one of {SYNC_ALGORITHMS}")
        _check(self.every is None or _is_int(self.every) and self.every >= 1, "sync.every", self.every,
               "an integer >= 1, or None for the algorithm's default")
        _check(_is_number(self.interval) and 0 <= self.interval <= 60, "sync.interval",
               self.interval, "seconds in [0, 60]")
        _check(self.alpha is None or _is_number(self.alpha) and 0 < self.alpha <= 1, "sync.alpha", self.alpha,
               "a number in (0, 1], or None for its default")
        _check(self.block_momentum is None or _is_number(self.block_momentum) and 0 <= self.block_momentum < 1,
               "sync.block_momentum", self.block_momentum, "a number in [0, 1), or None for its default, 1 - 1/sqrt(T)")
        _check(_is_number(self.block_lr) and self.block_lr > 0, "sync.block_lr", self.block_lr,
               "a finite number > 0")
        _check(_is_number(self.replica_lr_scale) and self.replica_lr_scale > 0, "sync.replica_lr_scale",
               self.replica_lr_scale, "a finite number > 0 (1: the trainers' dense lr as set)")
        _check(isinstance(self.nesterov, bool), "sync.nesterov", self.nesterov, "true or false")
        _check(_is_int(self.groups) and self.groups >= 1, "sync.groups", self.groups, "an integer >= 1")
        _check(_is_int(self.shuffle_seed), "sync.shuffle_seed", self.shuffle_seed, "an integer")
        _check(isinstance(self.compiled, bool), "sync.compiled", self.compiled, "true or false")

    def momentum_for(self, trainers: int) -> float:
        """BMUF's block momentum with `trainers` trainers: the one set, else the measured default (see block_momentum).
        Why not Chen & Huo's 1 - 1/T: it makes the block's step T times the trainers' mean, right for SGD; a trainer's
        dense Adagrad sees 1/T of the gradients, so its own steps are already ~sqrt(T) times a lone trainer's."""
        if self.block_momentum is not None:
            return float(self.block_momentum)
        m = 1.0 - 1.0 / math.sqrt(trainers)
        return m * (1.0 - 1.0 / self.iterations_per_sync) if self.mode == "foreground" else m

    def alpha_for(self, trainers: int) -> float:
        """EASGD's elasticity with `trainers` trainers: the one set, else the measured default (see alpha). Smaller with
        T in the shadow: each sync pulls the scored centre `alpha` of the way to one replica, so at 0.5 the centre is
        mostly the last two replicas it met."""
        if self.alpha is not None:
            return float(self.alpha)
        return min(0.5, 2.0 / trainers) if self.mode == "shadow" else 0.5

    @property
    def iterations_per_sync(self) -> int:
        """fr-*: worker iterations between two syncs, `every` or else the algorithm's default (1 for the others)."""
        return self.every if self.every is not None else FOREGROUND_EVERY.get(self.algorithm, 1)

    @property
    def mode(self) -> str:
        """'shadow', 'foreground' or 'none'."""
        if self.algorithm == "none":
            return "none"
        return "shadow" if self.algorithm.startswith("shadow-") else "foreground"

    @property
    def method(self) -> str:
        """'easgd', 'ma', 'bmuf', 'dssync' or 'none' (the algorithm without its mode)."""
        return self.algorithm.split("-", 1)[1] if "-" in self.algorithm else "none"


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """One ShadowSync training run on this machine."""

    data: str = field(default="synthetic", metadata=opt("--data", "Data"))
    """'synthetic' (generated in memory, with a known Bayes NE), a Parquet (.parquet) or CSV (.csv) file with named
    columns, or a Criteo-format TSV file (.gz accepted)."""
    examples: int = field(default=600_000, metadata=opt("--examples", "Data"))
    """training examples over all trainers in one pass (the data set's size: rows of PATH, or synthetic draws)."""
    epochs: int = field(default=1, metadata=opt("--epochs", "Data"))
    """passes over those examples (each trainer reads its share this many times, in the same order)."""
    eval_examples: int = field(default=20_000, metadata=opt("--eval-examples", "Data"))
    """held-out examples scored at the end (the last rows of PATH, or a separate synthetic draw)."""
    trainers: int = field(default=2, metadata=opt("--trainers", "Trainers", short="-T"))
    """T: trainer processes, each with its own dense replica and its own part of the data."""
    workers: int = field(default=1, metadata=opt("--workers", "Trainers", short="-W"))
    """W: Hogwild worker threads per trainer, updating the trainer's replica without locks."""
    batch_size: int = field(default=256, metadata=opt("--batch-size", "Trainers"))
    """examples per worker iteration."""
    dense_optimizer: str = "adagrad"
    """optimizer of the dense (MLP) parameters: 'adagrad' or 'sgd'."""
    dense_lr: float = field(default=0.05, metadata=opt("--dense-lr", "Optimizer"))
    """learning rate of the dense parameters."""
    embedding_optimizer: str = "adagrad"
    """sparse row update of the shared embedding tables: 'adagrad' (row-wise) or 'sgd'."""
    embedding_lr: float = field(default=0.05, metadata=opt("--embedding-lr", "Optimizer"))
    """learning rate of the embedding rows."""
    dense_weight_decay: float = field(default=0.0, metadata=opt("--dense-weight-decay", "Optimizer"))
    """L2 regularization of the dense parameters (g += wd * w, as torch.optim.Adagrad's weight_decay)."""
    embedding_weight_decay: float = field(default=0.0, metadata=opt("--embedding-weight-decay", "Optimizer"))
    """row-wise L2 of the embedding rows a batch touches (FBGEMM's TBE weight_decay_mode=L2)."""
    seed: int = field(default=0, metadata=opt("--seed", "Run"))
    """seed of the model initialization and of the synthetic data."""
    threads: int = field(default=1, metadata=opt("--threads", "Trainers"))
    """intra-op torch threads per trainer process (1 on a 2-core machine)."""
    window: int = 50
    """batches in the sliding window of the train NE."""
    log_every: float = 0.5
    """seconds between two train-metric records of a trainer."""
    out_dir: str = field(default="runs/latest", metadata=opt("--out", "Run"))
    """directory of metrics.jsonl, summary.json, ne.png, checkpoints/ (DCP directories) and logs/ (the ranks')."""
    checkpoint: bool = True
    """write a checkpoint (checkpoints/seen-N: every rank's part, torch.distributed.checkpoint) at the end."""
    plot: bool = True
    """write the NE-vs-examples PNG."""
    progress: bool = True
    """show a progress bar while training."""
    timeout: float | None = field(default=None, metadata=opt("--timeout", "Run", shown="no limit"))
    """seconds after which the trainers are asked to stop with a checkpoint and the summary, as Ctrl-C does, counted
    from the launch (`cocosync train`), the rendezvous (`--nnodes`) or each trainer's start (plain torchrun); unset:
    no limit. A limit of this launch: a resumed run does not inherit it."""
    heartbeat_timeout: float = field(default=30.0, metadata=opt("--heartbeat-timeout", "Run"))
    """seconds without a heartbeat from a trainer (each beats from a thread of its own, whatever its training does)
    after which that trainer is lost (killed, as kill -9 or the OOM killer would: see min_trainers), or the run fails
    naming it when it cannot go on without it."""
    min_trainers: int = field(default=1, metadata=opt("--min-trainers", "Run"))
    """trainers a one-machine job needs to go on: a trainer that is lost (killed, out of memory, silent past
    --heartbeat-timeout) leaves the others training while at least this many are left (its unread rows are read by
    them, its dense sync re-formed among them; the first trainer left writes the summary if trainer 0 was lost); with
    fewer the job stops naming the loss. A job that can lose a trainer (more trainers than this, not DS-Sync) can also
    lose its embedding server: the trainers use its shard in shared memory."""
    max_restarts: int = field(default=0, metadata=opt("--max-restarts", "Run"))
    """times a job that goes on without a lost trainer (see min_trainers; across machines, a lone trainer lost as
    the job's first loss, with MA or BMUF) starts each lost trainer again, while the trainers are still reading their
    own rows: the new process takes the dense model from a trainer in the job (no checkpoint is read), reads the rest
    of the lost trainer's rows and joins the dense sync (across machines, and its lookup exchange). The others never
    stop. 0: a lost trainer stays lost."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """dense synchronization (see SyncConfig)."""
    model_factory: str = field(default="dlrm", metadata=opt("--model", "Model"))
    """the model: a built-in ('dlrm', 'dcn', 'deepfm') or your factory as 'package.module:function' or
    'path/to/file.py:function', called with the data's ModelInputs and returning a torch.nn.Module whose tables are
    EmbeddingBagCollections (importable by every rank)."""
    model: dict = field(default_factory=dict)
    """overrides of ModelConfig fields (e.g. {'embedding_dim': 16}); checked against ModelConfig."""
    data_options: dict = field(default_factory=dict)
    """overrides of DataConfig fields (e.g. {'rows_per_table': 10000}); checked against DataConfig."""

    @property
    def total_examples(self) -> int:
        """examples the run trains on: examples x epochs."""
        return self.examples * self.epochs

    def __post_init__(self) -> None:
        if isinstance(self.sync, dict):
            self.sync = SyncConfig(**self.sync)
        _check(isinstance(self.data, str) and bool(self.data), "data", self.data, "'synthetic' or a file path")
        _check(isinstance(self.out_dir, str) and bool(self.out_dir), "out_dir", self.out_dir, "a directory path")
        _check(_is_int(self.seed), "seed", self.seed, "an integer")
        for name in ("checkpoint", "plot", "progress"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "true or false")
        for name in ("examples", "epochs", "eval_examples", "trainers", "workers", "batch_size", "threads",
                     "window"):
            v = getattr(self, name)
            _check(_is_int(v) and v >= 1, name, v, "an integer >= 1")
        _check(self.trainers <= 64, "trainers", self.trainers, "at most 64 trainer processes")
        _check(_is_int(self.min_trainers) and 1 <= self.min_trainers <= self.trainers, "min_trainers",
               self.min_trainers, f"an integer from 1 to trainers={self.trainers}")
        _check(_is_int(self.max_restarts) and 0 <= self.max_restarts <= 100, "max_restarts", self.max_restarts,
               "an integer from 0 to 100")
        _check(self.workers <= 64, "workers", self.workers, "at most 64 workers per trainer")
        if self.sync.method == "dssync":
            _check(self.sync.groups <= self.trainers, "sync.groups", self.sync.groups,
                   f"at most trainers={self.trainers} groups (each group holds at least one trainer)")
        _check(self.examples >= self.trainers * self.workers * self.batch_size, "examples", self.examples,
               f"at least trainers*workers*batch_size = {self.trainers * self.workers * self.batch_size}")
        _check(self.dense_optimizer in OPTIMIZERS, "dense_optimizer", self.dense_optimizer, f"one of {OPTIMIZERS}")
        _check(self.embedding_optimizer in OPTIMIZERS, "embedding_optimizer", self.embedding_optimizer,
               f"one of {OPTIMIZERS}")
        _check(self.timeout is None or (_is_number(self.timeout) and self.timeout > 0), "timeout", self.timeout,
               "a finite number of seconds > 0 (leave it out for no limit)")
        for name in ("dense_lr", "embedding_lr", "log_every", "heartbeat_timeout"):
            v = getattr(self, name)
            _check(_is_number(v) and v > 0, name, v, "a finite number > 0")
        for name in ("dense_weight_decay", "embedding_weight_decay"):
            v = getattr(self, name)
            _check(_is_number(v) and v >= 0, name, v, "a finite number >= 0")
        _check(isinstance(self.model_factory, str) and bool(self.model_factory), "model_factory", self.model_factory,
               "a built-in model's name or 'package.module:function'")
        _check(isinstance(self.model, dict), "model", self.model, "a table of ModelConfig overrides")
        _check(isinstance(self.data_options, dict), "data_options", self.data_options,
               "a table of DataConfig overrides")


def check_paths(cfg: TrainConfig) -> None:
    """The files a run reads exist (checked before anything is spawned), or ConfigError naming them."""
    if cfg.data != "synthetic" and Path(cfg.data).is_dir():
        raise ConfigError(f"data={cfg.data!r} is a directory; expected 'synthetic', a Parquet or CSV file, "
                          "or a Criteo-format TSV file (.gz accepted)")
    if cfg.data != "synthetic" and not Path(cfg.data).is_file():
        raise ConfigError(f"data={cfg.data!r}: no such file; expected 'synthetic', a Parquet or CSV file, "
                          "or a Criteo-format TSV file (.gz accepted)")
    eval_path = cfg.data_options.get("eval_path")
    if eval_path is not None and Path(str(eval_path)).is_dir():
        raise ConfigError(f"data_options.eval_path={eval_path!r} is a directory; expected a Criteo-format TSV file")
    if eval_path is not None and not Path(str(eval_path)).is_file():
        raise ConfigError(f"data_options.eval_path={eval_path!r}: no such file")
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir={cfg.out_dir!r} is a file; expected a directory (it is created if missing)")
    check_writable(out, "out_dir")


def check_writable(out: Path, name: str) -> None:
    """`out` exists (created if missing) and takes a file, or ConfigError naming it and the cause (a read-only file
    system, no permission, no space)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{name}={str(out)!r} cannot be written: {e.strerror or e} (choose another directory with "
                          "--out)") from None


def resume_value(config: dict, key: str) -> Any:
    """A setting of a saved config as resuming compares it: the initial click rate only sets the weights a run
    starts from, which a resumed run loads instead (checkpoints before it was estimated from the data lack it)."""
    value = config[key]
    return {k: v for k, v in value.items() if k != "init_ctr"} if key == "model" else value


def config_to_dict(cfg: TrainConfig) -> dict:
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    out["sync"] = {f.name: getattr(cfg.sync, f.name) for f in dataclasses.fields(cfg.sync)}
    return out


def config_from_dict(raw: dict, **overrides: Any) -> TrainConfig:
    """Build a TrainConfig from a nested dict; unknown keys raise ConfigError naming them."""
    raw = dict(raw)
    sync_raw = raw.pop("sync", None) or {}
    if isinstance(sync_raw, str):  # `sync = "shadow-ma"`: the algorithm alone
        sync_raw = {"algorithm": sync_raw}
    if not isinstance(sync_raw, dict):
        raise ConfigError(f"sync={sync_raw!r} is invalid: expected a [sync] table (e.g. algorithm = \"shadow-bmuf\") "
                          f"or an algorithm name, one of {SYNC_ALGORITHMS}")
    sync_raw = dict(sync_raw)
    for section in ("model", "data_options"):
        if section in raw and not isinstance(raw[section], dict):
            raise ConfigError(f"{section}={raw[section]!r} is invalid: expected a [{section}] table of overrides")
    known = {f.name for f in dataclasses.fields(TrainConfig)} - {"sync"}
    sync_known = {f.name for f in dataclasses.fields(SyncConfig)}
    bad = sorted(set(raw) - known)
    if bad:
        raise ConfigError(f"unknown config key(s) {bad}; allowed: {sorted(known | {'sync'})}")
    bad = sorted(set(sync_raw) - sync_known)
    if bad:
        raise ConfigError(f"unknown [sync] key(s) {bad}; allowed: {sorted(sync_known)}")
    for k, v in overrides.items():
        section, _, key = k.partition(".")
        if section == "sync" and key:
            sync_raw[key] = v
        elif section in ("model", "data_options") and key:  # one field of a table (e.g. model.embedding_dim)
            raw[section] = {**(raw.get(section) or {}), key: v}
        else:
            raw[k] = v
    try:
        return TrainConfig(sync=SyncConfig(**sync_raw), **raw)
    except TypeError as e:  # wrong-typed arguments that the dataclass itself rejects
        raise ConfigError(str(e)) from None


def load_train_config(path: str | Path, **overrides: Any) -> TrainConfig:
    """Read a TrainConfig from a .toml, .json, .yaml/.yml file; `overrides` (e.g. trainers=2, **{'sync.every': 4})
    win over the file. (A [cluster] table is the job's ClusterConfig: `load_job_config`.)"""
    raw = read_config_file(path)
    raw.pop(CLUSTER_TABLE, None)
    return config_from_dict(raw, **overrides)


def load_job_config(path: str | Path, cluster: dict[str, Any], **overrides: Any) -> tuple[TrainConfig, ClusterConfig]:
    """A config file's TrainConfig and, from its [cluster] table, ClusterConfig (seconds for the intervals);
    `overrides` and `cluster` (ClusterConfig fields) win over the file."""
    raw = read_config_file(path)
    table = raw.pop(CLUSTER_TABLE, None) or {}
    if not isinstance(table, dict):
        raise ConfigError(f"cluster={table!r} is invalid: expected a [cluster] table of ClusterConfig fields")
    known = {f.name for f in dataclasses.fields(ClusterConfig)}
    if bad := sorted(set(table) - known):
        raise ConfigError(f"unknown [cluster] key(s) {bad}; allowed: {sorted(known)}")
    try:
        return config_from_dict(raw, **overrides), ClusterConfig(**{**table, **cluster})
    except TypeError as e:
        raise ConfigError(str(e)) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The table of settings in a .toml, .json or .yaml/.yml file (ConfigError naming the file if unreadable)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e}") from None
    try:
        raw = _parse_config(p, text)
    except RecursionError:  # a crafted file nested thousands deep: the parsers recurse per level
        raise ConfigError(f"config file {str(p)!r} is nested too deeply to be a config (tables of settings nest two "
                          "levels)") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a table of settings, got {type(raw).__name__}")
    return raw


def _parse_config(p: Path, text: str) -> Any:
    suffix = p.suffix.lower()
    if suffix == ".toml":
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:  # its message gives the line and column
            raise ConfigError(f"config file {str(p)!r}: TOML syntax error: {e}") from None
    elif suffix == ".json":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {str(p)!r}: JSON syntax error: {e}") from None
    elif suffix in (".yaml", ".yml"):
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r}: YAML syntax error: {e}") from None
    else:
        raise ConfigError(f"config file {str(p)!r}: unknown extension {suffix!r}; expected .toml, .json or .yaml")
    return raw


@dataclass(frozen=True)
class NodeRange:
    """`--nnodes`: the machines a job across machines starts with at least (`low`) and is laid out for (`high`),
    torchrun's MIN:MAX; N alone is N:N. The machines of the layout not there at the start join the running job later
    (job/node_join.py)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> "NodeRange":
        """`N` or `MIN:MAX` (1 <= MIN < MAX), or a ConfigError naming the value and what would be right."""
        parts = text.split(":")
        try:
            low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
        except ValueError:
            raise ConfigError(f"--nnodes {text!r} is not a number of machines: expected N or MIN:MAX, e.g. 2 or "
                              "1:2") from None
        if len(parts) > 2 or low < 1 or high < low:
            raise ConfigError(f"--nnodes {text!r}: expected N >= 1 machines, or MIN:MAX with 1 <= MIN <= MAX, e.g. 2 "
                              "or 1:2")
        return cls(low, high)

    def __str__(self) -> str:
        return str(self.high) if self.low == self.high else f"{self.low}:{self.high}"

    @property
    def elastic(self) -> bool:
        """Machines may join the job beyond those it started with."""
        return self.high > self.low


#: processors whose stores are not reordered with each other, which the node exchange's rings rely on
STORE_ORDERED = ("x86_64", "amd64", "i386", "i686")
EXCHANGES = ("exchange", "node-exchange")  # the lookup exchange per trainer, per node
CLUSTER_TABLE = "cluster"  # a config file's table of ClusterConfig fields
TRANSPORTS = (*EXCHANGES, "rpc")


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """The multi-machine options of a ShadowSync job (on top of its TrainConfig)."""

    embedding_servers: int = field(default=1, metadata=opt("--embedding-servers", "Cluster"))
    """embedding parameter servers per node (their shards live in the node's shared memory)."""
    sync_servers: int | None = field(
        default=None, metadata=opt("--sync-servers", "Cluster", shown="1 for EASGD, else 0"))
    """sync parameter servers per node holding EASGD's centre; unset: 1 for EASGD, 0 otherwise."""
    prefetch: int | None = field(
        default=None, metadata=opt("--prefetch", "Cluster", shown="40 with the exchange, 2 with rpc"))
    """batches whose embedding rows are requested ahead of the one training (0: none); unset: 40 with the lookup
    exchange (its answers come 1-2 rounds later), 2 with RPC."""
    lookup_batches: int = field(default=1, metadata=opt("--lookup-batches", "Cluster"))
    """batches whose embedding lookups go in one message per server (fewer messages, staler rows)."""
    max_inflight: int = field(default=4, metadata=opt("--max-inflight", "Cluster"))
    """row-gradient pushes a trainer may have outstanding before it waits for the oldest."""
    lookup_transport: str = field(default="exchange", metadata=opt("--lookup-transport", "Cluster", choices=TRANSPORTS))
    """how lookups reach other machines' shards: 'exchange' (rounds of one gloo all_to_all between the trainers of every
    node), 'node-exchange' (the same rounds between the first embedding servers of every node, which carry their
    node's trainers' lookups through shared memory: for nodes with many trainers) or 'rpc' (torch.distributed.rpc, a
    message per server and batch: the measured baseline)."""
    exchange_interval: float = field(default=0.040, metadata=opt("--exchange-interval", "Cluster", scale=1e-3))
    """time between two rounds of the lookup exchange: seconds in a config, milliseconds on the command line (shorter:
    fresher rows, more CPU per example; the hot rows are replicated, so the rows left to the exchange are cold and a
    longer round costs them little staleness)."""
    hot_rows: int = field(default=4096, metadata=opt("--hot-rows", "Cluster"))
    """with the exchange: the rows seen most often in the first training rows, replicated on every node and synchronized
    in the background (hot_rows.py); 0: none."""
    hot_sync_interval: float = field(default=0.040, metadata=opt("--hot-sync-interval", "Cluster", scale=1e-3))
    """time between two syncs of the replicated hot rows: seconds in a config, milliseconds on the command line
    (shorter: fresher hot rows, more CPU and bytes); with `hot_staleness`, the longest."""
    hot_staleness: float = field(default=0.0, metadata=opt("--hot-staleness", "Cluster"))
    """> 0: sync the hot rows as often as it takes (down to every 2 ms) to keep the other nodes' updates a use misses
    near this many; 0: every `hot_sync_interval`."""
    shard_mirror_interval: float = field(default=0.0, metadata=opt("--shard-mirror-interval", "Cluster", scale=1e-3))
    """> 0, two machines: every this long (seconds in a config, milliseconds on the command line) each machine's
    embedding servers copy the rows changed since to the other machine's mirror of their shards, from which it
    restores them, that old, if this machine is lost (else from the last checkpoint); twice the tables' memory on
    each machine. 0: no mirror."""
    resume: str | None = None
    """a checkpoint directory (or a run directory: its checkpoints/latest) to continue from."""
    eval_every: int | None = field(default=None, metadata=opt("--eval-every", "Checkpoints and eval"))
    """score trainer 0's replica on the held-out set every this many examples of the job (an eval NE curve)."""
    checkpoint_every: int | None = field(default=None, metadata=opt("--checkpoint-every", "Checkpoints and eval"))
    """also checkpoint every this many examples of the job (each trainer pauses at its share of the mark)."""
    stop_after: int | None = field(default=None, metadata=opt("--stop-after", "Checkpoints and eval"))
    """stop with a checkpoint once the job has seen this many examples, the runs a resumed run continues included."""

    def __post_init__(self) -> None:
        for name in ("embedding_servers", "max_inflight", "lookup_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}={v!r} is invalid: expected an integer >= 1")
        if self.prefetch is None:
            self.prefetch = 40 if self.lookup_transport in EXCHANGES else 2
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or not 0 <= self.prefetch <= 64:
            raise ConfigError(f"prefetch={self.prefetch!r} is invalid: expected an integer in [0, 64]")
        if not isinstance(self.hot_rows, int) or isinstance(self.hot_rows, bool) or self.hot_rows < 0:
            raise ConfigError(f"hot_rows={self.hot_rows!r} is invalid: expected an integer >= 0 (0: no replicated "
                              "rows)")
        for name in ("stop_after", "checkpoint_every", "eval_every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{name}={v!r} is invalid: expected a number of examples >= 1")
        if self.lookup_transport not in TRANSPORTS:
            raise ConfigError(f"lookup_transport={self.lookup_transport!r} is invalid: expected one of {TRANSPORTS}")
        if self.lookup_transport == "node-exchange" and platform.machine().lower() not in STORE_ORDERED:
            raise ConfigError(f"lookup_transport='node-exchange' needs a processor that keeps stores in order (x86-64: "
                              f"its shared-memory rings publish a slot by the store after it); this one is "
                              f"{platform.machine()!r}: use 'exchange'")
        for flag in ("exchange_interval", "hot_sync_interval"):
            v = getattr(self, flag)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                shown = f"{v * 1e3:g} ms" if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)
                raise ConfigError(f"--{flag.replace('_', '-')} {shown} is invalid: expected milliseconds in (0, 1000]")
        v = self.shard_mirror_interval
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 60:
            shown = f"{v * 1e3:g} ms" if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)
            raise ConfigError(f"--shard-mirror-interval {shown} is invalid: expected milliseconds in [0, 60000] (0: no "
                              "mirror)")
        v = self.hot_staleness
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1000:
            raise ConfigError(f"--hot-staleness {v!r} is invalid: expected updates per use in [0, 1000] (0: sync "
                              "every --hot-sync-interval)")
        if self.sync_servers is not None and (not isinstance(self.sync_servers, int) or self.sync_servers < 0):
            raise ConfigError(f"sync_servers={self.sync_servers!r} is invalid: expected an integer >= 0")

    def sync_servers_for(self, method: str, nodes: int = 1) -> int:
        """EASGD's sync servers per node for a job of `nodes` machines (ConfigError when the setting cannot run)."""
        if method == "dssync" and nodes > 1:
            raise ConfigError("sync 'dssync' runs on one machine for now (its groups are flat groups; across "
                              "machines use ma, bmuf or easgd)")
        if self.sync_servers is None:
            return 1 if method == "easgd" else 0
        if method == "easgd" and self.sync_servers < 1:
            raise ConfigError("sync_servers=0 is invalid for EASGD: its centre lives on the sync servers "
                              "(--sync-servers >= 1 per node)")
        if method != "easgd" and self.sync_servers > 0:
            raise ConfigError(f"sync_servers={self.sync_servers} is invalid for sync method {method!r}: only EASGD "
                              "has sync servers (MA and BMUF all-reduce among the trainers)")
        return self.sync_servers
