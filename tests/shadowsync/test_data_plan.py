"""Data plans (resuming on another trainer count): the unread rows of every old reader shard are cut onto the new
shards so that every row of the budget is read exactly once across the runs, through the real sources."""

from __future__ import annotations

import pytest
import torch

from cocosync.shadowsync.data.criteo import Batch
from cocosync.shadowsync.data.plan import DataPlan, PlannedSource, base_plan, replan, split_plan, unread
from cocosync.shadowsync.data.sources import Epochs, InMemorySource

ROWS = 1000


def _source(epochs: int = 1):
    """Rows whose first dense feature is their index."""
    idx = torch.arange(ROWS, dtype=torch.float32)
    data = Batch(idx[:, None].repeat(1, 2), torch.zeros(ROWS, 3, dtype=torch.int64), torch.zeros(ROWS), None)
    inner = InMemorySource(data)
    return inner if epochs == 1 else Epochs(inner, epochs)


def _read(source, shard: int, shards: int, start: int = 0, batch: int = 32) -> list[int]:
    return [int(v) for b in source.batches(shard, shards, batch, start) for v in b.dense[:, 0]]


def test_split_is_contiguous_and_balanced():
    plan = split_plan([(0, 5, 10), (1, 0, 3), (2, 7, 8)], 3)
    assert [sum(r for *_, r in s) for s in plan] == [7, 7, 7]
    assert plan == [[(0, 5, 7)], [(0, 12, 3), (1, 0, 3), (2, 7, 1)], [(2, 8, 7)]]
    assert unread(plan, [7, 5, 0]) == [(1, 2, 1), (2, 7, 1), (2, 8, 7)]


def test_unread_skips_each_shards_position_across_its_segments():
    plan = [[(0, 5, 7)], [(0, 12, 3), (1, 0, 3), (2, 7, 1)]]
    assert unread(plan, [7, 4]) == [(1, 1, 2), (2, 7, 1)]
    assert unread(plan, [0, 7]) == [(0, 5, 7)]
    with pytest.raises(ValueError, match="3 reader positions for a plan of 2 shards"):
        unread(plan, [0, 0, 0])


@pytest.mark.parametrize("old_shards,new_shards,epochs", [(4, 2, 1), (2, 6, 1), (3, 5, 2), (6, 6, 1)])
def test_every_row_is_read_once_across_a_stop_and_a_resume_on_other_shard_counts(old_shards, new_shards, epochs):
    src = _source(epochs)
    positions = [37 * (s + 1) % src.shard_rows(s, old_shards) for s in range(old_shards)]
    before = [r for s in range(old_shards) for r in _read(src, s, old_shards)[:positions[s]]]
    plan = replan(None, old_shards, positions, new_shards, src.shard_rows, seen=len(before))
    assert plan.examples_before == sum(positions) and plan.base_shards == old_shards
    planned = PlannedSource(src, plan.base_shards, plan.shards)
    after = [r for s in range(new_shards) for r in _read(planned, s, new_shards)]
    assert sorted(before + after) == sorted(list(range(ROWS)) * epochs)
    sizes = [planned.shard_rows(s, new_shards) for s in range(new_shards)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(after)
    # a planned shard resumed part-way (same count: positions index into the plan) reads the rest of it
    assert _read(planned, 1, new_shards, start=5) == _read(planned, 1, new_shards)[5:]
    # and a second reshard composes: stop the planned run part-way and plan again onto 3 shards
    pos2 = [min(11, n) for n in sizes]
    read2 = [r for s in range(new_shards) for r in _read(planned, s, new_shards)[:pos2[s]]]
    plan2 = replan(plan, new_shards, pos2, 3, src.shard_rows, seen=len(before) + len(read2))
    again = PlannedSource(src, plan2.base_shards, plan2.shards)
    rest = [r for s in range(3) for r in _read(again, s, 3)]
    assert sorted(before + read2 + rest) == sorted(list(range(ROWS)) * epochs)
    assert DataPlan.from_json(plan2.as_json()) == plan2  # it travels in meta.json
    with pytest.raises(ValueError, match="a plan of 3 shards read as 2 shards"):
        again.shard_rows(0, 2)


def test_base_plan_reads_each_source_shard_whole():
    src = _source()
    plan = base_plan(3, lambda s: src.shard_rows(s, 3))
    planned = PlannedSource(src, 3, plan)
    assert [_read(planned, s, 3) for s in range(3)] == [_read(src, s, 3) for s in range(3)]
