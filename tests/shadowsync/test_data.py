"""Criteo reader (missing fields, bad lines, gzip, sharding, resume) and the synthetic teacher."""

from __future__ import annotations

import gzip
import logging
import math

import numpy as np
import pytest
import torch

from cocosync.shadowsync.config import DataConfig, ModelConfig, SynthConfig
from cocosync.shadowsync.data.criteo import CriteoFormatError, CriteoReader, hash_tokens, prob_sidecar_path
from cocosync.shadowsync.data.ranges import even_share, even_start, filled_shares, range_lines
from cocosync.shadowsync.data.synth import SyntheticStream, expected_ne, make_synthetic_dataset, write_synthetic
from cocosync.shadowsync.metrics import bayes_ne

CFG = DataConfig(table_size=1000)


def _line(label="1", ints=None, cats=None) -> str:
    ints = [str(i) for i in range(1, 14)] if ints is None else ints
    cats = [f"{i:08x}" for i in range(26)] if cats is None else cats
    return "\t".join([label, *ints, *cats])


def _bucket(token: str, size: int = 1000) -> int:
    buf = np.frombuffer(token.encode(), dtype=np.uint8)
    return int(hash_tokens(buf, np.array([0]), np.array([len(token)]), size)[0])


def _read_all(reader) -> tuple[torch.Tensor, ...]:
    batches = list(reader)
    return tuple(torch.cat([getattr(b, f) for b in batches]) for f in ("dense", "sparse", "label"))


def test_parses_values_and_missing_fields(tmp_path):
    ints = ["", "0", "-3", "7", "", "1000000", "1", "2", "3", "4", "5", "123456789012", ""]
    cats = ["", "a9f3c2d1"] + [f"{i:08x}" for i in range(24)]
    cats[5] = ""
    p = tmp_path / "d.tsv"
    p.write_text(_line("0", ints, cats) + "\n" + _line("1") + "\n")
    dense, sparse, label = _read_all(CriteoReader(str(p), CFG, batch_size=8))
    assert label.tolist() == [0.0, 1.0]
    assert dense.dtype == torch.float32 and dense.shape == (2, 13)
    expect = [0, 0, 0, 7, 0, 1000000, 1, 2, 3, 4, 5, 123456789012, 0]  # missing -> 0, negatives clipped to 0
    assert torch.allclose(dense[0], torch.log1p(torch.tensor(expect, dtype=torch.float32)))
    assert sparse.dtype == torch.int64 and sparse.shape == (2, 26)
    assert sparse[0, 0] == 0 and sparse[0, 5] == 0  # missing categorical -> reserved bucket 0
    assert sparse[0, 1] == _bucket("a9f3c2d1")
    assert ((sparse[1] >= 1) & (sparse[1] < 1000)).all()


def test_bad_lines_are_counted_with_line_numbers(tmp_path, caplog):
    lines = [_line()] * 3
    lines[1] = "1\t2\t3"  # line 2: too few fields
    lines += [_line(label="x"), _line(ints=["1"] * 12 + ["zz"]), "", _line(), _line() + "\textra"]
    lines += [_line(ints=["123456789012"] + ["-"] + ["1"] * 11), _line(ints=["1" * 19] + ["1"] * 12)]
    p = tmp_path / "bad.tsv"
    p.write_text("\n".join(lines) + "\n")
    reader = CriteoReader(str(p), DataConfig(table_size=1000, max_bad_fraction=1.0), batch_size=2)
    with caplog.at_level(logging.WARNING, logger="cocosync.shadowsync.data"):
        _, _, label = _read_all(reader)
    assert len(label) == 3 and reader.position == 3
    assert reader.bad_lines == 7
    assert [n for n, _ in reader.bad_examples] == [2, 4, 5, 6, 8, 9, 10]
    reasons = dict(reader.bad_examples)
    assert "found 3" in reasons[2] and "label 'x'" in reasons[4] and "I13='zz'" in reasons[5]
    assert "found 41" in reasons[8] and "I2='-'" in reasons[9] and "I1='1111111111111111111'" in reasons[10]
    assert "skipped 7 malformed" in caplog.text and "line 2" in caplog.text


