"""DLRM: shapes, dense/embedding split, shared external embedding weights, learning on synthetic data."""

from __future__ import annotations

import pytest
import torch

from cocosync.shadowsync.config import DataConfig, ModelConfig
from cocosync.shadowsync.data.synth import EVAL, make_synthetic_dataset
from cocosync.shadowsync.metrics import evaluate
from cocosync.shadowsync.model.dlrm import DLRM, new_embedding_weights

DATA = DataConfig(table_size=2000)


def _inputs(b=5):
    g = torch.Generator().manual_seed(0)
    return torch.rand(b, 13, generator=g), torch.randint(0, 2000, (b, 26), generator=g)


def test_shapes_and_parameter_split():
    m = DLRM(ModelConfig(), DATA)
    dense, sparse = _inputs()
    out = m(dense, sparse)
    assert out.shape == (5,) and out.dtype == torch.float32
    assert torch.allclose(torch.sigmoid(out), torch.full((5,), 0.04), atol=0.03)  # init_ctr bias
    assert len(m.embeddings) == 26 and all(isinstance(e, torch.nn.EmbeddingBag) for e in m.embeddings)
    dense_ids = {id(p) for p in m.dense_parameters()}
    emb_ids = {id(p) for p in m.embedding_parameters()}
    assert not dense_ids & emb_ids and dense_ids | emb_ids == {id(p) for p in m.parameters()}
    assert m.top[0].in_features == 16 + 27 * 26 // 2
    with pytest.raises(ValueError, match=r"dense has shape \(5, 12\)"):
        m(dense[:, :12], sparse)


def test_same_seed_same_init():
    a, b = DLRM(ModelConfig(seed=3), DATA), DLRM(ModelConfig(seed=3), DATA)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = DLRM(ModelConfig(seed=4), DATA)
    assert not torch.equal(a.dense_parameters()[0], c.dense_parameters()[0])


def test_external_embedding_weights_are_shared_not_copied():
    weights = [w.share_memory_() for w in new_embedding_weights(ModelConfig(), DATA)]
    m1 = DLRM(ModelConfig(), DATA, embedding_weights=weights, sparse=True)
    m2 = DLRM(ModelConfig(), DATA, embedding_weights=weights)
    assert all(e.weight.data_ptr() == w.data_ptr() for e, w in zip(m1.embeddings, weights))
    dense, sparse = _inputs()
    m1(dense, sparse).sum().backward()
    assert m1.embeddings[0].weight.grad.is_sparse
    with torch.no_grad():
        for e in m1.embeddings:  # an update through one model is seen by the other and by the owner
            e.weight.add_(1.0)
    assert torch.equal(m2.embeddings[3].weight, weights[3]) and weights[3].is_shared()
    with pytest.raises(ValueError, match=r"embedding_weights\[0\] is \(10, 16\)"):
        DLRM(ModelConfig(), DATA, embedding_weights=[torch.zeros(10, 16)] * 26)


@pytest.fixture
def one_thread():
    # 2 intra-op threads on a loaded 2-core machine are ~15x slower than 1 (spin-waiting); one is enough here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_sgd_on_synthetic_data_reduces_ne(one_thread):
    torch.manual_seed(0)
    train = make_synthetic_dataset(64_000, seed=0, data=DATA)  # 250 steps of 256
    held_out = make_synthetic_dataset(10_000, seed=0, data=DATA, split=EVAL)
    m = DLRM(ModelConfig(sparse_gradients=True), DATA)
    opt = torch.optim.Adagrad(m.parameters(), lr=0.1)
    before = evaluate(m, held_out.batches(4096))
    for b in train.batches(256):
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(m(b.dense, b.sparse), b.label).backward()
        opt.step()
    after = evaluate(m, held_out.batches(4096))
    assert before["ne"] > 0.98
    assert after["ne"] < 0.85 and after["auc"] > 0.8
    assert after["ne"] - after["bayes_ne"] < 0.2


def test_gather_rows_equals_advanced_indexing_forward_and_backward():
    from cocosync.shadowsync.model.embeddings import gather_rows

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(50, 8, generator=g, requires_grad=True)
    index = torch.randint(0, 50, (32, 5), generator=g)  # rows used many times: their gradients sum
    upstream = torch.randn(32, 5, 8, generator=g)
    ours = gather_rows(rows, index)
    ref = rows[index]
    assert torch.equal(ours, ref)
    (g_ours,) = torch.autograd.grad(ours, rows, upstream)
    (g_ref,) = torch.autograd.grad(ref, rows, upstream)
    assert torch.equal(g_ours, g_ref) and g_ours.abs().sum() > 0


def test_interaction_equals_the_upper_triangle_of_the_products_forward_and_backward():
    model = DLRM(ModelConfig(), DATA)
    g = torch.Generator().manual_seed(1)
    t = torch.randn(6, 1 + DATA.num_sparse, model.config.embedding_dim, generator=g, requires_grad=True)
    x = t[:, 0]
    ours = model._interact(x, t)
    n = t.shape[1]
    rows, cols = torch.triu_indices(n, n, offset=1)
    ref = model.top(torch.cat([x, torch.bmm(t, t.transpose(1, 2))[:, rows, cols]], dim=1)).squeeze(1)
    assert torch.equal(ours, ref)
    assert torch.equal(torch.autograd.grad(ours.sum(), t)[0], torch.autograd.grad(ref.sum(), t)[0])
