"""The model-facing table API, in TorchRec's names and layouts: a model written for one process declares its tables
as an `EmbeddingBagCollection` of `EmbeddingBagConfig`s and takes its categorical inputs as a `KeyedJaggedTensor`;
the collection returns a `KeyedTensor` of pooled vectors, one block of columns per feature.

* `KeyedJaggedTensor`: F features over a batch of B rows, feature-major: `values()` holds every id, `lengths()` the
  F*B bag sizes (feature 0's B bags first). A batch of single-valued features is held as its [B, F] id matrix
  (`from_dense`), the values and lengths made only when asked.
* `EmbeddingBagCollection`: one `torch.nn.EmbeddingBag` per table (`embedding_bags[name]`); a table can serve
  several features (shared tables); pooling is "sum" or "mean" (an empty bag pools to zeros).

A ShadowSync job keeps the model as written and swaps each collection for its sharded stores (sharding.py), as
TorchRec's DistributedModelParallel does; the same model with its full tables loaded scores rows on its own.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EmbeddingBagConfig", "KeyedJaggedTensor", "JaggedTensor", "KeyedTensor", "EmbeddingBagCollection",
           "POOLINGS", "tables_on_meta"]

POOLINGS = ("sum", "mean")
_TABLES_ON_META = contextvars.ContextVar("tables_on_meta", default=False)


@contextlib.contextmanager
def tables_on_meta() -> Iterator[None]:
    """Collections built inside allocate no rows (their tables on the meta device): a job builds the model only to
    swap its tables for the job's stores, whose rows it allocates itself."""
    token = _TABLES_ON_META.set(True)
    try:
        yield
    finally:
        _TABLES_ON_META.reset(token)


