"""Synthetic click data from a hidden "teacher", written in the Criteo format or served in memory.

The teacher (see `SynthConfig`) draws categories per feature from a Zipf law, integer features from
log-normals with missing values, and computes a click logit from what a model can see (the log-transformed
integers and the category strings): per-feature main effects, a few low-rank pairwise interactions, one
dense x dense and one dense x categorical term, with an intercept calibrated to the target click rate.
Every row comes with its true click probability, so the Bayes-optimal NE of any data set is known.

Rows are generated in chunks of `CHUNK_ROWS`; chunk k of stream (seed, split) always holds the same rows,
so files, in-memory data sets and streams of one seed agree row for row. `SyntheticStream` shards by
chunks (shard i of T owns chunks k % T == i), which partitions the stream exactly without generating rows
another shard owns. Files: `write_synthetic(path)` writes the 40 standard columns (label, I1..I13,
C1..C26; categoricals as 8-digit hex) and the probabilities to the sidecar `prob_sidecar_path(path)`.
"""

from __future__ import annotations

import gzip
import math
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from cocosync.shadowsync.config import DataConfig, SynthConfig
from cocosync.shadowsync.data.criteo import Batch, hash_tokens, log_transform, prob_sidecar_path

__all__ = [
    "SynthConfig", "Teacher", "SyntheticStream", "SyntheticDataset", "make_synthetic_dataset",
    "write_synthetic", "expected_ne", "CHUNK_ROWS", "TRAIN", "EVAL",
]

CHUNK_ROWS = 4096
TRAIN, EVAL = 0, 1  # split ids: the held-out set is a different random stream from the same teacher


def _entropy(p: np.ndarray | float) -> np.ndarray:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return -(p * np.log(p) + (1 - p) * np.log1p(-p))


def expected_ne(probs: np.ndarray) -> float:
    """NE that the true probabilities achieve in expectation: mean H(p) / H(mean p) (no label noise)."""
    probs = np.asarray(probs, dtype=np.float64)
    return float(_entropy(probs).mean() / _entropy(probs.mean()))


