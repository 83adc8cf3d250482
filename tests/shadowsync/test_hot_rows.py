"""Replicated hot rows (hot_rows.py): the hot set a sample gives, locating rows in it, and two nodes training hot,
local and remote rows at once: after `settle` both replicas, the owners' shards (`write_back`) and a snapshot equal
one table that received every update, and the update counts add up exactly."""

from __future__ import annotations

import pytest
import torch

from cocosync.shadowsync.model.embeddings import ShardedEmbeddings
from cocosync.shadowsync.model.hot_rows import HotRows, choose_hot_rows
from cocosync.shadowsync.model.shard import Shard
from cocosync.testing.launch import RankPool

from .tables import ReferenceTables
from .test_exchange import _shards
from .test_param_server import DIM, ROWS

HOT = torch.tensor([0, 1, 2, 3, 8, 9, 21, 24])  # global rows of both owners (row % 2), every table


def test_the_hot_set_is_the_rows_seen_most_often_the_same_for_the_same_sample():
    offsets = torch.tensor([0, 100])
    sparse = torch.tensor([[5, 7], [5, 7], [5, 8], [3, 8], [3, 9], [1, 9], [2, 0]])  # global: 5, 105, 107, 108, ...
    got = choose_hot_rows(sparse, offsets, 3)
    assert got.tolist() == [3, 5, 107]  # 5 x3; then 3, 107, 108, 109 x2 each: ties go to the lower row
    assert choose_hot_rows(sparse, offsets, 100).tolist() == [3, 5, 107, 108, 109]  # seen once: not hot
    assert choose_hot_rows(sparse, offsets, 0).numel() == 0
    assert torch.equal(choose_hot_rows(sparse.flip(0), offsets, 3), got)  # the rows' order does not matter


def test_locate_finds_the_hot_rows_and_their_slots():
    hot = HotRows(torch.tensor([2, 5, 9]), Shard(torch.zeros(3, DIM), torch.zeros(3), torch.zeros(3, dtype=torch.int64),
                                                 optimizer="sgd", lr=0.1))
    at, slots = hot.locate(torch.tensor([0, 2, 3, 9, 10, 5]))
    assert at.tolist() == [1, 3, 5] and slots.tolist() == [0, 2, 1]
    at, slots = hot.locate(torch.tensor([11, 12]))  # past the last hot row
    assert at.numel() == 0 and slots.numel() == 0


def _hot_rank(optimizer: str, steps: int) -> dict:
    import torch.distributed as dist

    from cocosync.shadowsync.model.exchange import LookupExchange
    from cocosync.shadowsync.model.hot_rows import HotSync

    rank = dist.get_rank()
    hot_group = dist.new_group([0, 1])  # the replicas' sync: its own group, as the job gives it
    shards = _shards(2, optimizer)
    mine = {rank: shards[rank]}
    H = HOT.numel()
    hot = HotRows(HOT, Shard(torch.zeros(H, DIM), torch.zeros(H), torch.zeros(H, dtype=torch.int64),
                             optimizer=optimizer, lr=0.1))
    sync = HotSync(hot, hot_group, interval=0.002)
    sync.fill(mine, 2)
    filled = hot.shard.weight.clone()
    sync.start()
    ex = LookupExchange(dist.group.WORLD, mine, servers=2, servers_per_node=1, dim=DIM, interval=0.002,
                        labels=["node0", "node1"])
    client = ShardedEmbeddings(ROWS, DIM, [mine.get(s, f"server{s}") for s in range(2)], remote=ex, hot=hot,
                               hot_sync=sync)
    gen = torch.Generator().manual_seed(10 + rank)  # each node its own batches and gradients
    updates = []
    for _ in range(steps):
        sparse = torch.stack([torch.randint(0, r, (6,), generator=gen) for r in ROWS], dim=1)
        lk = client.fetch(sparse + client.offsets)
        client.wait(lk)
        grads = torch.randn(lk.uniq.numel(), DIM, generator=gen)
        client.push(lk, grads)
        updates.append((lk.uniq.clone(), grads.clone()))
    client.flush()  # every remote push applied on its owner
    stats = client.stats.as_dict()
    sync.settle()  # both nodes here: every replica is the consensus
    hot.write_back(mine, 2)
    snap = client.snapshot()
    sync.close()
    client.close()
    return {"updates": updates, "snapshot": snap, "replica": hot.shard.weight.clone(), "filled": filled,
            "versions": hot.shard.versions.clone(), "shard": (mine[rank].weight.clone(), mine[rank].versions.clone()),
            "stats": stats, "syncs": sync.syncs}


