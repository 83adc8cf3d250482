"""Parquet and CSV files with named columns, read with pyarrow: a `TabularSchema` says which column is the label,
which are dense (each with its transform) and which are categorical (one value per row, or a list), and how many
table rows each categorical needs; `infer_schema` finds it from the column types and a sample of rows, and
`TabularReader` streams a file's rows as batches.

* Column kinds by type: list columns are list features; string, dictionary and boolean columns, and integer columns
  named `id` or `*_id`/`*Id`, are categorical; the other numeric columns are dense. `--categorical`, `--list-columns`
  and `--dense` name them instead; a CSV list column holds its values joined by `|`.
* Categorical values (strings, or integers by their decimal text) are hashed into [1, rows) as the Criteo reader
  hashes its tokens (`hash_tokens`); a missing value is row 0, a missing list an empty bag.
* A table's rows default to the power of two >= ROWS_PER_VALUE x the distinct values of the sample (>= 16, at most
  `max_table_rows`): hashed values then share a row ~1/ROWS_PER_VALUE of the time; `table_size` given by the user
  wins.
* Dense transforms, per column: `standardize` ((x - mean) / std over the sample; the default), `log`
  (sign(x) log(1 + |x|)), `none`. Nulls are 0 after the transform.
* Sharding: with `row_range` (a training run's share of the budget) shard (i, n) of Parquet files owns the
  contiguous rows [lo, hi) it names and reads only the row groups holding them (the
  rows after the budget stay held out); otherwise (CSV, held-out reads) it owns the rows whose index l has
  l % n == i, scanning the file as Criteo's `split="lines"`. A row whose label is missing or not 0/1 is skipped and
  counted in `.bad_lines`.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from cocosync.shadowsync.data.criteo import Batch, hash_tokens
from cocosync.shadowsync.model.tables import KeyedJaggedTensor

__all__ = ["DenseColumn", "FeatureColumn", "TabularSchema", "TabularError", "TabularReader", "infer_schema",
           "data_format", "count_rows", "column_names", "TRANSFORMS", "LABEL_NAMES", "ROWS_PER_VALUE"]

log = logging.getLogger("cocosync.shadowsync.data")

TRANSFORMS = ("standardize", "log", "none")
LABEL_NAMES = ("label", "click", "clicked", "target", "y")
LIST_SEPARATOR = "|"
#: table rows per distinct value of a feature sized from the data. Test NE of the DLRM on MovieLens-100K against the
#: rows of its largest table (5 seeds; BENCHMARKS.md): ~6 rows per value -0.4 to -0.5% vs logistic regression,
#: ~10 -0.7%, ~19 -1.0%, ~39 -1.5 to -1.6%, ~78 -0.9%.
ROWS_PER_VALUE = 32
_ARROW_ROWS = 1 << 16  # rows per Arrow record batch read


class TabularError(ValueError):
    """A Parquet/CSV file that does not fit its schema (the message names the file and the column)."""


def data_format(path: str) -> str:
    """'parquet', 'csv' or 'criteo' (TSV, the default) by the file's suffix."""
    p = path.lower()
    if p.endswith((".parquet", ".pq")):
        return "parquet"
    if p.endswith((".csv", ".csv.gz")):
        return "csv"
    return "criteo"


@dataclass(frozen=True)
class DenseColumn:
    name: str
    transform: str = "standardize"
    mean: float = 0.0
    std: float = 1.0


@dataclass(frozen=True)
class FeatureColumn:
    name: str
    rows: int
    multi_valued: bool = False
    distinct: int = 0  # distinct values in the sample the rows were sized from (0: not counted)


@dataclass(frozen=True)
class TabularSchema:
    """How a Parquet/CSV file's rows become a batch."""

    format: str
    label: str
    dense: tuple[DenseColumn, ...]
    features: tuple[FeatureColumn, ...]
    sample_rows: int = 0

    def to_dict(self) -> dict:
        """As JSON holds it (lists, not tuples)."""
        out = asdict(self)
        out["dense"], out["features"] = list(out["dense"]), list(out["features"])
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> "TabularSchema":
        try:
            return cls(format=raw["format"], label=raw["label"],
                       dense=tuple(DenseColumn(**d) for d in raw["dense"]),
                       features=tuple(FeatureColumn(**f) for f in raw["features"]),
                       sample_rows=int(raw.get("sample_rows", 0)))
        except (KeyError, TypeError) as e:
            raise TabularError(f"a data schema must have format, label, dense and features ({e}): {raw!r}") from None

    @property
    def columns(self) -> list[str]:
        return [self.label, *(d.name for d in self.dense), *(f.name for f in self.features)]

    def describe(self) -> str:
        """The schema in a few lines (a run's first lines)."""
        dense = ", ".join(f"{d.name} ({d.transform})" for d in self.dense) or "none"
        cats = ", ".join(f"{f.name}{'[list]' if f.multi_valued else ''} -> {f.rows:,} rows"
                         + (f" ({f.distinct:,} distinct in {self.sample_rows:,} rows)" if f.distinct else "")
                         for f in self.features)
        return f"label: {self.label}\ndense: {dense}\ncategorical: {cats}"


