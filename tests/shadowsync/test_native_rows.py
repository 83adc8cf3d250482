"""Row-wise Adagrad on embedding rows in C++ (runtime/comm/native/embedding_rows.cpp) against its torch reference:
the same update up to float rounding, with rows repeated in one call and with weight decay; bad rows refused."""

from __future__ import annotations

import pytest
import torch

from cocosync.runtime.comm import native
from cocosync.shadowsync.model import batch_rows, embeddings, shard


def _module():
    module = native.one_shot()
    if module is None:
        pytest.skip("no native module (no compiler or ninja, or COCOSYNC_NATIVE=0): the torch path runs")
    return module


@pytest.mark.parametrize("weight_decay", [0.0, 1e-3])
def test_native_rowwise_adagrad_matches_the_torch_reference(weight_decay, monkeypatch):
    _module()
    g = torch.Generator().manual_seed(1)
    weight, acc = torch.randn(500, 8, generator=g), torch.rand(500, generator=g)
    rows = torch.randint(0, 500, (300,), generator=g)
    rows[:40] = rows[40:80]  # a row twice in one call: each occurrence steps with the row's final accumulator
    grads = torch.randn(300, 8, generator=g)
    w_nat, acc_nat, w_ref, acc_ref = weight.clone(), acc.clone(), weight.clone(), acc.clone()
    shard.rowwise_update(w_nat, acc_nat, rows, grads.clone(), "adagrad", 0.1, 1e-8, weight_decay)
    monkeypatch.setattr(shard, "_native_rows", lambda *a: False)
    shard.rowwise_update(w_ref, acc_ref, rows, grads.clone(), "adagrad", 0.1, 1e-8, weight_decay)
    assert not torch.equal(w_ref, weight)  # the update did something
    torch.testing.assert_close(acc_nat, acc_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(w_nat, w_ref, rtol=1e-6, atol=1e-7)


def test_native_rowwise_adagrad_refuses_a_row_outside_the_table():
    module = _module()
    weight, acc = torch.zeros(10, 4), torch.zeros(10)
    with pytest.raises(RuntimeError, match="row 10 out of range"):
        module.rowwise_adagrad(weight, acc, torch.tensor([3, 10]), torch.ones(2, 4), 0.1, 1e-8, 0.0)
    assert not acc.any()  # checked before anything is written


def test_other_dtypes_take_the_torch_path():
    weight, acc = torch.zeros(10, 4, dtype=torch.float64), torch.zeros(10, dtype=torch.float64)
    rows, grads = torch.tensor([1, 2]), torch.ones(2, 4, dtype=torch.float64)
    assert not shard._native_rows(weight, acc, rows, grads)
    shard.rowwise_update(weight, acc, rows, grads, "adagrad", 0.5, 1e-8)
    assert torch.allclose(weight[1], torch.full((4,), -0.5, dtype=torch.float64))  # lr * g / sqrt(mean(g^2))


@pytest.mark.parametrize("shape", [(256, 26), (1, 1), (0, 3), (500, 2)])
def test_native_distinct_rows_are_torch_uniques_bits(shape):
    """A batch's deduplication (ShardedEmbeddings._distinct): the distinct global rows ascending and each id's
    position in them, exactly torch.unique's, on Zipf-like ids with many repeats and on large row ids."""
    module = _module()
    g = torch.Generator().manual_seed(sum(shape))
    B, T = shape
    sparse = (torch.rand(B, T, generator=g) ** 8 * 5000).to(torch.int64)  # skewed: most ids repeat
    offsets = torch.arange(T, dtype=torch.int64) * 5000 + (1 << 33) * (T > 1)  # rows past 2^32 too
    uniq, inverse = module.distinct_rows(sparse, offsets)
    ref_uniq, ref_inverse = torch.unique((sparse + offsets).reshape(-1), return_inverse=True)
    assert torch.equal(uniq, ref_uniq) and torch.equal(inverse, ref_inverse.view(B, T))
    if B * T > 100:
        assert uniq.numel() < 0.6 * B * T  # the case deduplicates


def test_sharded_embeddings_deduplicate_natively_as_the_reference(monkeypatch):
    _module()
    emb = embeddings.ShardedEmbeddings([30, 7, 100], 4, [embeddings.Shard(
        torch.zeros(137, 4), torch.zeros(137), torch.zeros(137, dtype=torch.int64), optimizer="adagrad", lr=0.1)])
    sparse = torch.tensor([[3, 6, 99], [3, 0, 0], [29, 6, 99]])
    uniq, inverse = batch_rows.distinct_rows(sparse, emb.offsets)
    assert uniq.tolist() == [3, 29, 30, 36, 37, 136] and inverse.tolist() == [[0, 3, 5], [0, 2, 4], [1, 3, 5]]
    monkeypatch.setattr(batch_rows, "native_module", lambda: None)
    ref = batch_rows.distinct_rows(sparse, emb.offsets)
    assert torch.equal(ref[0], uniq) and torch.equal(ref[1], inverse)


def test_native_distinct_rows_refuses_bad_input():
    module = _module()
    with pytest.raises(RuntimeError, match="negative row"):
        module.distinct_rows(torch.tensor([[-5, 1]]), torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="one per table"):
        module.distinct_rows(torch.tensor([[5, 1]]), torch.tensor([0]))


@pytest.mark.parametrize("hot_rows", [0, 40])
def test_native_split_of_a_batch_is_the_references(hot_rows, monkeypatch):
    """Where a batch's rows live with the lookup exchange (ShardedEmbeddings._split): hot (positions, slots), local
    (server, positions, local rows) per shard, remote positions -- native and torch alike, on a node holding 2 of 6
    servers."""
    from cocosync.shadowsync.model.hot_rows import HotRows

    _module()
    g = torch.Generator().manual_seed(hot_rows)
    total = 600

    def shard(n):
        return embeddings.Shard(torch.zeros(n, 4), torch.zeros(n), torch.zeros(n, dtype=torch.int64),
                                optimizer="adagrad", lr=0.1)

    servers = ["r0", "r1", shard(100), shard(100), "r4", "r5"]
    hot = HotRows(torch.randperm(total, generator=g)[:hot_rows].sort().values, shard(hot_rows)) if hot_rows else None
    emb = embeddings.ShardedEmbeddings([total], 4, servers, remote=object(), hot=hot)
    uniq = torch.randperm(total, generator=g)[:250].sort().values
    got = emb._split(uniq)
    monkeypatch.setattr(batch_rows, "native_module", lambda: None)
    ref = emb._split(uniq)
    assert [s for s, _, _ in got["local"]] == [s for s, _, _ in ref["local"]] == [2, 3]
    for (_, pos, rows), (_, ref_pos, ref_rows) in zip(got["local"], ref["local"]):
        assert torch.equal(pos, ref_pos) and torch.equal(rows, ref_rows)
    assert torch.equal(got["remote_idx"], ref["remote_idx"])
    if hot_rows:
        assert got["hot"][0].numel() > 0 and all(torch.equal(a, b) for a, b in zip(got["hot"], ref["hot"]))
    else:
        assert got["hot"] is None and ref["hot"] is None
    placed = sum(p.numel() for _, p, _ in got["local"]) + got["remote_idx"].numel()
    assert placed + (got["hot"][0].numel() if hot_rows else 0) == uniq.numel()  # every row once


def test_native_split_refuses_rows_out_of_order():
    module = _module()
    with pytest.raises(RuntimeError, match="ascending"):
        module.split_rows(torch.tensor([5, 3]), torch.empty(0, dtype=torch.int64), torch.tensor([True, False]))