@dataclass(frozen=True)
class EmbeddingBagConfig:
    """One table: `num_embeddings` rows of width `embedding_dim`, pooled by `pooling` ('sum' or 'mean'), serving
    the features `feature_names` (TorchRec's EmbeddingBagConfig)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling: str = "sum"

    def __post_init__(self) -> None:
        if isinstance(self.feature_names, (list, str)):
            names = (self.feature_names,) if isinstance(self.feature_names, str) else tuple(self.feature_names)
            object.__setattr__(self, "feature_names", names)
        where = f"EmbeddingBagConfig(name={self.name!r})"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"EmbeddingBagConfig: name={self.name!r}: expected a non-empty string")
        for field_name in ("num_embeddings", "embedding_dim"):
            v = getattr(self, field_name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{where}: {field_name}={v!r}: expected an integer >= 1")
        if not self.feature_names or not all(isinstance(f, str) and f for f in self.feature_names):
            raise ValueError(f"{where}: feature_names={self.feature_names!r}: expected one or more feature names")
        if self.pooling not in POOLINGS:
            raise ValueError(f"{where}: pooling={self.pooling!r}: expected one of {POOLINGS}")


@dataclass(frozen=True)
class JaggedTensor:
    """One feature of a batch: `values` [N] and `lengths` [B] (row i's ids are values[offsets[i]:offsets[i+1]])."""

    values: torch.Tensor
    lengths: torch.Tensor

    def offsets(self) -> torch.Tensor:
        return _offsets(self.lengths)

    def to_list(self) -> list[list[int]]:
        return [v.tolist() for v in torch.split(self.values, self.lengths.tolist())]


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


class KeyedJaggedTensor:
    """Features `keys` of a batch of `stride()` rows: ids `values()` and bag sizes `lengths()` [F * B], feature-major
    (TorchRec's layout). `from_dense(keys, ids)` holds single-valued features as their [B, F] ids."""

    __slots__ = ("_keys", "_values", "_lengths", "_dense", "_stride", "_index")

    def __init__(self, keys: Sequence[str], values: torch.Tensor, lengths: torch.Tensor, *, stride: int | None = None):
        self._keys = tuple(keys)
        self._values, self._lengths, self._dense = values, lengths, None
        if lengths.dim() != 1 or (self._keys and lengths.numel() % len(self._keys)):
            raise ValueError(f"KeyedJaggedTensor: lengths has shape {tuple(lengths.shape)}: expected "
                             f"[features x batch] = [{len(self._keys)} x B]")
        self._stride = stride if stride is not None else (lengths.numel() // len(self._keys) if self._keys else 0)
        self._index: dict[str, int] | None = None
        if values.dim() != 1:
            raise ValueError(f"KeyedJaggedTensor: values has shape {tuple(values.shape)}: expected one dimension")

    @classmethod
    def from_dense(cls, keys: Sequence[str], ids: torch.Tensor) -> "KeyedJaggedTensor":
        """Single-valued features: ids [B, F], column f the ids of feature keys[f]."""
        if ids.dim() != 2 or ids.shape[1] != len(keys):
            raise ValueError(f"KeyedJaggedTensor.from_dense: ids has shape {tuple(ids.shape)}: expected "
                             f"[B, {len(keys)}] for keys {tuple(keys)}")
        out = cls.__new__(cls)
        out._keys, out._values, out._lengths, out._dense = tuple(keys), None, None, ids
        out._stride, out._index = int(ids.shape[0]), None
        return out

    @classmethod
    def from_lists(cls, features: Mapping[str, Sequence[Sequence[int]]]) -> "KeyedJaggedTensor":
        """From {feature: [ids of row 0, ids of row 1, ...]} (every feature over the same rows)."""
        keys = list(features)
        lengths, values = [], []
        for k in keys:
            for row in features[k]:
                lengths.append(len(row))
                values.extend(int(v) for v in row)
        return cls(keys, torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64))

    @classmethod
    def concat_features(cls, parts: Iterable["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":
        """The features of several KJTs over the same rows, in order."""
        parts = list(parts)
        if all(p.is_dense() for p in parts):
            return cls.from_dense([k for p in parts for k in p.keys()], torch.cat([p.dense_ids() for p in parts], 1))
        return cls([k for p in parts for k in p.keys()], torch.cat([p.values() for p in parts]),
                   torch.cat([p.lengths() for p in parts]), stride=parts[0].stride())

    def keys(self) -> tuple[str, ...]:
        return self._keys

    def stride(self) -> int:
        return self._stride

    def is_dense(self) -> bool:
        """Whether every feature has exactly one id per row, held as [B, F]."""
        return self._dense is not None

    def dense_ids(self) -> torch.Tensor:
        """The [B, F] ids of single-valued features."""
        if self._dense is None:
            raise ValueError("KeyedJaggedTensor.dense_ids: the features are multi-valued (use values()/lengths())")
        return self._dense

    def values(self) -> torch.Tensor:
        if self._values is None:
            self._values = self._dense.t().reshape(-1)
        return self._values

    def lengths(self) -> torch.Tensor:
        if self._lengths is None:
            self._lengths = torch.ones(self._dense.numel(), dtype=torch.int64)
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return _offsets(self.lengths())

    def length_per_key(self) -> list[int]:
        if self._dense is not None:
            return [self._stride] * len(self._keys)
        return self.lengths().view(len(self._keys), self._stride).sum(1).tolist()

    def _key_index(self, key: str) -> int:
        if self._index is None:
            self._index = {k: i for i, k in enumerate(self._keys)}
        try:
            return self._index[key]
        except KeyError:
            raise KeyError(f"KeyedJaggedTensor has no feature {key!r}; its features are {list(self._keys)}") from None

    def __getitem__(self, key: str) -> JaggedTensor:
        f, B = self._key_index(key), self._stride
        if self._dense is not None:
            return JaggedTensor(self._dense[:, f].contiguous(), torch.ones(B, dtype=torch.int64))
        lengths = self.lengths().view(len(self._keys), B)
        start = int(lengths[:f].sum())
        return JaggedTensor(self.values()[start:start + int(lengths[f].sum())], lengths[f])

    def to_dict(self) -> dict[str, JaggedTensor]:
        return {k: self[k] for k in self._keys}

    def head(self, rows: int) -> "KeyedJaggedTensor":
        """The first `rows` rows of every feature."""
        if self._dense is not None:
            return KeyedJaggedTensor.from_dense(self._keys, self._dense[:rows])
        parts = [self[k] for k in self._keys]
        values = [j.values[:int(j.lengths[:rows].sum())] for j in parts]
        return KeyedJaggedTensor(self._keys, torch.cat(values), torch.cat([j.lengths[:rows] for j in parts]),
                                 stride=min(rows, self._stride))

    def __repr__(self) -> str:
        form = "single-valued" if self._dense is not None else f"{self.values().numel()} ids"
        return f"KeyedJaggedTensor(keys={list(self._keys)}, batch={self._stride}, {form})"


class KeyedTensor:
    """Pooled vectors of several features: `values()` [B, sum of widths], feature `keys()[i]` in the i-th block of
    `length_per_key()[i]` columns (TorchRec's KeyedTensor)."""

    __slots__ = ("_keys", "_lengths", "_values")

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: torch.Tensor):
        self._keys, self._lengths, self._values = tuple(keys), tuple(int(n) for n in length_per_key), values
        if values.dim() != 2 or values.shape[1] != sum(self._lengths):
            raise ValueError(f"KeyedTensor: values has shape {tuple(values.shape)}: expected [B, "
                             f"{sum(self._lengths)}]")

    def keys(self) -> tuple[str, ...]:
        return self._keys

    def length_per_key(self) -> tuple[int, ...]:
        return self._lengths

    def values(self) -> torch.Tensor:
        return self._values

    def to_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self._keys, self._values.split(list(self._lengths), dim=1)))

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            i = self._keys.index(key)
        except ValueError:
            raise KeyError(f"KeyedTensor has no feature {key!r}; its features are {list(self._keys)}") from None
        start = sum(self._lengths[:i])
        return self._values[:, start:start + self._lengths[i]]

    def select(self, keys: Sequence[str]) -> "KeyedTensor":
        """The features `keys`, in that order (itself when they are its own)."""
        if tuple(keys) == self._keys:
            return self
        d = self.to_dict()
        return KeyedTensor(keys, [d[k].shape[1] for k in keys], torch.cat([d[k] for k in keys], dim=1))