# ---------------------------------------------------------------------------------------------- reading
def _pa():
    import pyarrow as pa
    import pyarrow.compute as pc

    return pa, pc


def _arrow_batches(path: str, columns: Sequence[str] | None, list_columns: Sequence[str] = ()) -> Iterator[Any]:
    """The file's rows as Arrow record batches of the named columns (all: None); CSV list columns split on '|'."""
    pa, pc = _pa()
    if data_format(path) == "parquet":
        import pyarrow.parquet as pq

        try:
            yield from pq.ParquetFile(path).iter_batches(batch_size=_ARROW_ROWS, columns=columns)
        except (pa.ArrowInvalid, OSError) as e:
            raise TabularError(f"{path}: not a readable Parquet file: {e}") from None
        return
    import pyarrow.csv as pcsv

    strings = {c: pa.string() for c in list_columns}
    try:
        reader = pcsv.open_csv(path, read_options=pcsv.ReadOptions(block_size=1 << 22),
                               convert_options=pcsv.ConvertOptions(include_columns=columns, column_types=strings))
        for rb in reader:
            if list_columns:
                arrays = [pc.split_pattern(rb.column(i), LIST_SEPARATOR) if name in list_columns else rb.column(i)
                          for i, name in enumerate(rb.schema.names)]
                rb = pa.RecordBatch.from_arrays(arrays, names=rb.schema.names)
            yield rb
    except (pa.ArrowInvalid, OSError) as e:
        raise TabularError(f"{path}: not a readable CSV file (a header line of column names, then rows): {e}") from None


def _arrow_schema(path: str) -> Any:
    pa, _ = _pa()
    if data_format(path) == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_schema(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise TabularError(f"{path}: not a readable Parquet file: {e}") from None
    first = next(_arrow_batches(path, None), None)
    if first is None:
        raise TabularError(f"{path}: no rows")
    return first.schema


def column_names(path: str) -> list[str]:
    """The columns of a Parquet/CSV file."""
    return list(_arrow_schema(path).names)


def _string_leaves(path: str, columns: Sequence[str]) -> list[str]:
    """The string columns among `columns` (not nested: pyarrow cannot read a list of dictionary-encoded strings
    into chunks): read dictionary-encoded, each distinct value is hashed once per record batch."""
    import pyarrow.parquet as pq

    schema = pq.ParquetFile(path).schema
    wanted = set(columns)
    return [c.path for c in (schema.column(i) for i in range(len(schema)))
            if c.path in wanted and c.physical_type == "BYTE_ARRAY"]


def count_rows(path: str) -> int:
    """Rows of a Parquet file (its metadata) or a CSV file (lines after the header)."""
    if data_format(path) == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return sum(rb.num_rows for rb in _arrow_batches(path, [_arrow_schema(path).names[0]]))


def _as_strings(array: Any) -> Any:
    pa, pc = _pa()
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    if not pa.types.is_string(array.type):
        array = pc.cast(array, pa.string())
    return array


def _hash_strings(array: Any, rows: int) -> np.ndarray:
    """Row ids in [1, rows) of string values (0: null or empty). A dictionary-encoded column (Parquet's usual
    encoding of repeated strings, read as such) hashes each distinct value once."""
    pa, _ = _pa()
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if pa.types.is_dictionary(array.type) and len(array) > len(array.dictionary):
        ids = _hash_strings(array.dictionary, rows)[np.asarray(array.indices.fill_null(0))]
        if array.null_count:
            ids[np.asarray(array.is_null())] = 0
        return ids
    array = _as_strings(array)
    n = len(array)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    _, offsets_buf, data_buf = array.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32)[array.offset:array.offset + n + 1].astype(np.int64)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None and data_buf.size else np.zeros(
        1, dtype=np.uint8)
    starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
    ids = hash_tokens(data, starts, lengths, rows)
    if array.null_count:
        ids[np.asarray(array.is_null())] = 0
    return ids


