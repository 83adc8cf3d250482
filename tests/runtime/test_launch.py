import os

import pytest
import torch
import torch.distributed as dist

from cocosync.testing.launch import RankFailure, RankPool


def _sum_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item(), os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"]


def _fail_on_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    return dist.get_rank()


def _sleep_forever():
    import time
    time.sleep(60)


def test_pool_runs_collective_on_all_ranks(rank_pool):
    out = rank_pool(4, nnodes=2).run(_sum_ranks)
    assert [o[0] for o in out] == [6.0] * 4
    assert [(o[1], o[2]) for o in out] == [("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")]


def test_error_on_one_rank_names_it_and_closes_pool():
    pool = RankPool(2, timeout=30)
    with pytest.raises(RankFailure, match=r"(?s)rank 1.*boom on purpose"):
        pool.run(_fail_on_one)
    assert pool.closed
    assert not any(p.is_alive() for p in pool._procs)


def test_timeout_kills_ranks():
    pool = RankPool(2, timeout=30)
    with pytest.raises(RankFailure, match=r"did not finish within 2s"):
        pool.run(_sleep_forever, timeout=2)
    assert not any(p.is_alive() for p in pool._procs)
