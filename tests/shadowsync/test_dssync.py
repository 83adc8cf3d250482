"""DS-Sync: per-round groups from a shared seed (a partition of the trainers), averaging within each group against a
hand computation on 4 real ranks, the done protocol across groups, and a short training run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cocosync.shadowsync.config import ConfigError, SyncConfig, TrainConfig
from cocosync.shadowsync.job.launch import run_training
from cocosync.shadowsync.sync import DSSync, make_sync
from cocosync.shadowsync.sync.dssync import partition


def test_every_round_partitions_the_trainers_and_reshuffles():
    seen = set()
    for r in range(20):
        groups = partition(5, 2, seed=3, round_index=r)
        assert sorted(m for g in groups for m in g) == list(range(5))  # each trainer in exactly one group
        assert sorted(len(g) for g in groups) == [2, 3]
        assert groups == partition(5, 2, seed=3, round_index=r)  # the same on every trainer
        seen.add(tuple(groups))
    assert len(seen) > 3  # membership changes over rounds
    assert sorted(partition(4, 4, 0, 0)) == [(0,), (1,), (2,), (3,)]  # G = T: every trainer alone


def test_groups_beyond_the_trainer_count_are_refused():
    with pytest.raises(ConfigError, match=r"sync.groups=3 .*at most trainers=2"):
        TrainConfig(trainers=2, sync=SyncConfig(algorithm="shadow-dssync", groups=3))


def _x(rank: int) -> torch.Tensor:
    return torch.tensor([1.0, -2.0, 3.0]) * (rank + 1) + rank * rank


def _dssync_rank(rounds: int, compiled: bool):
    r = dist.get_rank()
    x = _x(r)
    algo = make_sync(x, SyncConfig(algorithm="fr-dssync", groups=2, shuffle_seed=7, compiled=compiled))
    assert isinstance(algo, DSSync)
    out = []
    for k in range(rounds):
        x.add_(float(k + 1) * (r + 1))  # local training between rounds
        n = algo.sync()
        out.append((x.clone(), algo.last_group, n))
        out[-1] += (dist.get_backend(algo.round_group),)  # the group the rounds reduce on: its backend
    return out


@pytest.mark.parametrize("compiled,backend", [(True, "cocosync"), (False, "gloo")], ids=["shared-memory", "gloo"])
def test_each_round_averages_within_its_group_only(rank_pool, compiled, backend):
    rounds, world = 3, 4
    local = [_x(r) for r in range(world)]
    ref = []
    for k in range(rounds):
        local = [x + float(k + 1) * (r + 1) for r, x in enumerate(local)]
        groups = partition(world, 2, seed=7, round_index=k)
        for g in groups:
            mean = sum(local[m] for m in g) / len(g)
            for m in g:
                local[m] = mean.clone()
        ref.append(([x.clone() for x in local], groups))
    for r, rank_out in enumerate(rank_pool(world).run(_dssync_rank, rounds, compiled)):
        for (x, group, n, used), (xs, groups) in zip(rank_out, ref):
            assert group in groups and r in group and n == world
            assert used == backend, used  # the groups' averages ran through shared memory, or gloo
            torch.testing.assert_close(x, xs[r])


def _done_rank():
    r = dist.get_rank()
    algo = make_sync(torch.zeros(2), SyncConfig(algorithm="fr-dssync", groups=2))
    rounds, counts = 0, []
    while True:
        n = algo.sync(active=rounds < (3 if r == 0 else 1))
        counts.append(n)
        rounds += 1
        if n == 0:
            return counts


def test_finished_trainers_keep_joining_until_every_group_is_done(rank_pool):
    for counts in rank_pool(4).run(_done_rank):
        assert counts == [4, 1, 1, 0]  # the active count is over all trainers, not the round's group


def test_shadow_dssync_trains(tmp_path):
    # 60,000 examples: NE 0.73-0.74 here (0.78-0.86 at 30,000, and 0.954 once in a CI run, over the bound)
    cfg = TrainConfig(examples=60_000, eval_examples=4_000, trainers=3, batch_size=128, progress=False, plot=False,
                      out_dir=str(tmp_path / "ds"), data_options={"table_size": 2000}, timeout=120,
                      model={"embedding_dim": 8, "bottom_mlp": [32, 8], "top_mlp": [32]},
                      sync=SyncConfig(algorithm="shadow-dssync", groups=2))
    s = run_training(cfg).summary
    assert s["examples"] == 60_000 and s["syncs"] > 3 and s["eval_ne"] < 0.95, s
