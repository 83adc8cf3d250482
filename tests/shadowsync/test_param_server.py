"""Embedding parameter servers: row-hash sharding, and lookups/pushes through RPC equal to the local tables bit for
bit (one worker, fixed order), with a local shard and a remote one in the same client."""

from __future__ import annotations

import pytest
import torch

from cocosync.shadowsync.model.embeddings import ShardedEmbeddings
from cocosync.shadowsync.model.shard import RowHash, Shard, initial_rows
from cocosync.shadowsync.model.transport import RpcRows
from cocosync.testing.launch import RankPool

from .tables import ReferenceTables

ROWS, DIM = [7, 13, 5], 4


def _shards(rowhash: RowHash, optimizer: str, seed: int = 3) -> list[Shard]:
    out = []
    for s in range(rowhash.servers):
        n = rowhash.shard_rows(s)
        w = initial_rows(ROWS, DIM, init_std=0.05, seed=seed, rowhash=rowhash, server=s)
        out.append(Shard(w, torch.zeros(n), torch.zeros(n, dtype=torch.int64), optimizer=optimizer, lr=0.1))
    return out


def test_row_hash_covers_every_row_once_and_starts_from_the_local_tables():
    rowhash = RowHash(sum(ROWS), 3)
    assert sum(rowhash.shard_rows(s) for s in range(3)) == sum(ROWS)
    local = ReferenceTables(ROWS, DIM, seed=3)
    for s, shard in enumerate(_shards(rowhash, "adagrad")):
        assert torch.equal(shard.weight, local.weight[s::3])
    with pytest.raises(ValueError, match="servers >= 1"):
        RowHash(10, 0)


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_local_shards_equal_the_shared_tables(optimizer):
    rowhash = RowHash(sum(ROWS), 2)
    client = ShardedEmbeddings(ROWS, DIM, _shards(rowhash, optimizer))
    local = ReferenceTables(ROWS, DIM, seed=3, optimizer=optimizer, lr=0.1)
    _drive(client, local, steps=6)


def _drive(client: ShardedEmbeddings, local: ReferenceTables, steps: int, in_order: bool = True) -> None:
    """Fetch, compare with the local tables, push the same gradients to both; at the end every row is equal.
    `in_order`: each push is applied before the next fetch (one worker, fixed order: bit for bit at every step);
    else pushes stay in flight (the servers may apply them after later fetches, and in either order)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        sparse = torch.stack([torch.randint(0, r, (9,), generator=gen) for r in ROWS], dim=1)  # duplicates on purpose
        lk = client.fetch(sparse + client.offsets)  # the job's global rows: ids + their table's first row
        rows = client.wait(lk)
        expected = torch.stack([local.tables[t][sparse[:, t]] for t in range(len(ROWS))], dim=1)
        if in_order:
            assert torch.equal(rows[lk.inverse], expected)
        grads = torch.randn(lk.uniq.numel(), DIM, generator=gen)
        client.push(lk, grads)
        if in_order:
            client.flush()
        local.apply_rows(lk.uniq, grads)
    client.flush()
    every = torch.stack([torch.arange(sum(ROWS)) % r for r in ROWS], dim=1)
    got = client.lookup(every + client.offsets)
    for t in range(len(ROWS)):
        want = local.tables[t][every[:, t]]
        assert torch.equal(got[:, t], want) if in_order else torch.allclose(got[:, t], want, rtol=1e-5, atol=1e-6)
    assert client.stats.pushes == steps and client.stats.lookups == steps + 1


def _reset_served(optimizer: str) -> None:
    from cocosync.shadowsync.model.transport import serve_shard

    serve_shard(1, _shards(RowHash(sum(ROWS), 2), optimizer)[1])


def _rpc_rank(optimizer: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    from cocosync.shadowsync.model.transport import serve_shard

    rank = dist.get_rank()
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
        init_method="env://", rpc_timeout=60, _transports=["uv"], _channels=["basic"]))
    try:
        rowhash = RowHash(sum(ROWS), 2)
        shards = _shards(rowhash, optimizer)
        if rank == 0:
            serve_shard(1, shards[1])  # server 1 lives here; rank 1 reads server 0 locally and server 1 by RPC
        dist.barrier()  # served before the first lookup (the job's set-up ends with the same barrier)
        if rank == 0:
            return {}
        client = ShardedEmbeddings(ROWS, DIM, [shards[0], "w0"], remote=RpcRows([None, "w0"], DIM, max_inflight=2))
        local = ReferenceTables(ROWS, DIM, seed=3, optimizer=optimizer, lr=0.1)
        _drive(client, local, steps=8)
        stats = client.stats.as_dict()
        # pushes in flight (up to max_inflight): the same updates reach the servers, the end state agrees
        rpc.rpc_sync("w0", _reset_served, args=(optimizer,))
        client = ShardedEmbeddings(ROWS, DIM, [_shards(rowhash, optimizer)[0], "w0"],
                                   remote=RpcRows([None, "w0"], DIM, max_inflight=2))
        _drive(client, ReferenceTables(ROWS, DIM, seed=3, optimizer=optimizer, lr=0.1), steps=8, in_order=False)
        return stats
    finally:
        rpc.shutdown()


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_lookups_and_pushes_through_rpc_equal_the_shared_tables_bit_for_bit(optimizer):
    with RankPool(2, timeout=120) as pool:
        stats = pool.run(_rpc_rank, optimizer)[1]
    assert 0 < stats["remote_rows"] < stats["rows"]  # both a local and a remote shard were used
    assert stats["rpc_calls"] == 9 and stats["bytes_received"] > 0
    assert stats["stale_rows"] > 0  # one worker, fixed order: every push is measured (0 updates in between)
    assert stats["stale_sum"] == 0


def test_a_group_of_batches_shares_one_lookup_and_each_batch_gets_its_own_rows():
    rowhash = RowHash(sum(ROWS), 2)
    client = ShardedEmbeddings(ROWS, DIM, _shards(rowhash, "sgd"), group=3)
    local = ReferenceTables(ROWS, DIM, seed=3, optimizer="sgd", lr=0.1)
    gen = torch.Generator().manual_seed(1)
    batches = [_Batch(torch.stack([torch.randint(0, r, (5,), generator=gen) for r in ROWS], dim=1)) for _ in range(7)]
    seen = 0
    for batch, lk in client.prefetching(batches, lambda b: b.sparse + client.offsets, depth=2):
        rows = client.wait(lk)
        expected = torch.stack([local.tables[t][batch.sparse[:, t]] for t in range(len(ROWS))], dim=1)
        assert torch.equal(rows[lk.inverse], expected)  # nothing pushed yet: the group's rows are the tables'
        seen += 1
    assert seen == 7 and client.stats.lookups == 3  # groups of 3, 3 and 1 batches


class _Batch:
    def __init__(self, sparse: torch.Tensor):
        self.sparse = sparse


def test_staleness_counts_updates_between_fetch_and_push():
    rowhash = RowHash(sum(ROWS), 1)
    client = ShardedEmbeddings(ROWS, DIM, _shards(rowhash, "sgd"))
    sparse = torch.zeros(2, len(ROWS), dtype=torch.int64)
    ids = sparse + client.offsets
    first, second = client.fetch(ids), client.fetch(ids)  # both read the same rows at version 0
    client.wait(first), client.wait(second)
    client.push(first, torch.ones(first.uniq.numel(), DIM))
    client.push(second, torch.ones(second.uniq.numel(), DIM))  # each of its rows got one update since the fetch
    assert client.stats.stale_sum == second.uniq.numel()
