"""A model's tables as the job stores them (`TablePlan`), and the model with its tables swapped for those stores.

The plan lists every table of the model's `EmbeddingBagCollection`s (tables.py) in module order, with its rows,
width, pooling and features. The job stores all of them as one row space (tables concatenated, `offsets`), sharded
by row hash (shard.py); a row is stored `width` wide, the widest table's width: a narrower table uses the first
`embedding_dim` columns of its rows. That keeps one row format for every store (local shards, the exchange, the node
relay, hot rows, checkpoints) at the cost of the padding's bytes (none when all tables have one width, the usual
case). Row-wise Adagrad stays exact for narrow rows: `fill_padding` gives a row's padding columns the root mean
square of its real gradient, so the accumulator's mean over the stored width equals the mean over the table's own
width; the padding columns are never read.

`shard_model` replaces each collection by a `ShardedCollection` that pools from the rows a lookup fetched
(`TablePlan.looked_up`), and each plain torch.nn.EmbeddingBag by a `ShardedBag` that returns its feature's pooled
vectors of the batch being trained (`active`); every other parameter of the model stays: the dense part that the
sync averages.
`load_tables` does the reverse: the model's own collections take the full tables (scoring, export).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from cocosync.shadowsync.model.embeddings import gather_rows
from cocosync.shadowsync.model.tables import POOLINGS, EmbeddingBagCollection, KeyedJaggedTensor, KeyedTensor

__all__ = ["TableSpec", "TablePlan", "ShardedCollection", "ShardedBag", "LookedUp", "active", "shard_model",
           "load_tables", "table_weights"]


@dataclass(frozen=True)
class TableSpec:
    """One table of the plan: the module path of its collection (or of the plain EmbeddingBag it is), name, rows,
    width, pooling and features."""

    module: str
    name: str
    rows: int
    dim: int
    pooling: str
    features: tuple[str, ...]
    bag: bool = False


class LookedUp(KeyedJaggedTensor):
    """A batch's features with their pooled vectors (what a `ShardedCollection` returns, sliced to its features)."""

    __slots__ = ("pooled",)

    @classmethod
    def of(cls, features: KeyedJaggedTensor, pooled: KeyedTensor) -> "LookedUp":
        out = cls.__new__(cls)
        for slot in KeyedJaggedTensor.__slots__:
            object.__setattr__(out, slot, getattr(features, slot))
        out.pooled = pooled
        return out


