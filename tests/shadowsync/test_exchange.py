"""The lookup exchange (rounds of one gloo all_to_all between the trainers of every node): lookups and pushes equal
to the local tables bit for bit (one worker, fixed order), with pushes in flight, with several servers per node, and
a dead peer named in every waiting lookup."""

from __future__ import annotations

import pytest
import torch

from cocosync.shadowsync.model.embeddings import ServerLost, ShardedEmbeddings
from cocosync.shadowsync.model.shard import RowHash, Shard, initial_rows
from cocosync.testing.launch import RankPool

from .tables import ReferenceTables
from .test_param_server import DIM, ROWS, _drive

INTERVAL = 0.002


def _shards(servers: int, optimizer: str) -> list[Shard]:
    rowhash = RowHash(sum(ROWS), servers)
    out = []
    for s in range(servers):
        n = rowhash.shard_rows(s)
        w = initial_rows(ROWS, DIM, init_std=0.05, seed=3, rowhash=rowhash, server=s)
        out.append(Shard(w, torch.zeros(n), torch.zeros(n, dtype=torch.int64), optimizer=optimizer, lr=0.1))
    return out


def _exchange_rank(optimizer: str, per_node: int, in_order: bool, native: bool) -> dict:
    """Rank r is node r, holding servers r*per_node ... ; rank 1 drives a client, rank 0 only serves."""
    import torch.distributed as dist

    from cocosync.shadowsync.model.exchange import LookupExchange

    rank, nodes = dist.get_rank(), dist.get_world_size()
    S = per_node * nodes
    shards = _shards(S, optimizer)
    mine = {s: shards[s] for s in range(rank * per_node, (rank + 1) * per_node)}
    ex = LookupExchange(dist.group.WORLD, mine, servers=S, servers_per_node=per_node, dim=DIM, interval=INTERVAL,
                        labels=[f"node{n}" for n in range(nodes)], native=native)
    if rank == 0:
        ex.close()  # serves rank 1 until it is done too
        return {"rounds": ex.rounds}
    client = ShardedEmbeddings(ROWS, DIM, [mine.get(s, f"server{s}") for s in range(S)], remote=ex)
    local = ReferenceTables(ROWS, DIM, seed=3, optimizer=optimizer, lr=0.1)
    _drive(client, local, steps=8, in_order=in_order)
    snap = client.snapshot()  # every row, the remote shard's as one lookup
    client.close()
    stats = client.stats.as_dict()
    stats["snapshot_error"] = float((snap - local.weight).abs().max())
    return stats


# optimizer, servers per node, in order, rounds sorted in C++ (else the Python reference)
CASES = [("adagrad", 1, True, True), ("sgd", 2, True, True), ("adagrad", 1, False, True), ("adagrad", 2, True, False)]


def test_lookups_and_pushes_through_the_exchange_equal_the_shared_tables():
    with RankPool(2, timeout=120) as pool:  # one pool, the cases one after another (each its own exchange)
        results = [pool.run(_exchange_rank, *case) for case in CASES]
    for (optimizer, per_node, in_order, _), res in zip(CASES, results):
        stats = res[1]
        assert 0 < stats["remote_rows"] < stats["rows"]  # both a local and a remote shard were used
        assert stats["rounds"] > 0 and stats["messages"] == stats["rounds"] and stats["wire_bytes"] > 0
        assert res[0]["rounds"] >= stats["rounds"]  # the server kept serving until the client was done
        assert stats["stale_rows"] > 0
        if in_order:  # every push applied before the next fetch: no update in between
            assert stats["stale_sum"] == 0 and stats["snapshot_error"] == 0, (optimizer, per_node)
        assert stats["snapshot_error"] < 1e-5


def _lost_peer_rank() -> str:
    import os
    import threading

    import torch.distributed as dist

    from cocosync.shadowsync.model.exchange import LookupExchange

    rank = dist.get_rank()
    shards = _shards(2, "sgd")
    ex = LookupExchange(dist.group.WORLD, {rank: shards[rank]}, servers=2, servers_per_node=1, dim=DIM,
                        interval=INTERVAL, labels=["trainer0 (node 0)", "trainer1 (node 1)"])
    if rank == 0:  # gone without a word, as a killed process, once it has answered the pool
        dist.barrier()
        threading.Timer(0.5, os._exit, args=(0,)).start()
        return ""
    client = ShardedEmbeddings(ROWS, DIM, ["embedding0", shards[1]], remote=ex)
    dist.barrier()
    sparse = torch.stack([torch.arange(5) % r for r in ROWS], dim=1)
    text = "no error"
    try:
        for _ in range(500):
            client.lookup(sparse + client.offsets)
    except ServerLost as e:
        text = str(e)
    return text


def test_a_lost_peer_fails_the_lookups_naming_it():
    pool = RankPool(2, timeout=60)
    try:
        text = pool.run(_lost_peer_rank, timeout=60)[1]
    finally:
        pool.close(force=True)
    assert "embedding server embedding0 did not answer a lookup" in text
    assert "exchange with node 0 (trainer0 (node 0)) broke" in text


