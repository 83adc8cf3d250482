"""One lookup exchange per node: a second trainer of a node relays its lookups and pushes through its node's leader
(node_relay.py), equal to the local tables bit for bit, and it learns when the leader's exchange breaks."""

from __future__ import annotations

import time

import pytest
import torch

from cocosync.shadowsync.model.embeddings import ShardedEmbeddings
from cocosync.shadowsync.model.shard import RowHash, Shard, initial_rows
from cocosync.testing.launch import RankPool

from .tables import ReferenceTables
from .test_exchange import INTERVAL
from .test_param_server import DIM, ROWS, _drive


def _shared(path: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=n, dtype=dtype)


def _node_shard(d: str, rowhash: RowHash, server: int, optimizer: str) -> Shard:
    """Server `server`'s shard in files both processes of its node map (the node's shared memory in a job)."""
    n = rowhash.shard_rows(server)
    w = _shared(f"{d}/w{server}", n * DIM, torch.float32).view(n, DIM)
    acc, versions = _shared(f"{d}/a{server}", n, torch.float32), _shared(f"{d}/v{server}", n, torch.int64)
    return Shard(w, acc, versions, optimizer=optimizer, lr=0.1)


def _relay_rank(d: str, optimizer: str, in_order: bool) -> dict:
    """Rank 0: node 0 (server 0). Ranks 1 and 2: node 1 (server 1); rank 1 runs the node's exchange (as a node's
    first embedding server does), rank 2 drives a trainer's tables whose remote rows go through rank 1."""
    import torch.distributed as dist

    from cocosync.shadowsync.model.exchange import LookupExchange
    from cocosync.shadowsync.model.node_relay import Mailbox, RelayClient, RelayHost, mailbox_nbytes

    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    rowhash = RowHash(sum(ROWS), 2)
    node = min(rank, 1)
    shard = _node_shard(d, rowhash, node, optimizer)
    slot = mailbox_nbytes(sum(ROWS), DIM)
    box = Mailbox.of(_shared(f"{d}/box", Mailbox.nbytes(slot), torch.uint8), slot)
    if rank < 2:
        shard.weight.copy_(initial_rows(ROWS, DIM, init_std=0.05, seed=3, rowhash=rowhash, server=node))
    if rank == 1:
        box.control.zero_()
    dist.barrier()
    if rank < 2:
        ex = LookupExchange(group, {node: shard}, servers=2, servers_per_node=1, dim=DIM, interval=INTERVAL,
                            labels=["node0", "node1"], relays=RelayHost([box], DIM) if rank == 1 else None)
        ex.close()  # serves until every peer (and the client relaying through it) is done
        return {"rounds": ex.rounds, "relayed": ex.relays.relayed_bytes if ex.relays else 0}
    relay = RelayClient(box, n=2, dim=DIM, interval=INTERVAL, leader="trainer1")
    client = ShardedEmbeddings(ROWS, DIM, ["embedding0", shard], remote=relay)
    local = ReferenceTables(ROWS, DIM, seed=3, optimizer=optimizer, lr=0.1)
    _drive(client, local, steps=8, in_order=in_order)
    snap = client.snapshot()
    client.close()
    stats = client.stats.as_dict()
    stats["snapshot_error"] = float((snap - local.weight).abs().max())
    stats["relayed"] = relay.relayed_bytes
    return stats


def test_a_second_trainer_of_a_node_looks_up_and_pushes_through_its_leader(tmp_path):
    cases = [("adagrad", True), ("sgd", False)]
    with RankPool(3, timeout=120) as pool:
        results = []
        for i, case in enumerate(cases):
            (tmp_path / str(i)).mkdir()
            results.append(pool.run(_relay_rank, str(tmp_path / str(i)), *case))
    for (optimizer, in_order), res in zip(cases, results):
        stats = res[2]
        assert 0 < stats["remote_rows"] < stats["rows"]  # local rows read in place, remote ones relayed
        assert stats["rounds"] == stats["messages"] == 0 and stats["relayed"] > 0  # nothing sent by the client
        assert res[1]["rounds"] > 0 and res[1]["relayed"] > 0 and res[0]["rounds"] >= res[1]["rounds"] - 1
        if in_order:
            assert stats["snapshot_error"] == 0, optimizer
        assert stats["snapshot_error"] < 1e-5