class TablePlan:
    """The tables of a model, as the job stores them: one row space of `total_rows` rows `width` wide."""

    def __init__(self, tables: Sequence[TableSpec]):
        self.tables = tuple(tables)
        if not self.tables:
            raise ValueError("the model has no embedding tables: ShadowSync trains models whose tables are in an "
                             "EmbeddingBagCollection (cocosync.shadowsync.EmbeddingBagCollection)")
        names = [t.name for t in self.tables]
        if len(set(names)) < len(names):
            raise ValueError(f"table names repeat across the model's collections: {names}")
        self.width = max(t.dim for t in self.tables)
        self.table_rows = tuple(t.rows for t in self.tables)
        starts = [0]
        for t in self.tables[:-1]:
            starts.append(starts[-1] + t.rows)
        self.table_offsets = torch.tensor(starts, dtype=torch.int64)
        self.total_rows = sum(self.table_rows)
        self.features: tuple[str, ...] = tuple(f for t in self.tables for f in t.features)
        if len(set(self.features)) < len(self.features):
            dup = sorted({f for f in self.features if self.features.count(f) > 1})
            raise ValueError(f"feature(s) {dup} are served by more than one table")
        table_of = [i for i, t in enumerate(self.tables) for _ in t.features]
        self.feature_table = dict(zip(self.features, table_of))
        self.feature_offsets = self.table_offsets[torch.tensor(table_of)]
        self.feature_dims = tuple(self.tables[i].dim for i in table_of)
        self.feature_rows = tuple(self.tables[i].rows for i in table_of)
        self.padded = any(t.dim != self.width for t in self.tables)
        means = [self.tables[i].pooling == "mean" for i in table_of]
        self._mean = torch.tensor(means) if any(means) else None
        self._dims = torch.tensor([t.dim for t in self.tables], dtype=torch.int64)

    @classmethod
    def of(cls, model: nn.Module) -> "TablePlan":
        """The tables of every EmbeddingBagCollection in `model`, and every torch.nn.EmbeddingBag outside one (a
        table named by its module path, serving the feature of its attribute's name), in module order."""
        specs = []
        inside: set[int] = set()
        for path, m in model.named_modules():
            if isinstance(m, EmbeddingBagCollection):
                specs += [TableSpec(path, t.name, t.num_embeddings, t.embedding_dim, t.pooling, t.feature_names)
                          for t in m.tables]
                inside.update(id(b) for b in m.modules())
            elif isinstance(m, nn.EmbeddingBag) and id(m) not in inside:
                if m.mode not in POOLINGS or m.padding_idx is not None:
                    raise ValueError(f"{path}: an EmbeddingBag with mode={m.mode!r}, padding_idx={m.padding_idx!r}; "
                                     f"the job's tables pool by {POOLINGS} without a padding row")
                specs.append(TableSpec(path, path, m.num_embeddings, m.embedding_dim, m.mode,
                                       (path.rpartition(".")[2],), bag=True))
        return cls(specs)

    def describe(self) -> str:
        """One line per table (a run's first lines)."""
        pad = f"; stored {self.width} wide" if self.padded else ""
        return "\n".join(f"table {t.name}: {t.rows:,} rows x {t.dim}, {t.pooling}, features {', '.join(t.features)}"
                         f"{pad if t.dim != self.width else ''}" for t in self.tables)

    # -- the lookup path -----------------------------------------------------------------------------------
    def row_ids(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """The global rows of a batch's ids: [B, F] for single-valued features, else [N, 1]."""
        if features.is_dense():
            return features.dense_ids() + self.feature_offsets
        per_value = self.feature_offsets.repeat_interleave(torch.tensor(features.length_per_key()))
        return (features.values() + per_value).view(-1, 1)

    def looked_up(self, features: KeyedJaggedTensor, rows: torch.Tensor, inverse: torch.Tensor) -> LookedUp:
        """The batch's features with their pooled vectors from the distinct `rows` [U, width] a lookup fetched
        (`inverse`: each id's position in them, as `row_ids` laid the ids out)."""
        B = features.stride()
        if features.is_dense():
            vectors = gather_rows(rows, inverse)  # [B, F, width]
        else:
            lengths = features.lengths()
            weights = None
            if self._mean is not None:
                per_bag = torch.where(self._mean.repeat_interleave(B), 1.0 / lengths.clamp(min=1), 1.0)
                weights = per_bag.repeat_interleave(lengths).to(rows.dtype)
            # each id's row, summed into its bag: the backward is an index_select and one index_add_ (30% faster
            # than F.embedding_bag's dense backward at 26 features x 256 rows, one of them a list of 1-50); bag
            # f * B + b (feature-major, as the ids come) is pooled into row b * F + f: [B, F, width] with no copy
            F_ = len(self.features)
            bag = torch.arange(lengths.numel())
            bags = torch.repeat_interleave((bag % B) * F_ + bag // B, lengths)
            values = gather_rows(rows, inverse.view(-1))
            if weights is not None:
                values = values * weights.unsqueeze(1)
            vectors = values.new_zeros(B * F_, self.width).index_add_(0, bags, values).view(B, F_, self.width)
        if self.padded:
            values = torch.cat([vectors[:, f, :d] for f, d in enumerate(self.feature_dims)], dim=1)
        else:
            values = vectors.reshape(B, -1)
        return LookedUp.of(features, KeyedTensor(self.features, self.feature_dims, values))

    @torch.no_grad()
    def fill_padding(self, uniq: torch.Tensor, grads: torch.Tensor) -> None:
        """Give the padding columns of narrow tables' gradient rows the root mean square of their real columns
        (row-wise Adagrad's mean over the stored width is then the mean over the table's width)."""
        if not self.padded:
            return
        table = torch.searchsorted(self.table_offsets, uniq, right=True) - 1
        dims = self._dims[table]
        cols = torch.arange(self.width)
        real = cols.unsqueeze(0) < dims.unsqueeze(1)
        rms = (grads.pow(2) * real).sum(1).div_(dims).sqrt_()
        grads.copy_(torch.where(real, grads, rms.unsqueeze(1)))

    # -- whole tables ---------------------------------------------------------------------------------------
    def split_table(self, table: torch.Tensor) -> dict[str, torch.Tensor]:
        """The whole row space [total_rows, width] as {table name: [rows, dim]} (views)."""
        out = {}
        for t, start in zip(self.tables, self.table_offsets.tolist()):
            out[t.name] = table[start:start + t.rows, :t.dim]
        return out


_ACTIVE: contextvars.ContextVar[LookedUp | None] = contextvars.ContextVar("looked_up", default=None)


@contextlib.contextmanager
def active(features: LookedUp) -> Iterator[None]:
    """The batch whose pooled vectors the model's `ShardedBag`s return while the model runs on it (this thread)."""
    token = _ACTIVE.set(features)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class ShardedBag(nn.Module):
    """Stands for a torch.nn.EmbeddingBag whose table lives in the job's stores: called as the bag was (ids and
    offsets of its feature), it returns that feature's pooled vectors of the batch being trained (`active`)."""

    def __init__(self, feature: str, path: str):
        super().__init__()
        self.feature, self.path = feature, path

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        looked = _ACTIVE.get()
        if looked is None:
            raise TypeError(f"{self.path}: this EmbeddingBag's table lives on the job's embedding servers; it is "
                            "called only while the job trains the model")
        if per_sample_weights is not None:
            raise ValueError(f"{self.path}: per_sample_weights are not supported for tables the job stores")
        bags = input.shape[0] if input.dim() == 2 else (offsets.numel() if offsets is not None else 0)
        pooled = looked.pooled[self.feature]
        if bags not in (pooled.shape[0], pooled.shape[0] + 1):
            raise ValueError(f"{self.path}: called with {bags} bags, but the batch has {pooled.shape[0]} rows: pass "
                             f"it the batch's feature {self.feature!r} (features[{self.feature!r}].values and its "
                             "offsets)")
        return pooled


class ShardedCollection(nn.Module):
    """Stands for an EmbeddingBagCollection whose tables live in the job's stores: forward(features) returns the
    pooled vectors of its features that the trainer's lookup attached (`LookedUp`)."""

    def __init__(self, features: Sequence[str], path: str):
        super().__init__()
        self.features, self.path = tuple(features), path

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if not isinstance(features, LookedUp):
            raise TypeError(f"{self.path}: the tables of this collection live on the job's embedding servers; the "
                            "model must pass the KeyedJaggedTensor it was given to the collection unchanged")
        return features.pooled.select(self.features)


def _swap(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, new)


def shard_model(model: nn.Module) -> tuple[nn.Module, TablePlan]:
    """`model` with its EmbeddingBagCollections swapped for ShardedCollections (in place), and their plan. The model
    itself may not be a collection."""
    plan = TablePlan.of(model)
    for t in plan.tables:
        if not t.module:
            raise ValueError("the model is an EmbeddingBagCollection itself: ShadowSync trains a model that holds "
                             "one (with dense layers after it)")
        if t.bag:
            _swap(model, t.module, ShardedBag(t.features[0], t.module))
        elif not isinstance(model.get_submodule(t.module), ShardedCollection):
            _swap(model, t.module, ShardedCollection(model.get_submodule(t.module).feature_names(), t.module))
    return model, plan


def table_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """The weight of every table of the model (TablePlan.of's tables), by table name."""
    out, inside = {}, set()
    for path, m in model.named_modules():
        if isinstance(m, EmbeddingBagCollection):
            out.update({t.name: m.embedding_bags[t.name].weight for t in m.tables})
            inside.update(id(b) for b in m.modules())
        elif isinstance(m, nn.EmbeddingBag) and id(m) not in inside:
            out[path] = m.weight
    return out


@torch.no_grad()
def load_tables(model: nn.Module, plan: TablePlan, table: torch.Tensor) -> nn.Module:
    """Copy the whole row space [total_rows, width] into the model's own tables (the model as written, scoring
    without the job's stores)."""
    weights = table_weights(model)
    for name, rows in plan.split_table(table).items():
        weights[name].copy_(rows)
    return model