def test_two_nodes_training_hot_local_and_remote_rows_equal_one_table():
    with RankPool(2, timeout=120) as pool:
        res = pool.run(_hot_rank, "sgd", 12)
    ref = ReferenceTables(ROWS, DIM, seed=3, optimizer="sgd", lr=0.1)
    assert torch.equal(res[0]["filled"], ref.weight[HOT]) and torch.equal(res[1]["filled"], ref.weight[HOT])
    counts = torch.zeros(sum(ROWS), dtype=torch.int64)
    for r in res:
        for uniq, grads in r["updates"]:
            ref.apply_rows(uniq, grads)  # SGD: the updates add up whatever their order
            counts[uniq] += 1
    for r in res:
        assert torch.allclose(r["replica"], ref.weight[HOT], atol=1e-6)  # both replicas: every node's updates
        assert torch.equal(r["versions"], counts[HOT])  # the update counts, exactly
        assert torch.allclose(r["snapshot"], ref.weight, atol=1e-6)  # hot, local and remote rows
        assert r["syncs"] >= 2
        st = r["stats"]
        assert 0 < st["hot_rows"] < st["rows"] and 0 < st["remote_rows"]
    for rank, r in enumerate(res):  # the owners' shards hold the hot rows again (a checkpoint saves them)
        weight, versions = r["shard"]
        assert torch.allclose(weight, ref.weight[rank::2], atol=1e-6)
        assert torch.equal(versions, counts[rank::2])
    assert sum(r["stats"]["hot_syncs"] for r in res) > 0


def test_replicated_rows_need_the_exchange():
    hot = HotRows(HOT, Shard(torch.zeros(8, DIM), torch.zeros(8), torch.zeros(8, dtype=torch.int64), optimizer="sgd",
                             lr=0.1))
    with pytest.raises(ValueError, match="need the lookup exchange"):
        ShardedEmbeddings(ROWS, DIM, _shards(2, "sgd"), hot=hot)


def test_the_native_pack_and_merge_give_the_reference_bits():
    from cocosync.runtime.comm import native
    from cocosync.shadowsync.model.hot_rows import merge_changes, pack_changes

    module = native.one_shot()
    if module is None:
        pytest.skip("no native module (no compiler or ninja, or COCOSYNC_NATIVE=0): the torch path runs")
    g = torch.Generator().manual_seed(0)
    H, dim = 37, 5

    def state():
        g.manual_seed(1)
        return (torch.randn(H, dim, generator=g), torch.rand(H, generator=g), torch.randint(0, 9, (H,), generator=g),
                torch.randn(H, dim, generator=g), torch.rand(H, generator=g), torch.randint(0, 9, (H,), generator=g))

    ref, got = state(), state()
    out_ref, out_got = torch.zeros(H * (dim + 2) + 2), torch.zeros(H * (dim + 2) + 2)
    pack_changes(*ref, out_ref)
    pack_changes(*got, out_got, native=module)
    assert torch.equal(out_ref, out_got)
    mine = out_ref[:-2].clone()
    total = out_ref + torch.randn(out_ref.shape, generator=g)
    total[H * (dim + 1):-2] = total[H * (dim + 1):-2].round()  # the counts the all-reduce sums are integers
    stale_ref = merge_changes(*ref, total.clone(), mine)
    stale_got = merge_changes(*got, total.clone(), mine, native=module)
    assert all(torch.equal(a, b) for a, b in zip(ref, got)) and stale_ref == pytest.approx(stale_got, rel=1e-12)
    assert torch.equal(ref[0], state()[0] + (total[:H * dim] - mine[:H * dim]).view(H, dim))  # replica += others