class _Bags(nn.Module):
    """The tables by name (`bags[name]`; state_dict keys `embedding_bags.<name>.weight`, as TorchRec's)."""

    def __getitem__(self, name: str) -> nn.EmbeddingBag:
        return self._modules[name]


class EmbeddingBagCollection(nn.Module):
    """Tables `tables` (EmbeddingBagConfig), each a torch.nn.EmbeddingBag in `embedding_bags[name]`:
    forward(features: KeyedJaggedTensor) -> KeyedTensor of every table's features, in table order.
    `init_std`: rows start N(0, init_std^2)."""

    def __init__(self, tables: Sequence[EmbeddingBagConfig], *, init_std: float = 0.05):
        super().__init__()
        self.tables = tuple(tables)
        if not self.tables:
            raise ValueError("EmbeddingBagCollection: no tables given")
        names = [t.name for t in self.tables]
        if len(set(names)) < len(names):
            raise ValueError(f"EmbeddingBagCollection: table names repeat: {names}")
        features = [f for t in self.tables for f in t.feature_names]
        if len(set(features)) < len(features):
            dup = sorted({f for f in features if features.count(f) > 1})
            raise ValueError(f"EmbeddingBagCollection: feature(s) {dup} are served by more than one table")
        self.embedding_bags = _Bags()
        device = torch.device("meta") if _TABLES_ON_META.get() else None
        for t in self.tables:
            if device is None:
                bag = nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling)
                nn.init.normal_(bag.weight, std=init_std)
            else:  # the rows live in the stores: no init (on meta, torch's init imports its compiler: ~1 s a process)
                bag = nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling,
                                      _weight=torch.empty(t.num_embeddings, t.embedding_dim, device=device))
            if hasattr(self.embedding_bags, t.name) or "." in t.name:
                raise ValueError(f"EmbeddingBagCollection: table name {t.name!r} cannot name a module (a"
                                 " torch.nn.Module attribute, or a dot): rename the table")
            self.embedding_bags.add_module(t.name, bag)

    def feature_names(self) -> tuple[str, ...]:
        return tuple(f for t in self.tables for f in t.feature_names)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        out, keys, dims = [], [], []
        for t in self.tables:
            weight = self.embedding_bags[t.name].weight
            for name in t.feature_names:
                jt = features[name]
                if features.is_dense():
                    out.append(F.embedding(jt.values, weight))
                else:
                    out.append(F.embedding_bag(jt.values, weight, jt.offsets()[:-1], mode=t.pooling))
                keys.append(name)
                dims.append(t.embedding_dim)
        return KeyedTensor(keys, dims, torch.cat(out, dim=1))