def _box(slot: int):
    from cocosync.shadowsync.model.node_relay import Mailbox

    return Mailbox.of(torch.zeros(Mailbox.nbytes(slot), dtype=torch.uint8), slot)


def test_the_rings_carry_more_parts_than_slots_in_order_and_answer_each_lookup():
    """In one process: a client queues 40 lookups, 10 pushes and a lookup larger than a slot; the host takes them a
    round at a time (more requests than slots wait for room), answers each lookup with rows derived from its ids, and
    every future gets its own rows; pushes applied are counted back so flush returns."""
    from cocosync.shadowsync.model.node_relay import SLOTS, RelayClient, RelayHost

    dim, box = 3, _box(1024)  # ~5 parts a request: 40 lookups take more requests than the ring has slots
    host = RelayHost([box], dim)
    client = RelayClient(box, n=2, dim=dim, interval=0.004, leader="trainer0", timeout=10)
    futures, pushed = [], []
    for i in range(40):
        futures.append(client.lookup(torch.arange(i, i + 5)))
        if i % 4 == 0:
            client.push(torch.tensor([i]), torch.full((1, dim), float(i)), torch.tensor([7]))
    big = client.lookup(torch.arange(1000, 1200))  # more rows than a slot holds: sent in pieces, answered as one
    got_parts = []

    def make_part(ids, future, versions, grads, owner):
        got_parts.append((ids.clone(), future, versions, grads, owner))
        return got_parts[-1]

    start = time.monotonic()
    while not all(f.done() for f in [*futures, big]) and time.monotonic() - start < 20:
        time.sleep(0.004)
        parts = host.take(make_part)
        for ids, future, versions, grads, owner in parts:
            assert owner == 0
            if future is None:
                pushed.append((int(ids[0]), float(grads[0, 0]), int(versions[0])))
                host.applied(owner, 1)
            else:
                future.set_result((ids.double().unsqueeze(1).expand(-1, dim).float() * 2, ids + 100))
        host.deliver()
    client.flush()
    for i, f in enumerate(futures):
        rows, versions = f.wait()
        assert torch.equal(versions, torch.arange(i, i + 5) + 100)
        assert torch.equal(rows, (torch.arange(i, i + 5).float() * 2).unsqueeze(1).expand(-1, dim))
    rows, versions = big.wait()
    assert torch.equal(versions, torch.arange(1000, 1200) + 100) and rows.shape == (200, dim)
    assert pushed == [(i, float(i), 7) for i in range(0, 40, 4)]
    client.close()  # idle: closes at its next poll
    assert host.idle() and int(box.words[0]) > SLOTS  # requests published: the ring wrapped


def test_a_client_learns_when_its_leader_fails_or_stops_running_rounds():
    from cocosync.shadowsync.model.exchange import ExchangeLost
    from cocosync.shadowsync.model.node_relay import RelayClient, RelayHost, mailbox_nbytes

    box = _box(mailbox_nbytes(16, 2))
    client = RelayClient(box, n=2, dim=2, interval=0.004, leader="trainer4 (rank 4)", timeout=0.3)
    time.sleep(0.5)  # no round yet, but nothing waits for one: not late
    with pytest.raises(ExchangeLost, match=r"trainer4 \(rank 4\), which runs this node's lookup exchange, ran no "
                                           r"round in 0.3 s"):
        client.lookup(torch.arange(3)).wait()
    with pytest.raises(ExchangeLost):
        client.lookup(torch.arange(3))  # later calls fail at once

    box = _box(mailbox_nbytes(16, 2))
    client = RelayClient(box, n=2, dim=2, interval=0.004, leader="trainer4 (rank 4)", timeout=30)
    fut = client.lookup(torch.arange(3))
    RelayHost([box], 2).fail()  # the leader's exchange with the other nodes broke
    with pytest.raises(ExchangeLost, match=r"the node's lookup exchange on trainer4 \(rank 4\) broke"):
        fut.wait()