def test_a_two_node_checkpoint_holds_the_trained_hot_rows(tmp_path):
    """End to end: 2 loopback nodes train with the default hot set; the checkpoint's tables (the owners' shards, as
    saved) hold every hot row trained and counted, i.e. the replicas' consensus was written back before saving. With
    a tiny staleness bound the syncs come faster than the configured interval, and the summary splits staleness."""
    from pathlib import Path

    from cocosync.shadowsync.config import TrainConfig
    from cocosync.shadowsync.data.sources import build_configs, first_sparse
    from cocosync.shadowsync.model.hot_rows import HOT_SAMPLE_ROWS
    from cocosync.testing.multinode import run_nodes

    from .test_cluster_checkpoint import _load, _summary, _tables

    out = tmp_path / "run"
    runs = run_nodes(["-m", "cocosync.shadowsync", "--examples", "20000", "--eval-examples", "2000", "--sync", "none",
                      "--hot-staleness", "0.01", "--out", str(out)], nproc_per_node=2, timeout=240)
    assert all(r.returncode == 0 for r in runs), runs[0].output[-4000:]
    s = _summary(out)
    assert s["hot_rows"] == 4096 and s["hot_row_fraction"] > 0.5
    assert s["hot_syncs"] >= 3 and s["hot_sync_interval_ms"] < 40  # the bound shortened the interval
    assert 0 < s["hot_sync_longest_gap_ms"] < 60_000
    assert 0 < s["staleness_hot_sync"] and s["staleness_hot_sync"] + s["staleness_remote"] <= s["staleness"] + 1e-9
    cfg = TrainConfig(examples=20000, eval_examples=2000)
    data, model = build_configs(cfg)
    total = sum(data.table_sizes)
    offsets = torch.tensor([0, *torch.tensor(data.table_sizes).cumsum(0)[:-1].tolist()])
    hot = choose_hot_rows(first_sparse(cfg, data, HOT_SAMPLE_ROWS), offsets, 4096)  # the job's choice, recomputed
    assert hot.numel() == 4096
    state = _load(Path(s["checkpoint"]), tmp_path)
    table = _tables(state, 2, total)
    initial = torch.randn(total, model.embedding_dim, generator=torch.Generator().manual_seed(model.seed))
    initial.mul_(model.embedding_init_std)
    assert (table[hot] != initial[hot]).any(1).all()  # each hot row is in the data at least twice: trained
    versions = torch.empty(total, dtype=torch.int64)
    for server in range(2):
        versions[server::2] = state[f"emb.{server}.versions"]
    assert (versions[hot] >= 1).all() and versions[hot].sum() > versions.sum() / 2  # most updates went to them


def test_the_staleness_bound_scales_the_interval_between_its_limits():
    from cocosync.shadowsync.model.hot_rows import MIN_INTERVAL, next_interval

    assert next_interval(0.04, 16.0, 4.0, 0.04) == pytest.approx(0.02)  # 4x the bound: half the interval a sync
    assert next_interval(0.01, 1.0, 4.0, 0.04) == pytest.approx(0.02)  # under it: longer again
    assert next_interval(0.03, 1.0, 4.0, 0.04) == 0.04  # never past the configured interval
    assert next_interval(0.003, 1e6, 4.0, 0.04) == MIN_INTERVAL  # nor under the shortest
    assert next_interval(0.01, 0.0, 4.0, 0.04) == pytest.approx(0.02)  # nothing missed: back off


