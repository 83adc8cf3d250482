"""What one embedding-server message costs the server: CPU per call and per row, fitted from two lookup sizes between
two ranks through the trainers' client (each message a lookup with the previous batch's gradients riding on it), the
scaling model's server term."""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from cocosync.shadowsync.model.embeddings import ShardedEmbeddings
from cocosync.shadowsync.model.shard import Shard
from cocosync.shadowsync.model.transport import RpcRows, serve_shard
from cocosync.testing.launch import RankPool

__all__ = ["measure_server_costs"]

SHARD_ROWS, DIM = 130_000, 16


def _shard() -> Shard:
    n = SHARD_ROWS
    return Shard(torch.randn(n, DIM), torch.zeros(n), torch.zeros(n, dtype=torch.int64), optimizer="adagrad", lr=0.05)


def _rank(sizes: tuple[int, ...], calls: int) -> list[float]:
    """Rank 0 serves, rank 1 looks up and pushes; returns rank 0's CPU seconds per message for each size."""
    r = dist.get_rank()
    with warnings.catch_warnings():  # torch's own RPC init passes its gloo Backend as a group (deprecated use)
        warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
        rpc.init_rpc(f"w{r}", rank=r, world_size=2, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method="env://", _transports=["uv"], _channels=["basic"]))
    out = []
    try:
        if r == 0:
            serve_shard(0, _shard())
        dist.barrier()  # served before the first lookup
        for n in sizes:
            dist.barrier()
            cpu0 = time.process_time()
            if r == 1:
                client = ShardedEmbeddings([SHARD_ROWS], DIM, ["w0"], remote=RpcRows(["w0"], DIM))
                sparse = torch.randperm(SHARD_ROWS)[:n].view(-1, 1)
                for _ in range(calls):
                    lk = client.fetch(sparse)
                    client.push(lk, client.wait(lk))
                client.flush()
            dist.barrier()
            out.append((time.process_time() - cpu0) / calls)
    finally:
        rpc.shutdown()
    return out


def measure_server_costs(small: int = 16, large: int = 4096, calls: int = 200) -> dict:
    """{'call_s': server CPU per message, 'row_s': per row (its lookup and its gradient), the raw points}."""
    with RankPool(2, timeout=300) as pool:
        per_call = pool.run(_rank, (small, large), calls)[0]
    row_s = max(per_call[1] - per_call[0], 0.0) / (large - small)
    call_s = max(per_call[0] - small * row_s, 0.0)
    return {"call_s": call_s, "row_s": row_s, "points": {small: per_call[0], large: per_call[1]}}