def test_too_many_bad_lines_raise(tmp_path):
    p = tmp_path / "wrong.csv"
    p.write_text("a,b,c\n" * 2000)
    with pytest.raises(CriteoFormatError, match="2000 of 2000 lines are malformed.*line 1"):
        list(CriteoReader(str(p), CFG))


def test_gzip_crlf_and_missing_final_newline(tmp_path):
    text = "\r\n".join([_line("0"), _line("1"), _line("1")])  # no trailing newline
    plain, gz = tmp_path / "d.tsv", tmp_path / "d.tsv.gz"
    plain.write_text(_line("0") + "\n" + _line("1") + "\n" + _line("1") + "\n")
    with gzip.open(gz, "wt", newline="") as f:
        f.write(text)
    a = _read_all(CriteoReader(str(plain), CFG, batch_size=2))
    b = _read_all(CriteoReader(str(gz), CFG, batch_size=2, chunk_bytes=100))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_shards_partition_every_row_once_and_resume(tmp_path):
    p = tmp_path / "s.tsv.gz"
    write_synthetic(str(p), 1000, seed=3)
    whole = CriteoReader(str(p), CFG, batch_size=64)
    dense, sparse, label = _read_all(whole)
    assert whole.with_prob and len(label) == 1000
    parts = [_read_all(CriteoReader(str(p), CFG, shard=(i, 3), batch_size=50, chunk_bytes=4096)) for i in range(3)]
    assert sorted(len(x[2]) for x in parts) == [333, 333, 334]
    for i, (d, _, _) in enumerate(parts):  # interleaved: shard i owns lines i, i+3, ...
        assert torch.equal(d, dense[i::3])
    # resume: skip what a first reader consumed
    first = CriteoReader(str(p), CFG, shard=(1, 3), batch_size=50, max_rows=120)
    got = _read_all(first)[0]
    assert len(got) == 120 and first.position == 120
    rest = _read_all(CriteoReader(str(p), CFG, shard=(1, 3), batch_size=50, skip_rows=first.position))[0]
    assert torch.equal(torch.cat([got, rest]), parts[1][0])


def test_file_and_memory_synthetic_data_agree(tmp_path):
    p = tmp_path / "syn.tsv"
    stats = write_synthetic(str(p), 5000, seed=7)
    ds = make_synthetic_dataset(5000, seed=7, data=CFG)
    batches = list(CriteoReader(str(p), CFG, batch_size=1024))
    assert torch.equal(torch.cat([b.dense for b in batches]), ds.dense)
    assert torch.equal(torch.cat([b.sparse for b in batches]), ds.sparse)
    assert torch.equal(torch.cat([b.label for b in batches]), ds.label)
    assert torch.equal(torch.cat([b.prob for b in batches]), ds.prob)
    assert np.load(prob_sidecar_path(str(p))).shape == (5000,)
    assert math.isclose(stats["bayes_ne"], bayes_ne(ds.label, ds.prob), rel_tol=1e-6)


def test_synthetic_ctr_bayes_ne_and_determinism():
    ds = make_synthetic_dataset(40_000, seed=1)
    assert 0.03 <= ds.label.mean().item() <= 0.05
    assert 0.03 <= ds.prob.mean().item() <= 0.05
    assert 0.5 < bayes_ne(ds.label, ds.prob) < 0.85
    assert 0.5 < expected_ne(ds.prob.numpy()) < 0.85
    again = make_synthetic_dataset(40_000, seed=1)
    other = make_synthetic_dataset(40_000, seed=2)
    assert torch.equal(ds.sparse, again.sparse) and torch.equal(ds.label, again.label)
    assert not torch.equal(ds.sparse, other.sparse)
    # categories follow a power law: the most frequent value of a large-vocabulary feature dominates
    counts = np.bincount(ds.sparse[:, 15].numpy())
    top = np.sort(counts[1:])[::-1]
    assert top[0] > 10 * top[20] > 0


def test_synthetic_ctr_follows_config():
    dc = DataConfig(synth=SynthConfig(ctr=0.1, teacher_seed=5))
    ds = make_synthetic_dataset(20_000, seed=0, data=dc)
    assert 0.09 < ds.prob.mean().item() < 0.11