def _is_list(t: Any) -> bool:
    pa, _ = _pa()
    return pa.types.is_list(t) or pa.types.is_large_list(t)


@dataclass
class _Rows:
    """Converted rows: labels, transformed dense values, ids of single-valued features [n, F1], and per list feature
    (values, lengths)."""

    label: np.ndarray
    dense: np.ndarray
    single: np.ndarray
    lists: list[tuple[np.ndarray, np.ndarray]]

    def __len__(self) -> int:
        return len(self.label)

    @functools.cached_property
    def _offsets(self) -> list[np.ndarray]:
        """Each list feature's row starts in its values (one pass; slicing a chunk into batches then costs O(1))."""
        return [np.concatenate([[0], np.cumsum(lengths)]) for _, lengths in self.lists]

    def slice(self, a: int, b: int) -> "_Rows":
        lists = [(values[off[a]:off[b]], lengths[a:b]) for (values, lengths), off in zip(self.lists, self._offsets)]
        return _Rows(self.label[a:b], self.dense[a:b], self.single[a:b], lists)

    @staticmethod
    def concat(parts: list["_Rows"]) -> "_Rows":
        if len(parts) == 1:
            return parts[0]
        return _Rows(np.concatenate([p.label for p in parts]), np.concatenate([p.dense for p in parts]),
                     np.concatenate([p.single for p in parts]),
                     [(np.concatenate([p.lists[k][0] for p in parts]), np.concatenate([p.lists[k][1] for p in parts]))
                      for k in range(len(parts[0].lists))])