@pytest.mark.parametrize("servers,per_node,nodes", [(2, 1, 2), (8, 2, 4), (3, 3, 1), (6, 1, 6)])
def test_the_native_round_sort_gives_the_reference_bits(servers, per_node, nodes):
    from cocosync.runtime.comm import native
    from cocosync.shadowsync.model.exchange import sort_lookups, sort_pushes

    module = native.one_shot()
    if module is None:
        pytest.skip("no native module (no compiler or ninja, or COCOSYNC_NATIVE=0): the Python path runs")
    g = torch.Generator().manual_seed(servers)
    rows = [torch.randint(0, 2000, (k,), generator=g) for k in (300, 0, 1, 517)]  # repeats within and across parts
    rows.append(torch.tensor([(1 << 39) + 5, 7, (1 << 39) + 5]))  # rows up to the key's 40 bits
    ref, got = sort_lookups(rows, servers, per_node, nodes), sort_lookups(rows, servers, per_node, nodes, native=module)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]) and ref[2] == got[2]
    assert torch.equal(got[0][got[1]], torch.cat(rows))  # each row found at its position
    versions = [torch.randint(0, 50, (r.numel(),), generator=g) for r in rows]
    grads = [torch.randn(r.numel(), DIM, generator=g, dtype=torch.float64) for r in rows]  # cast to float32 on the way
    ref = sort_pushes(rows, versions, grads, servers, per_node, nodes)
    got = sort_pushes(rows, versions, grads, servers, per_node, nodes, native=module)
    assert all(torch.equal(a, b) for a, b in zip(ref[:3], got[:3])) and ref[3] == got[3]
    assert got[2].dtype == torch.float32 and sum(got[3]) == sum(r.numel() for r in rows)


def _part(counts: list[int], lookup: bool):
    from cocosync.shadowsync.model.exchange import _Part

    return _Part(torch.empty(0, dtype=torch.int64), torch.futures.Future() if lookup else None, counts=counts)


def test_a_round_sends_the_parts_that_fit_in_order_and_announces_room_for_the_rest():
    import collections

    from cocosync.shadowsync.model.exchange import _fit, _next_caps

    a, b, c = _part([0, 5, 1], True), _part([0, 4, 4], False), _part([0, 9, 0], True)
    sent, rest, used = _fit([a, b, c], [(0, 0), (10, 4), (10, 4)])
    assert sent == [a, b] and rest == [c]  # c's 9 lookups for node 1 exceed the 5 left; it stays after b
    assert used == ([0, 5, 1], [0, 4, 4])
    sent, rest, used = _fit([c, a], [(0, 0), (8, 0), (8, 0)])
    assert sent == [] and rest == [c, a] and used == ([0, 0, 0], [0, 0, 0])  # nothing overtakes a part that waits
    recent = collections.deque([([0, 5, 1], [0, 4, 4]), ([0, 2, 0], [0, 0, 0])], maxlen=8)
    caps = _next_caps(recent, [c], 3)
    assert caps == [(0, 0), (12, 5), (2, 5)]  # 1.25x the most sent, or what waits (c: 9 lookups for node 1)
    assert _next_caps(collections.deque([([0, 0], [0, 0])]), [], 2) == [(0, 0), (0, 0)]  # quiet: no room, no bytes


@pytest.mark.parametrize("nodes,me", [(2, 0), (4, 2), (6, 5)])
def test_the_native_round_packing_gives_the_reference_bytes(nodes, me):
    from cocosync.runtime.comm import native
    from cocosync.shadowsync.model.exchange import _Answer, _Round, pack_messages, sort_lookups, sort_pushes

    module = native.one_shot()
    if module is None:
        pytest.skip("no native module (no compiler or ninja, or COCOSYNC_NATIVE=0): the Python path runs")
    g = torch.Generator().manual_seed(nodes)
    # room announced by each peer: none (odd peers: no request), for lookups only (the next peer), or for both
    lookups_to = {p for p in range(nodes) if p != me and (p % 2 == 0 or p == (me + 1) % nodes)}
    pushes_to = {p for p in lookups_to if p != (me + 1) % nodes}
    rows = [torch.randint(0, 3000, (k,), generator=g) for k in (200, 31)]
    rows = [r[torch.tensor([int(x) % nodes in lookups_to for x in r], dtype=torch.bool)] for r in rows]
    pushed = torch.randint(0, 3000, (150,), generator=g)
    pushed = pushed[torch.tensor([int(x) % nodes in pushes_to for x in pushed], dtype=torch.bool)]
    rnd = _Round(grads=torch.empty(0, DIM))
    rnd.ids, _, rnd.looked = sort_lookups(rows, nodes, 1, nodes)  # servers = nodes: row r lives on node r % nodes
    rnd.push_ids, rnd.push_versions, rnd.grads, rnd.pushed = sort_pushes(
        [pushed], [torch.randint(0, 9, (pushed.numel(),), generator=g)],
        [torch.randn(pushed.numel(), DIM, generator=g)], nodes, 1, nodes)
    heads = torch.randint(0, 100, (nodes, 4), generator=g)
    owed = []
    for p in range(nodes):
        L = [0, 3, 17][p % 3]  # no answer, an answer to pushes alone (L = 0) or to lookups
        owed.append(None if p % 3 == 0 else _Answer(p, torch.arange(L) * 7, torch.randn(L, DIM, generator=g)))
    caps = [(rnd.looked[p] + p if p in lookups_to else 0, rnd.pushed[p] + p % 3 if p in pushes_to else 0)
            for p in range(nodes)]
    assert sum(rnd.looked) and (sum(rnd.pushed) or nodes == 2)  # 2 nodes: the one peer has room for lookups only
    ref = pack_messages(me, heads, owed, rnd, caps, DIM)
    got = pack_messages(me, heads, owed, rnd, caps, DIM, native=module)
    assert ref[1] == got[1] and ref[1][me] == 0 and sum(ref[1]) == ref[0].numel()
    assert torch.equal(ref[0], got[0])
    with pytest.raises(RuntimeError, match="larger than the room"):
        small = [(max(0, c[0] - p - 1), c[1]) if c[0] else c for p, c in enumerate(caps)]
        pack_messages(me, heads, owed, rnd, small, DIM, native=module)
