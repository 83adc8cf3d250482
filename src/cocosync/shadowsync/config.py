"""Configs of the ShadowSync data and model layers: `DataConfig`, `SynthConfig`, `ModelConfig`.

Each is a `@dataclass(kw_only=True, slots=True)`; `__post_init__` checks every field and raises `ValueError`
naming the bad value and what would be allowed. (`TrainConfig`/`SyncConfig` live in `train_config.py`.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DataConfig", "SynthConfig", "ModelConfig", "CRITEO_NUM_DENSE", "CRITEO_NUM_SPARSE"]

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

    num_dense: int = CRITEO_NUM_DENSE
    """Integer features per row (columns 2..1+num_dense); log-transformed as log(1 + max(x, 0))."""
    num_sparse: int = CRITEO_NUM_SPARSE
    """Categorical features per row (the last num_sparse columns); hashed into their table."""
    table_size: int | tuple[int, ...] = 10_000
    """Hash buckets per embedding table: one int for all tables, or one per categorical feature.
    Bucket 0 is reserved for a missing (empty) categorical; values hash into [1, size)."""
    batch_size: int = 256
    """Examples per batch, unless a reader is given its own batch_size."""
    max_bad_fraction: float = 0.1
    """A reader raises once more than this fraction of lines are malformed (after the first 1000 lines):
    a wrong file should fail loudly rather than train on nothing. Set 1.0 to only count and report."""
    train_path: str | tuple[str, ...] | None = None
    """Criteo-format training file(s) (.gz allowed); None = the embedded synthetic teacher (`synth`)."""
    eval_path: str | tuple[str, ...] | None = None
    """Held-out Criteo-format file(s); None = a synthetic held-out set drawn from the same teacher."""
    train_rows: int | None = None
    """Cap on training examples (per whole data set, before sharding); None = the whole file, or an
    endless synthetic stream."""
    eval_rows: int = 50_000
    """Held-out examples to evaluate on (a cap for files; the size of the synthetic held-out set)."""
    seed: int = 0
    """Sampling seed of the synthetic stream (the held-out set uses a different, derived stream)."""
    split: str = "auto"
    """How the trainers' workers share training files: 'bytes' (each reads only its line-aligned byte range of each
    file; plain files, with `eval_path` given, since the rows after the budget are no longer held out), 'lines'
    (interleaved lines; every reader scans every byte; .gz works), 'auto' (bytes where it applies, else lines).
    With bytes, shard s trains on the first train_rows / S lines of its range: a range holding fewer (a budget of
    the whole file: ranges hold unequal line counts) ends that shard a little early."""
    synth: SynthConfig = field(default_factory=SynthConfig)
    """The synthetic teacher, used where a path is None."""

    def __post_init__(self) -> None:
        o = "DataConfig"
        for name in ("num_dense", "num_sparse", "batch_size", "eval_rows"):
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

    embedding_dim: int = 16
    """Width of every embedding vector (and of the bottom MLP's output, which joins the interaction)."""
    bottom_mlp: tuple[int, ...] = (64, 16)
    """Hidden widths of the bottom MLP (ReLU after each); the last must equal embedding_dim."""
    top_mlp: tuple[int, ...] = (64, 32)
    """Hidden widths of the top MLP (ReLU after each); a final linear layer gives one logit."""
    sparse_gradients: bool = False
    """Embedding tables produce sparse gradients (torch.sparse), as Hogwild/sparse optimizers want."""
    embedding_init_std: float = 0.05
    """Embedding rows start N(0, std^2); dense layers start with PyTorch's default init."""
    init_ctr: float | None = 0.04
    """Start the output bias at logit(init_ctr) so step 0 predicts a plausible click rate; None = 0. A training run
    that does not set it estimates it from its data (sources.with_init_ctr)."""
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