def test_synthetic_stream_shards_and_resume():
    whole = make_synthetic_dataset(20_000, seed=4, data=CFG)
    shards = [SyntheticStream(CFG, seed=4, rows=20_000, shard=(i, 2), batch_size=1000) for i in range(2)]
    got = [torch.cat([b.dense for b in s]) for s in shards]
    assert sum(len(g) for g in got) == 20_000
    assert torch.equal(torch.sort(torch.cat(got).sum(1)).values, torch.sort(whole.dense.sum(1)).values)
    s = SyntheticStream(CFG, seed=4, rows=20_000, shard=(1, 2), batch_size=300, max_rows=700)
    head = torch.cat([b.sparse for b in s])
    assert len(head) == 700 and s.position == 700
    tail = torch.cat([b.sparse for b in SyntheticStream(CFG, seed=4, rows=20_000, shard=(1, 2), skip_rows=700)])
    assert torch.equal(torch.cat([head, tail]), torch.cat([b.sparse for b in shards[1]]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(table_size=1), r"table_size\[0\]=1"),
        (dict(table_size=(10, 20)), "2 entries"),
        (dict(batch_size=0), "batch_size=0"),
        (dict(max_bad_fraction=2), "max_bad_fraction=2"),
        (dict(train_path=""), "train_path=''"),
        (dict(synth=SynthConfig(num_dense=3)), "num_dense=13"),
    ],
)
def test_data_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="ctr=0.9"):
        SynthConfig(ctr=0.9)
    with pytest.raises(ValueError, match=r"bottom_mlp=\(64, 8\).*embedding_dim=16"):
        ModelConfig(bottom_mlp=(64, 8))
    with pytest.raises(ValueError, match="shard"):
        CriteoReader(__file__, CFG, shard=(2, 2))


def test_cli_synth_and_inspect(tmp_path):
    from click.testing import CliRunner

    from cocosync.cli import main

    out = tmp_path / "syn"
    res = CliRunner().invoke(main, ["data", "synth", str(out), "--rows", "3000", "--eval-rows", "500", "--gzip"])
    assert res.exit_code == 0, res.output
    assert (out / "train.tsv.gz").exists() and (out / "eval.tsv.prob.npy").exists() and (out / "meta.json").exists()
    res = CliRunner().invoke(main, ["data", "inspect", str(out / "eval.tsv.gz")])
    assert res.exit_code == 0, res.output
    assert "500" in res.output and "bayes_ne" in res.output
    res = CliRunner().invoke(main, ["data", "synth", str(out), "--rows", "10", "--ctr", "0.9"])
    assert res.exit_code != 0 and "ctr=0.9" in res.output


@pytest.mark.parametrize("shards", [1, 2, 3, 7, 64])
def test_byte_ranges_partition_the_lines_and_read_only_their_share(tmp_path, shards):
    p = tmp_path / "b.tsv"
    write_synthetic(str(p), 1000, seed=5)
    dense, sparse, label = _read_all(CriteoReader(str(p), CFG, batch_size=64))
    size = p.stat().st_size
    got, read = [], []
    for i in range(shards):
        r = CriteoReader(str(p), CFG, shard=(i, shards), batch_size=50, chunk_bytes=4096, split="bytes")
        parts = list(r)
        got.append(torch.cat([b.dense for b in parts]) if parts else torch.empty(0, dense.shape[1]))
        assert all(b.prob is not None for b in parts)  # the sidecar lines up: line numbers counted before the range
        read.append(r.bytes_read)
    # contiguous blocks of lines, in order, together every line exactly once
    assert torch.equal(torch.cat(got), dense)
    assert sum(read) == size and max(read) <= size // shards + 2 * (size // 1000)  # ~1/S each (+ a line)
    probs = torch.cat([b.prob for i in range(shards)
                       for b in CriteoReader(str(p), CFG, shard=(i, shards), batch_size=999, split="bytes")])
    assert torch.equal(probs, torch.cat([b.prob for b in CriteoReader(str(p), CFG, batch_size=999)]))


