"""The embedding row update (row-wise Adagrad / SGD, the one definition every shard uses) against hand computation,
a shard's staleness count, and the tables' lookups and pushes when their transport is replaced."""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch

from cocosync.shadowsync.model.embeddings import ShardedEmbeddings
from cocosync.shadowsync.model.lookup_thread import TransportClosed
from cocosync.shadowsync.model.shard import Shard, rowwise_update
from cocosync.shadowsync.model.transport import TransportCounters


def _shard(n: int, dim: int, optimizer: str, lr: float) -> Shard:
    return Shard(torch.zeros(n, dim), torch.zeros(n), torch.zeros(n, dtype=torch.int64), optimizer=optimizer, lr=lr)


def test_sgd_updates_only_the_given_rows():
    s = _shard(4, 2, "sgd", 0.5)
    s.apply(torch.tensor([2, 0]), torch.tensor([[2.0, 2.0], [4.0, 4.0]]), torch.zeros(2, dtype=torch.int64))
    assert s.weight[2].tolist() == [-1.0, -1.0] and s.weight[0].tolist() == [-2.0, -2.0]
    assert s.weight[1].abs().sum() == 0 and s.weight[3].abs().sum() == 0
    with pytest.raises(ValueError, match="optimizer='adam'"):
        _shard(3, 2, "adam", 0.1)


def test_rowwise_adagrad_matches_hand_computation():
    lr, eps = 0.1, 1e-8
    s = _shard(3, 2, "adagrad", lr)
    g1, g2 = torch.tensor([3.0, 4.0]), torch.tensor([1.0, 1.0])
    s.apply(torch.tensor([1]), g1[None], torch.zeros(1, dtype=torch.int64))
    stale = s.apply(torch.tensor([1]), g2[None], torch.zeros(1, dtype=torch.int64))
    acc1 = (g1 ** 2).mean()
    acc2 = acc1 + (g2 ** 2).mean()
    w = -lr * g1 / (acc1.sqrt() + eps) - lr * g2 / (acc2.sqrt() + eps)
    assert s.weight[1].tolist() == pytest.approx(w.tolist())
    assert s.accumulator[1].item() == pytest.approx(acc2.item())
    assert s.weight[0].abs().sum() == 0
    assert stale == 1 and s.versions.tolist() == [0, 2, 0]  # the second push came one update after its fetch


def test_rowwise_l2_adds_weight_decay_to_the_touched_rows_only():
    """FBGEMM's row-wise Adagrad with weight_decay_mode=L2: g' = g + wd * w, acc += mean(g'^2),
    w -= lr * g' / (sqrt(acc) + eps), on the rows of the batch; other rows keep their weights."""
    torch.manual_seed(0)
    w, acc = torch.randn(6, 4), torch.rand(6)
    rows, g = torch.tensor([1, 4]), torch.randn(2, 4)
    w0, acc0 = w.clone(), acc.clone()
    rowwise_update(w, acc, rows, g.clone(), "adagrad", 0.1, 1e-8, weight_decay=0.5)
    g2 = g + 0.5 * w0[rows]
    want_acc = acc0[rows] + g2.pow(2).mean(1)
    torch.testing.assert_close(acc[rows], want_acc)
    torch.testing.assert_close(w[rows], w0[rows] - 0.1 * g2 / (want_acc.sqrt() + 1e-8).unsqueeze(1))
    others = torch.tensor([0, 2, 3, 5])
    assert torch.equal(w[others], w0[others]) and torch.equal(acc[others], acc0[others])


def test_the_start_windows_wait_is_counted_apart_and_the_share_past_it_reported():
    """A trainer's first lookups wait for the first rounds whatever the run's length: their wait is counted apart, and
    the summary's share past the start windows takes the steps in proportion to the lookups (one a batch)."""
    from cocosync.shadowsync.job.summary import lookup_summary
    from cocosync.shadowsync.model.embeddings import LookupStats

    st = LookupStats(start_window=3)
    for blocked in (0.04, 0.03, 0.01, 0.0, 0.002, 0.0, 0.002):
        st.count(blocked, rows=10, remote=5, stale=0, received=0)
    assert st.start_lookups == 3 and st.start_wait_s == pytest.approx(0.08) and st.wait_s == pytest.approx(0.084)
    s = lookup_summary([st.as_dict(), st.as_dict()], examples=2 * 7 * 256, step_s=0.7, transport="exchange",
                       exchange=True, hot_rows=0)
    assert s["lookup_wait_fraction"] == pytest.approx(0.168 / 0.7)
    # 2 trainers x 7 lookups in 0.7 s of steps: past the windows 8 batches (0.4 s), waiting 0.008 s
    assert s["lookup_wait_past_start"] == pytest.approx(0.008 / 0.4)
    nothing = lookup_summary([LookupStats(start_window=3).as_dict()], examples=0, step_s=0.0, transport="exchange",
                             exchange=True, hot_rows=0)
    assert math.isnan(nothing["lookup_wait_past_start"])  # nothing past the start: no share, not 0



class _Rows:
    """A transport to server 1 of two (rows of width 2) that says what it was given; `closing()`, once set, runs as a
    call comes (the transport is replaced meanwhile), which then fails as on a closing transport."""

    def __init__(self):
        self.pushed, self.looked = [], []
        self.closing: Callable[[], None] | None = None

    def _call(self) -> None:
        if self.closing is not None:
            self.closing()
            raise TransportClosed("the lookup exchange is closed")

    def lookup(self, rows: torch.Tensor) -> torch.futures.Future:
        self._call()
        self.looked.append(rows.tolist())
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result((torch.zeros(len(rows), 2), torch.zeros(len(rows), dtype=torch.int64)))
        return fut

    def push(self, rows: torch.Tensor, grads: torch.Tensor, versions: torch.Tensor) -> None:
        self._call()
        self.pushed.append(rows.tolist())

    def take_stale(self) -> int:
        return 0

    def counters(self) -> TransportCounters:
        return TransportCounters(rounds=0, messages=0, wire_bytes=0, cpu_s=0.0)


def test_a_lookup_or_push_on_a_transport_replaced_while_a_worker_held_it_goes_to_the_one_that_replaced_it():
    old, new = _Rows(), _Rows()
    tables = ShardedEmbeddings([4], 2, [_shard(2, 2, "sgd", 0.1), "server 1"], remote=old)
    lk = tables.fetch(torch.tensor([[1], [3]]))  # (rows 1 and 3: server 1's)
    tables.wait(lk)
    assert old.looked == [[1, 3]]
    old.closing = lambda: tables.adopt({}, remote=new)  # (a machine joined as the worker called the old one)
    tables.push(lk, torch.ones(2, 2))
    assert new.pushed == [[1, 3]] and old.pushed == []
    tables.fetch(torch.tensor([[3]]))
    assert new.looked == [[3]]
    new.closing = lambda: None  # (closing, not replaced: the job's end)
    with pytest.raises(TransportClosed):
        tables.push(lk, torch.ones(2, 2))
