"""One lookup exchange per node: a second trainer of a node relays its lookups and pushes through its node's leader
(node_relay.py), equal to the local tables bit for bit, and it learns when the leader's exchange breaks."""

from __future__ import annotations

import torch

from cocosync.shadowsync.model.embeddings import RowHash, Shard, ShardedEmbeddings, initial_rows
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
    """Rank 0: node 0 (server 0). Ranks 1 and 2: node 1 (server 1); rank 1 leads its exchange, rank 2 drives a
    client whose remote rows go through rank 1."""
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
    relay = RelayClient(box, lambda rows: rows % 2, n=2, dim=DIM, interval=INTERVAL, leader="trainer1")
    client = ShardedEmbeddings(ROWS, DIM, ["embedding0", shard], exchange=relay)
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
