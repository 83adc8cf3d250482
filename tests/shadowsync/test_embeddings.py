"""Shared embedding tables: row updates against hand computation, sharing across spawned processes, no leftovers."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as tmp

from cocosync.shadowsync.embeddings import SharedEmbeddings


def _shm() -> set[str]:
    """Named segments in /dev/shm, less multiprocessing's semaphores and the runtime arena's cocosync-* segments
    (other suites running concurrently create and remove them)."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {f for f in os.listdir("/dev/shm") if not f.startswith(("sem.", "cocosync-"))}


def test_views_and_validation():
    e = SharedEmbeddings([3, 5], 2, init_std=0.0)
    assert [tuple(t.shape) for t in e.tables] == [(3, 2), (5, 2)]
    e.tables[1][0] = 7.0
    assert e.weight[3].tolist() == [7.0, 7.0]
    with pytest.raises(ValueError, match="optimizer='adam'"):
        SharedEmbeddings([3], 2, optimizer="adam")


def test_sgd_rows_sum_duplicates():
    e = SharedEmbeddings([4, 4], 2, optimizer="sgd", lr=0.5, init_std=0.0)
    e.apply_rows(1, torch.tensor([2, 0, 2]), torch.tensor([[1.0, 2.0], [4.0, 4.0], [1.0, 0.0]]))
    assert e.tables[1][2].tolist() == [-1.0, -1.0]  # -(0.5) * ([1,2]+[1,0])
    assert e.tables[1][0].tolist() == [-2.0, -2.0]
    assert e.tables[0].abs().sum() == 0 and e.tables[1][1].abs().sum() == 0


def test_rowwise_adagrad_matches_hand_computation():
    lr, eps = 0.1, 1e-8
    e = SharedEmbeddings([3], 2, optimizer="adagrad", lr=lr, eps=eps, init_std=0.0)
    g1, g2 = torch.tensor([3.0, 4.0]), torch.tensor([1.0, 1.0])
    e.apply_rows(0, torch.tensor([1]), g1[None])
    e.apply_rows(0, torch.tensor([1]), g2[None])
    acc1 = (g1 ** 2).mean()
    acc2 = acc1 + (g2 ** 2).mean()
    w = -lr * g1 / (acc1.sqrt() + eps) - lr * g2 / (acc2.sqrt() + eps)
    assert e.tables[0][1].tolist() == pytest.approx(w.tolist())
    assert e.accumulator[1].item() == pytest.approx(acc2.item())
    assert e.tables[0][0].abs().sum() == 0


def test_sparse_and_dense_autograd_grads_agree():
    for sparse in (True, False):
        e = SharedEmbeddings([6], 3, optimizer="sgd", lr=1.0, init_std=0.0, seed=1)
        e.weight.copy_(torch.arange(18.0).reshape(6, 3))
        w = torch.nn.Parameter(e.tables[0])
        ids = torch.tensor([1, 4, 1])
        loss = torch.nn.functional.embedding(ids, w, sparse=sparse).sum()
        (g,) = torch.autograd.grad(loss, [w])
        e.apply_grad(0, g)
        ref = torch.arange(18.0).reshape(6, 3)
        ref[1] -= 2
        ref[4] -= 1
        assert torch.equal(e.tables[0], ref), sparse


def _child_update(emb: SharedEmbeddings, table: int, row: int) -> None:
    emb.apply_rows(table, torch.tensor([row]), torch.ones(1, emb.dim))


def test_processes_share_the_tables_and_leave_no_shm_file():
    before = _shm()
    e = SharedEmbeddings([4, 4], 2, optimizer="sgd", lr=1.0, init_std=0.0).share_memory_()
    assert e.is_shared()
    ctx = tmp.get_context("spawn")
    procs = [ctx.Process(target=_child_update, args=(e, t, t + 1)) for t in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert e.tables[0][1].tolist() == [-1.0, -1.0] and e.tables[1][2].tolist() == [-1.0, -1.0]
    assert _shm() - before == set()


def test_state_dict_round_trip():
    e = SharedEmbeddings([2, 3], 2, seed=3)
    e.apply_rows(1, torch.tensor([2]), torch.ones(1, 2))
    f = SharedEmbeddings.from_state_dict(e.state_dict())
    assert torch.equal(f.weight, e.weight) and torch.equal(f.accumulator, e.accumulator)