class Teacher:
    """The hidden model behind synthetic data. Deterministic in `config.teacher_seed`."""

    def __init__(self, config: SynthConfig) -> None:
        self.config = c = config
        rng = np.random.default_rng(np.random.SeedSequence([c.teacher_seed, 0x7EAC]))
        self.tokens: list[np.ndarray] = []  # per feature: the category strings, as 8-byte hex
        self.cdf: list[np.ndarray] = []
        for v in c.vocab_sizes:
            ids = np.unique(rng.integers(0, 2**32, size=2 * v + 16, dtype=np.uint64))
            ids = rng.permutation(ids)[:v]
            self.tokens.append(np.array([f"{i:08x}".encode() for i in ids.tolist()], dtype="S8"))
            w = (np.arange(v) + 1.0) ** -c.zipf_exponent
            self.cdf.append(np.cumsum(w) / w.sum())
        nd, ns, s = c.num_dense, c.num_sparse, c.signal
        self.dense_mu = rng.uniform(0.0, 4.0, nd)
        self.dense_sigma = rng.uniform(0.5, 1.5, nd)
        self.dense_w = rng.normal(0.0, 0.25, nd) * s
        self.dense_pair = 0.3 * s  # weight of f_0 * f_1
        order = np.argsort(np.asarray(c.vocab_sizes), kind="stable")
        strength = np.full(ns, 0.05)
        strength[order[: c.num_important]] = 0.6
        self.main = [rng.normal(0.0, strength[t] * s, v) for t, v in enumerate(c.vocab_sizes)]
        pool = order[: max(c.num_important, 2)]
        candidates = [(int(a), int(b)) for i, a in enumerate(pool) for b in pool[i + 1 :]]
        if len(candidates) < c.num_interactions:
            candidates = [(int(a), int(b)) for i, a in enumerate(order) for b in order[i + 1 :]]
        chosen = rng.choice(len(candidates), c.num_interactions, replace=False) if candidates else []
        pairs = [tuple(sorted(candidates[i])) for i in chosen]
        self.pairs = sorted(pairs)
        k = c.interaction_dim
        scale = math.sqrt(0.5 * s / math.sqrt(k))
        self.pair_u = [rng.normal(0.0, scale, (c.vocab_sizes[t], k)) for t, _ in self.pairs]
        self.pair_v = [rng.normal(0.0, scale, (c.vocab_sizes[u], k)) for _, u in self.pairs]
        self.cross_feature = int(order[min(2, ns - 1)])  # its categories modulate dense feature 0's slope
        self.cross_w = rng.normal(0.0, 0.4 * s, c.vocab_sizes[self.cross_feature])
        # standardize the transformed dense features, then calibrate the intercept, on a calibration sample
        self.dense_mean, self.dense_std, self.bias = np.zeros(nd), np.ones(nd), 0.0
        ints, cats, _ = self._features(np.random.default_rng(np.random.SeedSequence([c.teacher_seed, 0xCA1])), 65536)
        f = log_transform(ints).astype(np.float64)
        self.dense_mean, self.dense_std = f.mean(0), f.std(0) + 1e-6
        z = self.logit(ints, cats)
        lo, hi = -30.0, 30.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if _sigmoid(z + mid).mean() < c.ctr else (lo, mid)
        self.bias = 0.5 * (lo + hi)

    def _features(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Raw features of n rows: ints int64 [n, nd] (missing -> -1 marker in `missing`), cats [n, ns] (-1 =
        missing), and the dense-missing mask."""
        c = self.config
        z = rng.standard_normal((n, c.num_dense))
        ints = np.floor(np.exp(self.dense_mu + self.dense_sigma * z)).astype(np.int64)
        dense_missing = rng.random((n, c.num_dense)) < c.dense_missing
        ints[dense_missing] = 0
        u = rng.random((n, c.num_sparse))
        cats = np.empty((n, c.num_sparse), dtype=np.int64)
        for t, cdf in enumerate(self.cdf):
            cats[:, t] = np.minimum(np.searchsorted(cdf, u[:, t]), len(cdf) - 1)
        cats[rng.random((n, c.num_sparse)) < c.sparse_missing] = -1
        return ints, cats, dense_missing

    def logit(self, ints: np.ndarray, cats: np.ndarray) -> np.ndarray:
        """Teacher logit from what a model sees: log-transformed integers (missing = 0) and categories."""
        f = (log_transform(ints) - self.dense_mean) / self.dense_std
        z = self.bias + f @ self.dense_w + self.dense_pair * f[:, 0] * f[:, 1]
        present = cats >= 0
        safe = np.where(present, cats, 0)
        for t, table in enumerate(self.main):
            z += np.where(present[:, t], table[safe[:, t]], 0.0)
        for (t, u), pu, pv in zip(self.pairs, self.pair_u, self.pair_v):
            both = present[:, t] & present[:, u]
            z += np.where(both, np.einsum("nk,nk->n", pu[safe[:, t]], pv[safe[:, u]]), 0.0)
        x = self.cross_feature
        z += np.where(present[:, x], self.cross_w[safe[:, x]], 0.0) * f[:, 0]
        return z

    def chunk(self, seed: int, split: int, k: int, n: int = CHUNK_ROWS):
        """Rows of chunk k of stream (seed, split): (ints, dense_missing, cats, label float32, prob float32)."""
        rng = np.random.default_rng(np.random.SeedSequence([seed, split, k]))
        ints, cats, dense_missing = self._features(rng, CHUNK_ROWS)
        prob = _sigmoid(self.logit(ints, cats))
        label = (rng.random(CHUNK_ROWS) < prob).astype(np.float32)
        return ints[:n], dense_missing[:n], cats[:n], label[:n], prob[:n].astype(np.float32)

    def bucket_tables(self, data: DataConfig) -> list[np.ndarray]:
        """Per feature: category id -> hash bucket, exactly as `CriteoReader` hashes the written strings."""
        out = []
        for tokens, size in zip(self.tokens, data.table_sizes):
            buf = np.frombuffer(tokens.tobytes(), dtype=np.uint8)
            starts = np.arange(len(tokens), dtype=np.int64) * 8
            out.append(hash_tokens(buf, starts, np.full(len(tokens), 8, dtype=np.int64), size))
        return out


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


_TEACHERS: dict[tuple, Teacher] = {}


def get_teacher(config: SynthConfig) -> Teacher:
    """The teacher of `config`, built once per process (building one costs ~0.1 s)."""
    key = tuple(getattr(config, f) for f in SynthConfig.__slots__)
    if key not in _TEACHERS:
        _TEACHERS[key] = Teacher(config)
    return _TEACHERS[key]


def _check(data: DataConfig, synth: SynthConfig) -> None:
    if (synth.num_dense, synth.num_sparse) != (data.num_dense, data.num_sparse):
        raise ValueError(
            f"SynthConfig has {synth.num_dense} dense / {synth.num_sparse} sparse features but the DataConfig "
            f"has {data.num_dense} / {data.num_sparse}"
        )


class SyntheticStream:
    """Batches of one shard of the synthetic stream (seed, split), the same interface as `CriteoReader`.

    rows: size of the whole (unsharded) data set, None = endless. skip_rows / max_rows / .position count
    this shard's examples, as in CriteoReader.
    """

    def __init__(
        self,
        data: DataConfig,
        *,
        seed: int | None = None,
        split: int = TRAIN,
        rows: int | None = None,
        shard: tuple[int, int] = (0, 1),
        batch_size: int | None = None,
        skip_rows: int = 0,
        max_rows: int | None = None,
        synth: SynthConfig | None = None,
    ) -> None:
        self.synth = data.synth if synth is None else synth
        _check(data, self.synth)
        index, count = shard
        if not (isinstance(count, int) and count >= 1 and isinstance(index, int) and 0 <= index < count):
            raise ValueError(f"SyntheticStream: shard={shard!r}: expected (index, count) with 0 <= index < count")
        self.data, self.split, self.rows, self.shard = data, split, rows, shard
        self.seed = data.seed if seed is None else seed
        self.batch_size = data.batch_size if batch_size is None else batch_size
        if self.batch_size < 1 or skip_rows < 0 or (max_rows is not None and max_rows < 0):
            raise ValueError(
                f"SyntheticStream: batch_size={self.batch_size!r}, skip_rows={skip_rows!r}, max_rows={max_rows!r}: "
                "expected batch_size >= 1 and non-negative row counts"
            )
        self.skip_rows, self.max_rows = skip_rows, max_rows
        self.teacher = get_teacher(self.synth)
        self._lut = self.teacher.bucket_tables(data)
        self.position, self.bad_lines, self.bad_examples = 0, 0, []

    def _chunk_rows(self, k: int) -> int:
        if self.rows is None:
            return CHUNK_ROWS
        return max(0, min(CHUNK_ROWS, self.rows - k * CHUNK_ROWS))

    def _tensors(self, k: int, n: int):
        ints, _, cats, label, prob = self.teacher.chunk(self.seed, self.split, k, n)
        sparse = np.zeros(cats.shape, dtype=np.int64)
        for t, lut in enumerate(self._lut):
            present = cats[:, t] >= 0
            sparse[present, t] = lut[cats[present, t]]
        return log_transform(ints), sparse, label, prob

    def __iter__(self) -> Iterator[Batch]:
        index, count = self.shard
        self.position = skipped = 0
        left = self.max_rows if self.max_rows is not None else math.inf
        pending: list[tuple[np.ndarray, ...]] = []
        n_pending, k = 0, index
        while left > 0:
            n = self._chunk_rows(k)
            if n == 0:
                break
            start = min(n, self.skip_rows - skipped)
            skipped += start
            self.position += start
            take = int(min(n - start, left))
            if take > 0:
                cols = self._tensors(k, n)
                pending.append(tuple(c[start : start + take] for c in cols))
                n_pending += take
                left -= take
            k += count
            while n_pending >= self.batch_size or (n_pending and (left <= 0 or self._chunk_rows(k) == 0)):
                b = min(n_pending, self.batch_size)
                cols = [np.concatenate(p) if len(pending) > 1 else p[0] for p in zip(*pending)]
                pending = [tuple(c[b:] for c in cols)] if n_pending > b else []
                n_pending -= b
                self.position += b
                yield Batch(*(torch.from_numpy(np.ascontiguousarray(c[:b])) for c in cols))


@dataclass(slots=True)
class SyntheticDataset:
    """A whole synthetic data set in memory (tensors), e.g. a held-out set or a test fixture."""

    dense: torch.Tensor
    sparse: torch.Tensor
    label: torch.Tensor
    prob: torch.Tensor

    def __len__(self) -> int:
        return int(self.label.shape[0])

    def batches(self, batch_size: int) -> Iterator[Batch]:
        for i in range(0, len(self), batch_size):
            s = slice(i, i + batch_size)
            yield Batch(self.dense[s], self.sparse[s], self.label[s], self.prob[s])


def make_synthetic_dataset(
    rows: int, seed: int = 0, data: DataConfig | None = None, *, split: int = TRAIN
) -> SyntheticDataset:
    """The first `rows` rows of stream (seed, split) as tensors (identical to reading `write_synthetic`'s file)."""
    data = DataConfig() if data is None else data
    stream = SyntheticStream(data, seed=seed, split=split, rows=rows, batch_size=max(rows, 1))
    parts = list(stream)
    if not parts:
        raise ValueError(f"make_synthetic_dataset: rows={rows!r}: expected a positive integer")
    b = parts[0]
    return SyntheticDataset(b.dense, b.sparse, b.label, b.prob)


def write_synthetic(
    path: str | os.PathLike, rows: int, seed: int = 0, *, synth: SynthConfig | None = None, split: int = TRAIN
) -> dict:
    """Write `rows` rows of stream (seed, split) to `path` in the Criteo format (gzip if it ends in .gz) and
    their true click probabilities to `prob_sidecar_path(path)`. Returns {rows, ctr, bayes_ne, expected_ne}."""
    path = os.fspath(path)
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"write_synthetic: rows={rows!r}: expected a positive integer")
    synth = SynthConfig() if synth is None else synth
    teacher = get_teacher(synth)
    tokens = [np.append(t.astype(str), "") for t in teacher.tokens]  # index -1 -> '' (missing)
    probs = np.empty(rows, dtype=np.float32)
    labels = np.empty(rows, dtype=np.float32)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt", encoding="ascii", newline="\n",
                **({"compresslevel": 4} if path.endswith(".gz") else {})) as f:
        for k in range(math.ceil(rows / CHUNK_ROWS)):
            n = min(CHUNK_ROWS, rows - k * CHUNK_ROWS)
            ints, dense_missing, cats, label, prob = teacher.chunk(seed, split, k, n)
            cols = [np.where(label > 0, "1", "0").tolist()]
            int_str = np.where(dense_missing, "", ints.astype(str))
            cols += [int_str[:, d].tolist() for d in range(ints.shape[1])]
            cols += [tokens[t][cats[:, t]].tolist() for t in range(cats.shape[1])]
            f.write("\n".join("\t".join(r) for r in zip(*cols)))
            f.write("\n")
            probs[k * CHUNK_ROWS : k * CHUNK_ROWS + n] = prob
            labels[k * CHUNK_ROWS : k * CHUNK_ROWS + n] = label
    np.save(prob_sidecar_path(path), probs)
    from cocosync.shadowsync.metrics import normalized_entropy

    ctr = float(labels.mean())
    bayes = normalized_entropy(labels, probs) if 0 < ctr < 1 else float("nan")
    return {"rows": rows, "ctr": ctr, "bayes_ne": bayes, "expected_ne": expected_ne(probs)}