class TabularReader:
    """Iterate `Batch`es of one shard of Parquet/CSV file(s), in file order (CriteoReader's interface: `skip_rows`,
    `max_rows`, `.position`, `.bad_lines`). A batch's `sparse` is its [B, F] ids, or a KeyedJaggedTensor when the
    schema has list features."""

    def __init__(self, path_or_paths: str | os.PathLike | Sequence[str | os.PathLike], schema: TabularSchema, *,
                 shard: tuple[int, int] = (0, 1), batch_size: int = 256, skip_rows: int = 0,
                 max_rows: int | None = None, require_label: bool = True,
                 row_range: tuple[int, int] | None = None):
        paths = [path_or_paths] if isinstance(path_or_paths, (str, os.PathLike)) else list(path_or_paths)
        self.paths = [os.fspath(p) for p in paths]
        for p in self.paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"TabularReader: no such data file: {p!r}")
        self._table: Any = None
        self.schema, self.shard, self.batch_size = schema, shard, batch_size
        self.skip_rows, self.max_rows, self.require_label = skip_rows, max_rows, require_label
        self.row_range = row_range
        self._keys = tuple(f.name for f in schema.features)
        self._single = [i for i, f in enumerate(schema.features) if not f.multi_valued]
        self._multi = [i for i, f in enumerate(schema.features) if f.multi_valued]
        self.position = self.bad_lines = 0
        self.bad_examples: list[tuple[int, str]] = []

    @classmethod
    def of_rows(cls, table: Any, schema: TabularSchema, *, batch_size: int = 4096) -> "TabularReader":
        """A reader of rows in memory (a pyarrow.Table, or a {column: values} dict), the label optional."""
        pa, _ = _pa()
        reader = cls([], schema, batch_size=batch_size, require_label=False)
        reader._table = table if isinstance(table, pa.Table) else pa.table(dict(table))
        return reader

    def _selected(self) -> Iterator[tuple[str, Any, np.ndarray]]:
        """(path, record batch of this shard's rows, their 0-based row numbers over the files), in file order: a
        contiguous range read by row groups (`row_range`, Parquet), else every n-th row."""
        index, count = self.shard
        if self.row_range is not None and self._table is None and all(
                data_format(p) == "parquet" for p in self.paths):
            yield from self._range(*self.row_range)
            return
        seen = 0
        for path, record_batches in self._record_batches():
            for rb in record_batches:
                first = (index - seen) % count
                seen += rb.num_rows
                if first >= rb.num_rows:
                    continue
                taken = np.arange(first, rb.num_rows, count)
                yield path, rb.take(taken), seen - rb.num_rows + taken

    def _range(self, lo: int, hi: int) -> Iterator[tuple[str, Any, np.ndarray]]:
        """Rows [lo, hi) over the Parquet files, reading only the row groups that hold them."""
        import pyarrow.parquet as pq

        base = 0
        for path in self.paths:
            pf = pq.ParquetFile(path, read_dictionary=_string_leaves(path, [f.name for f in self.schema.features]))
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            starts = np.concatenate([[0], np.cumsum(sizes)]) + base
            groups = [g for g in range(len(sizes)) if starts[g] < hi and starts[g + 1] > lo]
            if groups:
                at = int(starts[groups[0]])
                for rb in pf.iter_batches(batch_size=_ARROW_ROWS, row_groups=groups,
                                          columns=self._columns(path, pf.schema_arrow.names)):
                    a, b = max(lo, at), min(hi, at + rb.num_rows)
                    if a < b:
                        yield path, rb.slice(a - at, b - a), np.arange(a, b)
                    at += rb.num_rows
            base += sum(sizes)

    def _record_batches(self) -> Iterator[tuple[str, Iterator[Any]]]:
        if self._table is not None:
            self._columns("the rows", self._table.schema.names)
            yield "the rows", iter(self._table.to_batches(_ARROW_ROWS))
            return
        lists = [f.name for f in self.schema.features if f.multi_valued]
        for path in self.paths:
            yield path, _arrow_batches(path, self._columns(path, _arrow_schema(path).names),
                                       lists if data_format(path) == "csv" else ())

    def _columns(self, path: str, names: list[str]) -> list[str]:
        want = self.schema.columns if self.require_label else self.schema.columns[1:]
        if missing := [c for c in want if c not in names]:
            raise TabularError(f"{path}: no column(s) {missing} of the run's schema; the file has {names}")
        return want if self.require_label or self.schema.label not in names else self.schema.columns

    def __iter__(self) -> Iterator[Batch]:
        self.position = self.bad_lines = 0
        self.bad_examples = []
        index, count = self.shard
        delivered = 0
        pending: list[_Rows] = []
        n_pending = 0
        for path, rb, numbers in self._selected():
            rows = self._convert(rb, path, numbers)
            skip = min(len(rows), max(0, self.skip_rows - self.position))
            self.position += skip
            if skip:
                rows = rows.slice(skip, len(rows))
            if self.max_rows is not None:
                rows = rows.slice(0, min(len(rows), self.max_rows - delivered))
            pending.append(rows)
            n_pending += len(rows)
            delivered += len(rows)
            if n_pending >= self.batch_size:
                all_rows = _Rows.concat(pending)
                cut = n_pending - n_pending % self.batch_size
                for a in range(0, cut, self.batch_size):
                    self.position += self.batch_size
                    yield self._batch(all_rows.slice(a, a + self.batch_size))
                pending = [all_rows.slice(cut, n_pending)] if cut < n_pending else []
                n_pending -= cut
            if self.max_rows is not None and delivered >= self.max_rows:
                break
        if n_pending:
            self.position += n_pending
            yield self._batch(_Rows.concat(pending))
        if self.bad_lines:
            log.warning("%s: skipped %d rows without a 0/1 label (shard %d of %d); first (row numbers from 1): %s",
                        ", ".join(self.paths),
                        self.bad_lines, index, count, "; ".join(f"row {r}: {why}" for r, why in self.bad_examples[:3]))

    def _convert(self, rb: Any, path: str, row_numbers: np.ndarray) -> _Rows:
        """The record batch's rows as arrays (`row_numbers`: their 0-based index over the files, to name bad ones)."""
        pa, pc = _pa()
        s = self.schema
        n = rb.num_rows
        names = rb.schema.names
        if s.label in names:
            raw = rb.column(names.index(s.label))
            try:
                label = np.asarray(pc.cast(raw, pa.float32()).fill_null(math.nan))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                raise TabularError(f"{path}: label column {s.label!r} is {raw.type}, expected 0/1 numbers") from None
            # scoring keeps every row (an unknown label is NaN); training skips and counts rows without a 0/1 label
            ok = (label == 0) | (label == 1) if self.require_label else np.ones(n, dtype=bool)
        else:
            label, ok = np.zeros(n, dtype=np.float32), np.ones(n, dtype=bool)
        dense = np.zeros((n, len(s.dense)), dtype=np.float32)
        for j, d in enumerate(s.dense):
            col = rb.column(names.index(d.name))
            try:
                x = np.asarray(pc.cast(col, pa.float64()).fill_null(math.nan), dtype=np.float64)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                raise TabularError(f"{path}: dense column {d.name!r} is {col.type}, expected numbers (name it with "
                                   "--categorical if it is a category)") from None
            dense[:, j] = np.nan_to_num(_transform(x, d), nan=0.0)
        single = np.zeros((n, len(self._single)), dtype=np.int64)
        for k, i in enumerate(self._single):
            f = s.features[i]
            col = rb.column(names.index(f.name))
            if _is_list(col.type):
                raise TabularError(f"{path}: column {f.name!r} holds lists but the schema has it single-valued")
            single[:, k] = _hash_strings(col, f.rows)
        lists = []
        for i in self._multi:
            f = s.features[i]
            col = rb.column(names.index(f.name))
            if not _is_list(col.type):
                raise TabularError(f"{path}: column {f.name!r} is {col.type}, but the schema has it as a list")
            lengths = np.asarray(pc.list_value_length(col).fill_null(0), dtype=np.int64)
            flat = pc.list_flatten(col)  # (a list's values repeat: each distinct one is hashed once)
            lists.append((_hash_strings(pc.dictionary_encode(_as_strings(flat)), f.rows), lengths))
        rows = _Rows(label, dense, single, lists)
        if not ok.all():
            bad = np.flatnonzero(~ok)
            self.bad_lines += len(bad)
            for b in bad[:max(0, 10 - len(self.bad_examples))]:
                value = rb.column(names.index(s.label))[int(b)].as_py()
                self.bad_examples.append((int(row_numbers[b]) + 1, f"label {value!r}, expected 0 or 1"))
            keep = np.flatnonzero(ok)
            rows = _Rows(label[keep], dense[keep], single[keep],
                         [_take_lists(v, ln, keep) for v, ln in lists])
        return rows

    def _batch(self, rows: _Rows) -> Batch:
        label = torch.from_numpy(np.array(rows.label, dtype=np.float32))
        dense = torch.from_numpy(np.ascontiguousarray(rows.dense))
        if not self._multi:
            return Batch(dense, torch.from_numpy(np.ascontiguousarray(rows.single)), label)
        values, lengths, single_at, multi_at = [], [], 0, 0
        for f in self.schema.features:
            if f.multi_valued:
                v, ln = rows.lists[multi_at]
                multi_at += 1
            else:
                v, ln = rows.single[:, single_at], np.ones(len(rows), dtype=np.int64)
                single_at += 1
            values.append(v)
            lengths.append(ln)
        kjt = KeyedJaggedTensor(self._keys, torch.from_numpy(np.concatenate(values)),
                                torch.from_numpy(np.concatenate(lengths)), stride=len(rows))
        return Batch(dense, kjt, label)


