"""The trainers' hierarchical all-reduce across nodes (reduce-scatter within a node on the cocosync backend, the slice
across nodes on gloo, all-gather within the node) equals a plain all-reduce, for sizes that do not divide evenly."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cocosync.testing.launch import RankPool


def _reduce(sizes: list[int]) -> float:
    import cocosync  # noqa: F401  (registers the cocosync backend)
    from cocosync.shadowsync.sync.base import HierarchicalGroup

    rank = dist.get_rank()
    intra = inter = None
    for node in range(2):  # 2 nodes x 2 trainers, every rank creates every group in the same order
        g = dist.new_group([2 * node, 2 * node + 1], backend="cocosync")
        intra = g if rank // 2 == node else intra
    for i in range(2):
        g = dist.new_group([i, 2 + i])
        inter = g if rank % 2 == i else inter
    group, worst = HierarchicalGroup(intra, inter, 4), 0.0
    for n in sizes:
        buf = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        want = buf.clone()
        dist.all_reduce(want)
        group.all_reduce(buf)
        worst = max(worst, (buf - want).abs().max().item())
    return worst


def test_hierarchical_all_reduce_equals_a_plain_one():
    with RankPool(4, nnodes=2, timeout=120) as pool:
        assert max(pool.run(_reduce, [1, 7, 4096, 27602])) < 1e-5
