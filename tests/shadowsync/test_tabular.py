"""Parquet and CSV files with named columns: the schema found from the column types and a sample (and what the user
names instead), the rows streamed as batches (floats and negatives as they are, lists as jagged features), shards
that partition the rows, resume positions, bad labels counted, and files that do not fit named."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch

from cocosync.shadowsync.data.tabular import TabularError, TabularReader, count_rows, infer_schema


def _table(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    return pa.table({
        "click": rng.integers(0, 2, n).astype(np.int8),
        "price": rng.normal(0, 5, n),  # floats, negative ones too
        "age": rng.integers(10, 90, n),
        "color": rng.choice(["red", "green", "blue"], n),
        "user_id": rng.integers(0, 300, n),
        "tags": [[f"t{v}" for v in rng.integers(0, 20, k)] for k in rng.integers(0, 4, n)],
    })


@pytest.fixture
def parquet(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(_table(), path, row_group_size=300)
    return str(path)


def test_schema_from_types_and_sample(parquet):
    s = infer_schema(parquet, dense_transform="price=none")
    assert s.label == "click" and s.format == "parquet" and s.sample_rows == 1000
    assert [(d.name, d.transform) for d in s.dense] == [("price", "none"), ("age", "standardize")]
    kinds = {f.name: (f.multi_valued, f.distinct, f.rows) for f in s.features}
    assert kinds["color"] == (False, 3, 128)  # the power of two >= 32 rows per distinct value
    distinct = len(set(_table()["user_id"].to_pylist()))
    assert kinds["user_id"] == (False, distinct, 16384)
    assert kinds["tags"][:2] == (True, 20)
    assert "tags[list]" in s.describe() and "price (none)" in s.describe()
    assert [f.rows for f in infer_schema(parquet, table_size=64).features] == [64, 64, 64]  # the user's rows win
    assert infer_schema(parquet, max_table_rows=512).features[1].rows == 512  # the cap
    named = infer_schema(parquet, categorical=["age"], dense=["price"])
    assert [d.name for d in named.dense] == ["price"] and "age" in [f.name for f in named.features]


def test_schema_errors_name_the_column(parquet, tmp_path):
    with pytest.raises(TabularError, match=r"--label 'nope' is not a column; its columns: \['click'"):
        infer_schema(parquet, label="nope")
    with pytest.raises(TabularError, match=r"categorical names \['colour'\]"):
        infer_schema(parquet, categorical=["colour"])
    with pytest.raises(TabularError, match="'fancy' is not a transform"):
        infer_schema(parquet, dense_transform="fancy")
    no_label = tmp_path / "nolabel.parquet"
    pq.write_table(_table().drop(["click"]), no_label)
    with pytest.raises(TabularError, match="no label column"):
        infer_schema(str(no_label))
    with pytest.raises(TabularError, match="not a readable Parquet file"):
        (tmp_path / "junk.parquet").write_bytes(b"\x00\x01binary" * 10)
        infer_schema(str(tmp_path / "junk.parquet"))


def test_reader_batches_values_and_shards(parquet):
    s = infer_schema(parquet, dense_transform="none")
    t = _table()
    whole = list(TabularReader(parquet, s, batch_size=128))
    assert [len(b) for b in whole] == [128] * 7 + [104]
    b0 = whole[0]
    assert torch.equal(b0.dense[:, 0], torch.tensor(t["price"].to_numpy()[:128], dtype=torch.float32))
    assert float(b0.dense[:, 0].min()) < 0  # as they are, not clamped
    tags = b0.sparse["tags"]
    assert tags.lengths.tolist() == [len(v) for v in t["tags"].to_pylist()[:128]]
    assert b0.sparse.keys() == ("color", "user_id", "tags") and int(b0.sparse.values().max()) < 16384
    labels = torch.cat([b.label for b in whole])
    assert torch.equal(labels, torch.tensor(t["click"].to_numpy(), dtype=torch.float32))
    # three shards partition the rows: every row once, interleaved
    parts = [torch.cat([b.label for b in TabularReader(parquet, s, shard=(i, 3), batch_size=50)]) for i in range(3)]
    assert sum(len(p) for p in parts) == 1000 and torch.equal(parts[1], labels[1::3])
    # resume: skip a shard's first rows, position counts them
    r = TabularReader(parquet, s, shard=(1, 3), batch_size=50, skip_rows=120, max_rows=100)
    rest = torch.cat([b.label for b in r])
    assert torch.equal(rest, labels[1::3][120:220]) and r.position == 220


def test_csv_lists_and_hashing_agree_with_parquet(parquet, tmp_path):
    t = _table(200)
    csv = tmp_path / "rows.csv"
    flat = t.set_column(5, "tags", pa.array(["|".join(v) for v in t["tags"].to_pylist()]))
    pcsv.write_csv(flat, csv)
    s_pq = infer_schema(parquet)
    s_csv = infer_schema(str(csv), list_columns=["tags"], table_size=[128, 16384, 1024])
    assert [f.multi_valued for f in s_csv.features] == [False, False, True] and count_rows(str(csv)) == 200
    pq.write_table(t, tmp_path / "small.parquet")
    a = next(iter(TabularReader(str(tmp_path / "small.parquet"), s_pq, batch_size=200)))
    b = next(iter(TabularReader(str(csv), s_csv, batch_size=200)))
    assert torch.equal(a.sparse["user_id"].values, b.sparse["user_id"].values)  # ints hash by their text
    assert torch.equal(a.sparse["color"].values, b.sparse["color"].values)
    # empty lists: a CSV cell "" splits to [""], hashed to the missing row 0; parquet's [] is an empty bag
    assert torch.equal(a.sparse["tags"].lengths.clamp(min=1), b.sparse["tags"].lengths)


def test_bad_labels_are_counted_and_a_missing_column_named(parquet, tmp_path):
    t = _table(300)
    labels = t["click"].to_numpy().astype(np.float64)
    labels[[5, 77]] = [2.0, np.nan]
    bad = tmp_path / "bad.parquet"
    pq.write_table(t.set_column(0, "click", pa.array(labels)), bad)
    s = infer_schema(parquet)
    r = TabularReader(str(bad), s, batch_size=1000)
    assert sum(len(b) for b in r) == 298 and r.bad_lines == 2
    assert r.bad_examples == [(6, "label 2.0, expected 0 or 1"), (78, "label nan, expected 0 or 1")]
    shard = TabularReader(str(bad), s, shard=(0, 2), batch_size=1000)  # rows 0, 2, 4, ...: neither bad row
    assert sum(len(b) for b in shard) == 150 and shard.bad_lines == 0
    shard = TabularReader(str(bad), s, shard=(1, 2), batch_size=1000)  # rows 1, 3, 5, ...: named by the file's
    assert sum(len(b) for b in shard) == 148 and [n for n, _ in shard.bad_examples] == [6, 78]
    scored = TabularReader(str(bad), s, batch_size=1000, require_label=False)  # scoring keeps every row
    (b,) = list(scored)
    assert len(b) == 300 and b.label[5] == 2.0 and torch.isnan(b.label[77])
    other = tmp_path / "other.parquet"
    pq.write_table(t.drop(["color"]), other)
    with pytest.raises(TabularError, match=r"no column\(s\) \['color'\] of the run's schema"):
        list(TabularReader(str(other), s))
    rows = TabularReader.of_rows({"price": [1.0], "age": [30], "color": ["red"], "user_id": [7], "tags": [["t1"]]}, s)
    (b,) = list(rows)
    assert len(b) == 1 and b.sparse["tags"].lengths.tolist() == [1]


def test_data_inspect_reads_parquet_and_criteo_files_of_any_width(parquet, tmp_path):
    from click.testing import CliRunner

    from cocosync.cli import main

    res = CliRunner().invoke(main, ["data", "inspect", parquet])
    assert res.exit_code == 0, res.output
    assert "tags[list]" in res.output and "1,000" in res.output
    tsv = tmp_path / "narrow.tsv"  # label, 4 integers, 6 categoricals: 11 columns
    rng = np.random.default_rng(0)
    tsv.write_text("".join(f"{rng.integers(0, 2)}\t" + "\t".join(str(v) for v in rng.integers(0, 99, 4)) + "\t"
                           + "\t".join(f"a{v}" for v in rng.integers(0, 9, 6)) + "\n" for _ in range(300)))
    res = CliRunner().invoke(main, ["data", "inspect", str(tsv)])
    assert res.exit_code == 0, res.output
    assert "4 integer and 6 categorical columns" in res.output and "300" in res.output


def test_parquet_shards_of_a_budget_are_contiguous_ranges_read_by_row_groups(parquet):
    """A training run's shard reads its share of the budget as one range (the row groups holding it); the rows after
    the budget are left to the held-out set."""
    s = infer_schema(parquet)
    labels = torch.tensor(_table()["click"].to_numpy(), dtype=torch.float32)
    parts = [torch.cat([b.label for b in TabularReader(parquet, s, shard=(i, 3), batch_size=64,
                                                       row_range=(250 * i, 250 * (i + 1)))])
             for i in range(3)]
    assert [len(p) for p in parts] == [250, 250, 250]  # row groups of 300: ranges cross their bounds
    assert torch.equal(torch.cat(parts), labels[:750])
    r = TabularReader(parquet, s, shard=(2, 3), batch_size=64, row_range=(500, 750), skip_rows=100, max_rows=50)
    assert torch.equal(torch.cat([b.label for b in r]), labels[600:650]) and r.position == 150
