"""The cocosync backend across (simulated) nodes: 4 ranks on 2 nodes of 2, shared memory within each node and gloo
between them, every collective equal to its definition; a group spanning nodes that is not the whole job uses gloo."""

from __future__ import annotations

import torch


def _across_nodes():
    import torch.distributed as dist

    from cocosync.runtime.comm.backend import register

    register()
    pg = dist.new_group(backend="cocosync")
    r, P = dist.get_rank(), dist.get_world_size()
    out = {}
    t = torch.arange(6.0) + r
    dist.all_reduce(t, group=pg)
    out["all_reduce"] = t
    t = torch.full((5,), float(r))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    out["max"] = t
    t = torch.full((3,), float(r))
    dist.broadcast(t, src=3, group=pg)
    out["broadcast"] = t
    o = torch.empty(2 * P)
    dist.all_gather_into_tensor(o, torch.full((2,), float(r)), group=pg)
    out["all_gather"] = o
    o = torch.empty(2)
    dist.reduce_scatter_tensor(o, torch.arange(2.0 * P), group=pg)
    out["reduce_scatter"] = o
    out["nnodes"] = pg._shm.nnodes if pg._shm is not None else 0
    cross = dist.new_group(ranks=[1, 2], backend="cocosync")  # spans the nodes, not the whole job: gloo
    if r in (1, 2):
        t = torch.full((2,), float(r))
        dist.all_reduce(t, group=cross)
        out["cross"] = t
        out["cross_shm"] = cross._shm is not None
    return out


def test_backend_across_nodes(rank_pool):
    got = rank_pool(4, nnodes=2).run(_across_nodes)
    P = 4
    for r, out in enumerate(got):
        assert out["nnodes"] == 2, out
        assert torch.equal(out["all_reduce"], torch.arange(6.0) * P + sum(range(P)))
        assert torch.equal(out["max"], torch.full((5,), 3.0))
        assert torch.equal(out["broadcast"], torch.full((3,), 3.0))
        assert torch.equal(out["all_gather"], torch.arange(P).repeat_interleave(2).float())
        assert torch.equal(out["reduce_scatter"], (torch.arange(2.0 * P) * P)[2 * r:2 * r + 2])
        if r in (1, 2):
            assert torch.equal(out["cross"], torch.full((2,), 3.0)) and not out["cross_shm"]