def _bound_rank(bound: float, seconds: float) -> dict:
    """Both nodes update every hot row every millisecond while the replicas sync with a staleness bound."""
    import time

    import torch.distributed as dist

    from cocosync.shadowsync.model.hot_rows import HotSync

    hot_group = dist.new_group([0, 1])
    H = HOT.numel()
    hot = HotRows(HOT, Shard(torch.zeros(H, DIM), torch.zeros(H), torch.zeros(H, dtype=torch.int64),
                             optimizer="sgd", lr=0.1))
    sync = HotSync(hot, hot_group, interval=0.02, staleness=bound)
    sync.fill({dist.get_rank(): _shards(2, "sgd")[dist.get_rank()]}, 2)
    sync.start()
    slots, updates, end = torch.arange(H), 0, time.monotonic() + seconds
    while time.monotonic() < end:
        hot.shard.apply(slots, torch.full((H, DIM), 1e-3), hot.shard.versions.clone())
        updates += 1
        time.sleep(0.001)
    sync.settle()
    versions = hot.shard.versions.clone()
    sync.close()
    return {"interval": sync.interval, "interval_sum": sync.interval_sum, "syncs": sync.syncs, "updates": updates,
            "versions": versions}


@pytest.mark.parametrize("bound", [0.0, 0.5])
def test_a_staleness_bound_syncs_more_often_the_same_on_every_node(bound):
    with RankPool(2, timeout=120) as pool:
        res = pool.run(_bound_rank, bound, 0.6)
    a, b = res
    assert a["syncs"] == b["syncs"] and a["interval_sum"] == b["interval_sum"]  # one schedule for both nodes
    for r in res:  # every node's updates counted on every replica
        assert torch.equal(r["versions"], torch.full_like(r["versions"], a["updates"] + b["updates"]))
    if bound == 0:
        assert a["interval"] == 0.02 and a["interval_sum"] == pytest.approx(0.02 * a["syncs"])
    else:  # each sync misses dozens of the other node's updates per row: the interval shrinks towards 2 ms
        assert a["interval"] < 0.006 and a["syncs"] > 0.6 / 0.02 * 2


def _join_rank(n1: int, n2: int, n3: int) -> dict:
    """Both nodes train the hot rows and sync; node 1 is lost (both stop syncing: node 0 goes on alone, its replica the
    truth); a fresh node 1 joins with an empty replica (`take`) while node 0's sync re-forms with it (`regroup(...,
    joined=True)`), and both train on."""
    import torch.distributed as dist

    from cocosync.shadowsync.model.hot_rows import HotSync

    me = dist.get_rank()
    first, second = dist.new_group([0, 1]), dist.new_group([0, 1])
    H = HOT.numel()

    def replica() -> HotRows:
        return HotRows(HOT, Shard(torch.zeros(H, DIM), torch.zeros(H), torch.zeros(H, dtype=torch.int64),
                                  optimizer="sgd", lr=0.1))

    def train(hot: HotRows, n: int) -> None:
        for _ in range(n):
            hot.shard.apply(torch.arange(H), torch.full((H, DIM), 1e-3 * (me + 1)), hot.shard.versions.clone())

    hot = replica()
    sync = HotSync(hot, first, interval=0.005)
    sync.fill({me: _shards(2, "sgd")[me]}, 2)
    sync.start()
    train(hot, n1)
    sync.settle()
    sync.abandon()  # (node 1: its loss; node 0: the other node is lost)
    dist.barrier()
    if me == 0:
        train(hot, n2)  # alone
        sync.regroup(second, "node 1", joined=True)
    else:
        hot = replica()  # a new machine: nothing of the old one
        sync = HotSync(hot, second, interval=0.005)
        sync.take()
        sync.start()
    train(hot, n3)
    sync.settle()
    sync.close()
    return {"weight": hot.shard.weight.clone(), "versions": hot.shard.versions.clone()}


def test_a_node_that_joins_takes_the_consensus_and_the_syncs_go_on_with_it():
    n1, n2, n3 = 5, 7, 3
    with RankPool(2, timeout=120) as pool:
        a, b = pool.run(_join_rank, n1, n2, n3)
    # every update of both nodes, node 0's alone included, is on both replicas, and they agree
    assert torch.equal(a["versions"], torch.full_like(a["versions"], 2 * n1 + n2 + 2 * n3))
    assert torch.equal(a["versions"], b["versions"])
    assert torch.allclose(a["weight"], b["weight"], atol=1e-6)
    assert not torch.equal(a["weight"], torch.zeros_like(a["weight"]))