def _take_lists(values: np.ndarray, lengths: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    parts = [values[offsets[i]:offsets[i + 1]] for i in keep]
    return (np.concatenate(parts) if parts else values[:0]), lengths[keep]


def _transform(x: np.ndarray, d: DenseColumn) -> np.ndarray:
    if d.transform == "log":
        return np.sign(x) * np.log1p(np.abs(x))
    if d.transform == "standardize":
        return (x - d.mean) / d.std
    return x


# ---------------------------------------------------------------------------------------------- the schema
def _is_categorical_int(name: str) -> bool:
    return name.lower() in ("id", "userid", "itemid") or name.lower().endswith("_id") or name.endswith(("Id", "ID"))


def _parse_transforms(spec: str, dense: Sequence[str]) -> dict[str, str]:
    """'standardize' (every column) or 'col=log,other=none' (others: standardize) -> {column: transform}."""
    out = dict.fromkeys(dense, "standardize")
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name, eq, how = part.partition("=")
        if not eq:
            name, how = "", name
        if how not in TRANSFORMS:
            raise TabularError(f"dense_transform={spec!r}: {how!r} is not a transform; expected one of {TRANSFORMS}")
        if not name:
            out = dict.fromkeys(dense, how)
        elif name not in out:
            raise TabularError(f"dense_transform={spec!r}: {name!r} is not a dense column; the dense columns are "
                               f"{list(dense)}")
        else:
            out[name] = how
    return out


def _rows_for(distinct: int, cap: int) -> int:
    return min(cap, max(16, 1 << math.ceil(math.log2(ROWS_PER_VALUE * max(distinct, 1)))))


def infer_schema(path: str, *, label: str | None = None, categorical: Sequence[str] = (),
                 list_columns: Sequence[str] = (), dense: Sequence[str] = (), dense_transform: str = "standardize",
                 table_size: int | Sequence[int] | None = None, max_table_rows: int = 1 << 20,
                 sample_rows: int = 100_000) -> TabularSchema:
    """The schema of a Parquet/CSV file: its columns' kinds from their types (or as named), table rows and dense
    statistics from its first `sample_rows` rows. TabularError naming the column when the file does not fit."""
    pa, pc = _pa()
    fmt = data_format(path)
    schema = _arrow_schema(path)
    names = list(schema.names)
    for what, given in (("categorical", categorical), ("list_columns", list_columns), ("dense", dense)):
        if missing := [c for c in given if c not in names]:
            raise TabularError(f"{path}: {what} names {missing}, which the file does not have; its columns: {names}")
    if label is None:
        label = next((n for n in names if n.lower() in LABEL_NAMES), None)
        if label is None:
            raise TabularError(f"{path}: no label column ({', '.join(LABEL_NAMES)}); name it with --label (columns: "
                               f"{names})")
    elif label not in names:
        raise TabularError(f"{path}: --label {label!r} is not a column; its columns: {names}")
    kinds: dict[str, str] = {}
    for name, t in zip(names, schema.types):
        if name == label:
            continue
        if name in list_columns or _is_list(t):
            kinds[name] = "list"
        elif name in categorical:
            kinds[name] = "categorical"
        elif dense:
            kinds[name] = "dense" if name in dense else "ignored"
        elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t) or \
                pa.types.is_boolean(t) or (pa.types.is_integer(t) and _is_categorical_int(name)):
            kinds[name] = "categorical"
        elif pa.types.is_integer(t) or pa.types.is_floating(t):
            kinds[name] = "dense"
        else:
            kinds[name] = "ignored"
    if ignored := [n for n, k in kinds.items() if k == "ignored"]:
        log.warning("%s: column(s) %s are not used (neither dense, categorical nor lists)", path, ignored)
    features = [n for n, k in kinds.items() if k in ("categorical", "list")]
    dense_cols = [n for n, k in kinds.items() if k == "dense"]
    if not features:
        raise TabularError(f"{path}: no categorical column to embed; name them with --categorical (columns: {names})")
    transforms = _parse_transforms(dense_transform, dense_cols)
    sample, got = {n: [] for n in [*features, *dense_cols]}, 0
    csv_lists = [n for n, k in kinds.items() if k == "list"] if fmt == "csv" else []
    for rb in _arrow_batches(path, [*features, *dense_cols], csv_lists):
        rb = rb.slice(0, min(rb.num_rows, sample_rows - got))
        for n in sample:
            sample[n].append(rb.column(rb.schema.names.index(n)))
        got += rb.num_rows
        if got >= sample_rows:
            break
    if isinstance(table_size, int):
        sizes = [table_size] * len(features)
    elif table_size is not None:
        if len(table_size) != len(features):
            raise TabularError(f"table_size has {len(table_size)} entries but the file has {len(features)} "
                               f"categorical features {features}")
        sizes = list(table_size)
    else:
        sizes = None
    cols = []
    for i, n in enumerate(features):
        arr = pa.chunked_array(sample[n]) if sample[n] else pa.chunked_array([], type=pa.string())
        if kinds[n] == "list":
            arr = pc.list_flatten(arr)
        distinct = int(pc.count_distinct(arr).as_py()) if len(arr) else 0
        rows = sizes[i] if sizes is not None else _rows_for(distinct, max_table_rows)
        cols.append(FeatureColumn(n, rows, kinds[n] == "list", distinct))
    dense_out = []
    for n in dense_cols:
        x = np.asarray(pc.cast(pa.chunked_array(sample[n]), pa.float64()).fill_null(math.nan), dtype=np.float64) \
            if sample[n] else np.zeros(0)
        x = x[np.isfinite(x)]
        mean, std = (float(x.mean()), float(x.std())) if x.size else (0.0, 1.0)
        dense_out.append(DenseColumn(n, transforms[n], mean, std if std > 0 else 1.0))
    return TabularSchema(fmt, label, tuple(dense_out), tuple(cols), got)
