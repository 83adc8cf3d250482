"""ShardMirror: two ranks (two machines' embedding servers) each copy the rows of their shard that changed into the
other's mirror of it; after the last round every mirror equals the shard it mirrors, bit for bit, versions and
accumulators included, and a round carries at most `max_rows` rows."""

from __future__ import annotations

import time

import pytest
import torch

from cocosync.shadowsync.model.shard import Shard
from cocosync.testing.launch import RankPool

ROWS, DIM = 5000, 8


def _shard(seed: int) -> Shard:
    gen = torch.Generator().manual_seed(seed)
    return Shard(torch.randn(ROWS, DIM, generator=gen), torch.rand(ROWS, generator=gen),
                 torch.zeros(ROWS, dtype=torch.int64), optimizer="adagrad", lr=0.1)


def _mirror_rank(max_rows: int) -> dict:
    import torch.distributed as dist

    from cocosync.shadowsync.model.shard_mirror import ShardMirror

    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    mine = _shard(rank)
    mirror = Shard(torch.zeros(ROWS, DIM), torch.zeros(ROWS), torch.zeros(ROWS, dtype=torch.int64),
                   optimizer="adagrad", lr=0.1)
    stamp = torch.zeros(1, dtype=torch.float64)
    m = ShardMirror(group, mine, mirror, stamp, interval=0.005, max_rows=max_rows)
    m.start()
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(20):  # rows updated in place while the mirror runs, as trainers do (Hogwild)
        ids = torch.randint(0, ROWS, (50,), generator=gen).unique()
        mine.apply(ids, torch.randn(ids.numel(), DIM, generator=gen), mine.versions[ids].clone())
        time.sleep(0.005)
    m.close()  # (both sides done: a last round each)
    return {"mine": {k: v.clone() for k, v in mine.state_dict().items()},
            "mirror": {k: v.clone() for k, v in mirror.state_dict().items()}, "stamp": float(stamp[0]),
            "rounds": m.rounds, "rows_sent": m.rows_sent, "error": repr(m.error) if m.error else None}


@pytest.mark.parametrize("max_rows", [2000, 100])
def test_each_mirror_ends_equal_to_the_shard_it_mirrors_and_rounds_are_bounded(max_rows):
    """(100 rows a round: the close comes before the first rounds have sent every row, and the rounds go on until
    they have.)"""
    with RankPool(2, timeout=120) as pool:
        res = pool.run(_mirror_rank, max_rows)
    for rank, r in enumerate(res):
        assert r["error"] is None, r["error"]
        other = res[1 - rank]
        for key in ("weight", "accumulator", "versions"):
            assert torch.equal(r["mirror"][key], other["mine"][key]), (rank, key)
        assert r["stamp"] > 0 and r["mine"]["versions"].sum() > 0
        # the 5,000 rows went in rounds of at most `max_rows`, then only the rows updated since
        assert r["rounds"] >= ROWS // max_rows and ROWS <= r["rows_sent"] < ROWS + 20 * 50 * 2