@pytest.mark.parametrize("shards", [1, 2, 3, 7, 64, 5000])
def test_range_lines_counts_what_each_byte_range_reader_reads(tmp_path, shards):
    p = tmp_path / "b.tsv"
    write_synthetic(str(p), 1000, seed=5)
    read = [sum(len(b.label) for b in CriteoReader(str(p), CFG, shard=(i, shards), batch_size=50, split="bytes"))
            for i in range(shards)]
    assert range_lines([str(p)], shards, block=4096) == read  # (blocks that cut lines, and ranges with no line)
    assert range_lines([str(p), str(p)], shards, block=999) == [2 * n for n in read]


def test_filled_shares_give_a_short_readers_rest_to_the_others():
    assert filled_shares(12, [10, 10, 10]) == [4, 4, 4]
    assert filled_shares(12, [1, 10, 10]) == [1, 5, 6]  # the short reader's 3 go to the others
    assert filled_shares(30, [1, 10, 10]) == [1, 10, 10]  # more than they hold: all of it
    for caps, total in (([3, 0, 7, 7, 2], 15), ([5] * 7, 33), ([0, 0], 5), ([9, 1, 4, 4], 17)):
        got = filled_shares(total, caps)
        assert sum(got) == min(total, sum(caps)) and all(0 <= g <= c for g, c in zip(got, caps))
        left = [g for g, c in zip(got, caps) if g < c]  # readers with rows left over: as even as can be
        if left:
            assert max(left) - min(left) <= 1 and max(got) <= min(left) + 1, (caps, total, got)
    assert [even_share(10, 4, s) for s in range(4)] == [3, 3, 2, 2]
    assert [even_start(10, 4, s) for s in range(4)] == [0, 3, 6, 8]


def test_byte_ranges_lines_at_the_edges_crlf_no_final_newline_and_errors(tmp_path):
    p = tmp_path / "e.tsv"
    lines = [_line("0"), "bad line", _line("1"), _line("1")]
    p.write_bytes("\r\n".join(lines).encode())  # CRLF, no final newline
    cfg = DataConfig(table_size=1000, max_bad_fraction=1.0)
    want = _read_all(CriteoReader(str(p), cfg, batch_size=8))
    size = p.stat().st_size
    for shards in (2, 3, 5, size):  # cuts inside lines, at newlines, and ranges with no line start
        readers = [CriteoReader(str(p), cfg, shard=(i, shards), batch_size=8, split="bytes") for i in range(shards)]
        parts = [_read_all(r) for r in readers if list(r)]
        for k in range(3):
            assert torch.equal(torch.cat([x[k] for x in parts]), want[k])
        bad = [e for r in readers for e in r.bad_examples]
        assert [n for n, _ in bad] == [2]  # the malformed line keeps its file line number
    gz = tmp_path / "e.tsv.gz"
    with gzip.open(gz, "wb") as f:
        f.write(p.read_bytes())
    with pytest.raises(ValueError, match="e.tsv.gz' is gzip"):
        CriteoReader(str(gz), cfg, shard=(0, 2), split="bytes")
    with pytest.raises(ValueError, match="split='rows': expected 'lines' or 'bytes'"):
        CriteoReader(str(p), cfg, split="rows")


def test_rows_generated_as_they_are_read_are_the_rows_generated_before_training():
    """A trainer that joins a running job streams its synthetic rows (`streamed`) from its reader's position: the
    same rows, batch for batch, as the ones generated whole before training."""
    from cocosync.shadowsync.config import TrainConfig
    from cocosync.shadowsync.data.sources import build_configs, trainer_source, with_init_ctr, with_schema

    cfg = with_init_ctr(with_schema(TrainConfig(examples=60_000, trainers=3, workers=2)))
    data, _ = build_configs(cfg)
    whole, streamed = trainer_source(cfg, data, 1, None), trainer_source(cfg, data, 1, None, streamed=True)
    for shard, start in ((2, 0), (3, 777), (2, 9_999), (3, 10_000)):
        a, b = list(whole.batches(shard, 6, 512, start)), list(streamed.batches(shard, 6, 512, start))
        assert [x.label.shape[0] for x in a] == [x.label.shape[0] for x in b]
        for x, y in zip(a, b):
            assert torch.equal(x.sparse, y.sparse) and torch.equal(x.dense, y.dense) and torch.equal(x.label, y.label)
