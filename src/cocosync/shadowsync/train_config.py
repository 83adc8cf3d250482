"""Configuration of a ShadowSync training run: `SyncConfig` (how dense replicas are synchronized) and
`TrainConfig` (trainers, workers, optimizers, budget, outputs).

Both are `@dataclass(kw_only=True, slots=True)` validated in `__post_init__`; a bad value raises
`ConfigError` naming the field, the value and what is allowed. `load_train_config(path)` reads the same
fields from a TOML, JSON or YAML file (YAML needs PyYAML); unknown keys are an error, not silently ignored.

File layout (TOML shown; JSON/YAML take the same nesting)::

    trainers = 2
    workers = 1
    examples = 200000
    [sync]
    algorithm = "shadow-bmuf"
    block_momentum = 0.5
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cocosync.shadowsync.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["ConfigError", "SyncConfig", "TrainConfig", "load_train_config", "SYNC_ALGORITHMS", "COLLECTIVE_METHODS",
           "FOREGROUND_EVERY", "config_from_dict", "config_to_dict", "check_paths", "resume_value"]

#: fr-*: worker iterations per sync when `every` is not set. Measured at T=8, 5 seeds, 800k and 1.6M examples
#: (BENCHMARKS.md): syncing every iteration lost 1.2-1.9% NE; blocks of these sizes 0.4-1.5% at 800k, -0.3 to +1.0%
#: at 1.6M. BMUF's block momentum grows with the block (`momentum_for`), so its best block is the longest.
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

    algorithm: str = "shadow-bmuf"
    """one of SYNC_ALGORITHMS: 'shadow-*' syncs in a background thread, 'fr-*' every `every` iterations
    inside the training loop, 'none' never (independent trainers, the reference)."""
    every: int | None = None
    """fr-* only: sync after every `every` worker iterations of the trainer (the paper's k); None = the algorithm's
    measured default, `FOREGROUND_EVERY` (see `iterations_per_sync`)."""
    interval: float = 0.02
    """shadow-* only: seconds the shadow thread sleeps between two syncs (0 = back-to-back syncs)."""
    alpha: float | None = None
    """EASGD elasticity: how far local and central copies move toward each other per sync, in (0, 1]; None =
    `alpha_for(T)`: min(0.5, 2/T) for shadow-easgd (0.25 at T=8, 0.125 at T=16: 0.3-0.6 points of NE better than 0.5
    at 800k and 1.6M, BENCHMARKS.md), 0.5 for fr-easgd (at T=8 0.25 was 0.2-0.3 points better, at T=16 0.125
    1.3 points worse at 1.6M)."""
    block_momentum: float | None = None
    """BMUF block momentum, in [0, 1); None = `momentum_for(T)`: 1 - 1/sqrt(T) for shadow-bmuf (0.29 at T=2, 0.65 at
    T=8; Chen & Huo's 1 - 1/T lost 0.6% NE at T=2 and 0.4% at T=8, measured in BENCHMARKS.md), scaled by
    (1 - 1/every) for fr-bmuf (a block of one iteration gets none: 1 - 1/T diverged there from T=4)."""
    block_lr: float = 1.0
    """BMUF block learning rate, > 0."""
    replica_lr_scale: float = 1.0
    """factor on the trainers' dense learning rate while they sync, > 0. Each replica's Adagrad sees 1/T of
    the gradients, so its steps are ~sqrt(T) longer than one trainer's; 1/sqrt(T) with shadow-bmuf measured better in
    short runs (400,000 examples: T=8 +2.04% -> +0.94% NE) and worse in longer ones (1.6M: T=8 +0.12% -> +1.31%; 800k:
    no gain), so it is not the default (BENCHMARKS.md)."""
    nesterov: bool = True
    """BMUF: restart trainers from x_global + block_momentum * delta (Nesterov) instead of x_global."""
    groups: int = 2
    """DS-Sync: the trainers are split into this many groups each round, each averaging within itself only."""
    shuffle_seed: int = 0
    """DS-Sync: seed of the per-round shuffle of the groups (the same on every trainer)."""
    compiled: bool = True
    """MA/BMUF on one machine as compiled DSL programs on shared memory (sync/compiled.py) instead of the classes on
    gloo (False; the classes also run across machines and are the tests' reference); DS-Sync's groups on the
    `cocosync` backend (shared memory) instead of gloo. The default since 42 fr-ma runs
    (T=2, 120k examples) on it and 30 on the classes, interleaved, learned alike (eval NE medians 0.732 and 0.729,
    the same tail to 0.76) at 1.36x the examples/s (BENCHMARKS.md, sync); the slow runs an earlier session saw (NE
    0.86) did not come back in 103 runs since."""

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
        """EASGD's elasticity with `trainers` trainers: the one set, else the measured default (see alpha). Why smaller
        with T in the shadow: each trainer's sync pulls the scored centre `alpha` of the way to that one replica, so at
        0.5 the centre is mostly the last two replicas it met; the EASGD paper keeps T x alpha near 0.9 (0.11 at T=8:
        no better than 0.5 here), 2/T measured best between the two."""
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

    data: str = "synthetic"
    """'synthetic' (generated in memory, with known Bayes NE) or a path to a Criteo-format TSV file."""
    examples: int = 600_000
    """training examples over all trainers in one pass (the data set's size: rows of PATH, or synthetic draws)."""
    epochs: int = 1
    """passes over those examples (each trainer reads its share this many times, in the same order)."""
    eval_examples: int = 20_000
    """held-out examples scored at the end (the last rows of PATH, or a separate synthetic draw)."""
    trainers: int = 2
    """T: trainer processes, each with its own dense replica and its own part of the data."""
    workers: int = 1
    """W: Hogwild worker threads per trainer, updating the trainer's replica without locks."""
    batch_size: int = 256
    """examples per worker iteration."""
    dense_optimizer: str = "adagrad"
    """optimizer of the dense (MLP) parameters: 'adagrad' or 'sgd'."""
    dense_lr: float = 0.05
    """learning rate of the dense parameters."""
    embedding_optimizer: str = "adagrad"
    """sparse row update of the shared embedding tables: 'adagrad' (row-wise) or 'sgd'."""
    embedding_lr: float = 0.05
    """learning rate of the embedding rows."""
    dense_weight_decay: float = 0.0
    """L2 regularization of the dense parameters (g += wd * w, as torch.optim.Adagrad's weight_decay)."""
    embedding_weight_decay: float = 0.0
    """row-wise L2 of the embedding rows a batch touches (FBGEMM's TBE weight_decay_mode=L2)."""
    seed: int = 0
    """seed of the model initialization and of the synthetic data."""
    threads: int = 1
    """intra-op torch threads per trainer process (1 on a 2-core machine)."""
    window: int = 50
    """batches in the sliding window of the train NE."""
    log_every: float = 0.5
    """seconds between two train-metric records of a trainer."""
    out_dir: str = "runs/latest"
    """directory of metrics.jsonl, summary.json, ne.png, checkpoints/ (DCP directories) and logs/ (the ranks')."""
    checkpoint: bool = True
    """write a checkpoint (checkpoints/seen-N: every rank's part, torch.distributed.checkpoint) at the end."""
    plot: bool = True
    """write the NE-vs-examples PNG."""
    progress: bool = True
    """show a progress bar while training."""
    timeout: float | None = None
    """seconds after which the trainers are asked to stop (keeping a checkpoint and the summary, as Ctrl-C does),
    counted from the launch (`cocosync train`), the rendezvous (`--nnodes`), or each trainer's start (plain
    torchrun: each trainer stops itself); None: no limit. A limit of this session: a resumed run does not inherit
    it."""
    heartbeat_timeout: float = 30.0
    """seconds without a heartbeat from a trainer (each beats every heartbeat_timeout / 10 s from a thread of its
    own, whatever its training does) after which the run fails naming that trainer (stopped, hung, swapped out)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """dense synchronization (see SyncConfig)."""
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
        _check(isinstance(self.model, dict), "model", self.model, "a table of ModelConfig overrides")
        _check(isinstance(self.data_options, dict), "data_options", self.data_options,
               "a table of DataConfig overrides")


def check_paths(cfg: TrainConfig) -> None:
    """The files a run reads exist (checked before anything is spawned), or ConfigError naming them."""
    if cfg.data != "synthetic" and Path(cfg.data).is_dir():
        raise ConfigError(f"data={cfg.data!r} is a directory; expected 'synthetic' or a Criteo-format TSV file "
                          "(.gz accepted)")
    if cfg.data != "synthetic" and not Path(cfg.data).is_file():
        raise ConfigError(f"data={cfg.data!r}: no such file; expected 'synthetic' or a Criteo-format TSV file "
                          "(.gz accepted)")
    eval_path = cfg.data_options.get("eval_path")
    if eval_path is not None and Path(str(eval_path)).is_dir():
        raise ConfigError(f"data_options.eval_path={eval_path!r} is a directory; expected a Criteo-format TSV file")
    if eval_path is not None and not Path(str(eval_path)).is_file():
        raise ConfigError(f"data_options.eval_path={eval_path!r}: no such file")
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir={cfg.out_dir!r} is a file; expected a directory (it is created if missing)")


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
    win over the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    text = p.read_text()
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
            import yaml  # type: ignore[import-not-found]
        except ImportError:
            raise ConfigError(f"{str(p)!r} is YAML but PyYAML is not installed; use .toml or .json") from None
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r}: YAML syntax error: {e}") from None
    else:
        raise ConfigError(f"config file {str(p)!r}: unknown extension {suffix!r}; expected .toml, .json or .yaml")
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a table of settings, got {type(raw).__name__}")
    return config_from_dict(raw, **overrides)
