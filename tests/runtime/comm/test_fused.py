"""Fused reduce-scatter -> fn -> all-gather (Adam against torch.optim.Adam) and chunked overlap."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cocosync.bench.adam_slice import AdamSlice
from cocosync.runtime.comm.collectives import ShmCommunicator
from cocosync.runtime.comm.fused import fused_all_reduce, slice_bounds
from cocosync.runtime.comm.shm import leftover_segments
from cocosync.runtime.steps.overlap import CommThread, overlap_chunks

N = 50_003  # uneven split, several chunks


def _grads(step: int, W: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(N, generator=g) for _ in range(W)]


def _reference_adam(steps: int, W: int, **hp) -> torch.Tensor:
    p = torch.nn.Parameter(torch.linspace(-1, 1, N))
    opt = torch.optim.Adam([p], foreach=False, **hp)
    for s in range(steps):
        p.grad = torch.stack(_grads(s, W)).mean(0)
        opt.step()
    return p.detach()


def _fused_adam_cases(steps: int) -> dict[str, float]:
    comm = ShmCommunicator(timeout=60, chunk_bytes=64 << 10)
    r, W = dist.get_rank(), dist.get_world_size()
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    ref = _reference_adam(steps, W, **hp)
    errs = {}
    # out placements: plain per-rank params, per-rank arena params (zero-copy), node-shared params (no all-gather)
    for kind in ("plain", "arena", "shared"):
        init = torch.linspace(-1, 1, N)
        if kind == "plain":
            params = init.clone()
        elif kind == "arena":
            params = comm.arena.empty(N)
        else:
            params = comm.arena.shared_empty(N)
        if kind != "shared" or comm.local_rank == 0:
            params.copy_(init)
        comm.barrier()
        opt = AdamSlice(comm, N, **hp)
        grads = comm.arena.empty(N) if kind == "arena" else torch.empty(N)
        for s in range(steps):
            grads.copy_(_grads(s, W)[r])
            opt.step(grads, params)
        errs[kind] = (params - ref).abs().max().item()
    # sliced use: only this rank's slice of out is updated; the reduced gradients are in t's slice
    xs = _grads(99, W)
    t = xs[r].clone()
    out = torch.zeros(N)
    s, e = slice_bounds(comm, N)
    fused_all_reduce(comm, t, lambda off, g, o: o.copy_(g * 2), out=out, gather=False)
    want = torch.stack(xs).sum(0) * 2
    errs["sliced"] = (out[s:e] - want[s:e]).abs().max().item()
    errs["sliced_rest_untouched"] = float(out[:s].abs().sum() + out[e:].abs().sum())
    # default out = t, op=max
    t = xs[r].clone()
    fused_all_reduce(comm, t, lambda off, g, o: o.copy_(g + off), op="max")
    errs["inplace"] = (t - (torch.stack(xs).amax(0) + _offsets(comm, N))).abs().max().item()
    # fn_bytes: fn gets several reduced chunks at once; plain out (published per group) and arena out
    for kind in ("plain", "arena"):
        t = comm.arena.empty(N)
        t.copy_(xs[r])
        out = torch.zeros(N) if kind == "plain" else comm.arena.empty(N)
        calls: list[tuple[int, int]] = []

        def fn(off, g, o):
            calls.append((off, g.numel()))
            o.copy_(g * 3)
        fused_all_reduce(comm, t, fn, out=out, fn_bytes=3 * comm.chunk_bytes)
        errs[f"grouped_{kind}"] = (out - torch.stack(xs).sum(0) * 3).abs().max().item()
        errs[f"grouped_{kind}_calls"] = calls
    errs["slice"] = (s, e)
    return errs


def _offsets(comm: ShmCommunicator, n: int) -> torch.Tensor:
    """The offset each element's chunk was given (reconstructs what fn added above)."""
    from cocosync.runtime.comm.collectives import split_bounds
    out = torch.empty(n)
    step = comm.chunk_bytes // 4
    for s, e in split_bounds(n, comm.local_size):
        for a in range(s, e, step):
            out[a:min(a + step, e)] = a
    return out


@pytest.mark.parametrize("world,nnodes", [(2, 1), (4, 2)], ids=["P2", "2x2"])
def test_fused_adam_matches_torch_optim(rank_pool, world, nnodes):
    results = rank_pool(world, nnodes=nnodes).run(_fused_adam_cases, 3, timeout=180)
    for res in results:
        for key in ("plain", "arena", "shared"):
            assert res[key] < 1e-5, (key, res)
        assert res["sliced"] < 1e-5 and res["sliced_rest_untouched"] == 0.0, res
        assert res["inplace"] < 1e-4, res
        s, e = res["slice"]
        for kind in ("plain", "arena"):
            assert res[f"grouped_{kind}"] < 1e-4, res
            calls = res[f"grouped_{kind}_calls"]  # consecutive groups of 3 chunks covering the slice once
            assert [c[0] for c in calls] == list(range(s, e, 3 * 64 << 10 >> 2)), calls
            assert sum(c[1] for c in calls) == e - s and len(calls) < -(-(e - s) // (64 << 10 >> 2)), calls
    assert leftover_segments() == []


def _overlap_case() -> float:
    comm = ShmCommunicator(timeout=60)
    r = dist.get_rank()
    chunks = [torch.arange(1000, dtype=torch.float32) * (i + 1) for i in range(6)]

    def produce(i):
        return chunks[i] * (r + 1) + 1.0

    def communicate(i, c):
        dist.all_reduce(c)  # gloo on the comm thread
        return comm.all_reduce(c.clone(), "max")  # and shared memory

    with CommThread() as th:
        overlapped = overlap_chunks(produce, communicate, len(chunks), thread=th)
    plain = [communicate(i, produce(i)) for i in range(len(chunks))]
    return max((a - b).abs().max().item() for a, b in zip(overlapped, plain))


def test_overlap_chunks_equals_sequential(rank_pool):
    assert rank_pool(2).run(_overlap_case, timeout=60) == [0.0, 0.0]


def test_overlap_chunks_propagates_errors():
    def produce(i):
        if i == 2:
            raise KeyError("produce failed")
        return i

    with pytest.raises(KeyError, match="produce failed"):
        overlap_chunks(produce, lambda i, c: c, 4)
    assert overlap_chunks(lambda i: i, lambda i, c: c * 10, 3) == [0, 10, 20]


def test_adam_chunk_update_fused_kernel_and_fallback_agree(monkeypatch):
    from cocosync.bench import adam_slice as fused

    g = torch.Generator().manual_seed(0)
    p, grad, m, v = (torch.randn(777, generator=g) for _ in range(4))
    v.abs_()
    outs = []
    for kernel in (fused._FUSED_ADAM, None):
        monkeypatch.setattr(fused, "_FUSED_ADAM", kernel)
        state = [p.clone(), m.clone(), v.clone()]
        fused.adam_chunk_update(state[0], grad, state[1], state[2], step=4, lr=1e-2, weight_decay=0.1)
        outs.append(state)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _fn_sources_case() -> dict[str, tuple[list[int], float, bool]]:
    """reduce_and_apply with fn_sources: how many parts fn gets, whether fn's own reduction of them (sum in rank
    order, then 1/world for a mean) gives the mean of every rank's vector, and whether t was left as it was."""
    from cocosync.runtime.comm.fused import reduce_and_apply

    comm = ShmCommunicator(timeout=60, chunk_bytes=64 << 10)
    r, W = dist.get_rank(), dist.get_world_size()
    n = N - N % W  # across nodes each rank owns exactly 1/W
    xs = [x[:n] for x in _grads(7, W)]
    want = torch.stack(xs).mean(0)
    res = {}
    # a node-shared out is one copy per node: only within a node (across nodes every local rank would write it)
    for kind in ("arena", "plain") + (("shared",) if comm.nnodes == 1 else ()):
        t = comm.arena.empty(n)
        t.copy_(xs[r])
        out = {"arena": comm.arena.empty, "shared": comm.arena.shared_empty, "plain": torch.zeros}[kind](n)
        counts: list[int] = []

        def fn(off, parts, o):
            counts.append(len(parts))
            acc = parts[0].clone()
            for p in parts[1:]:
                acc += p
            o.copy_(acc / W if len(parts) > 1 else acc)
        reduce_and_apply(comm, t, fn, out=out, op="mean", fn_bytes=2 * comm.chunk_bytes, fn_sources=True)
        res[kind] = (sorted(set(counts)), (out - want).abs().max().item(), bool(torch.equal(t, xs[r])))
    return res


@pytest.mark.parametrize("world,nnodes", [(3, 1), (4, 2)], ids=["P3", "2x2"])
def test_fn_sources_hands_fn_every_ranks_chunk_within_a_node(rank_pool, world, nnodes):
    """Within a node fn gets all L chunks for an arena or node-shared out (and t is left as it was); for a plain
    out, or across nodes, the reduced chunk alone. Either way the result is the mean."""
    for res in rank_pool(world, nnodes=nnodes).run(_fn_sources_case, timeout=120):
        for kind, (counts, err, untouched) in res.items():
            assert err < 1e-6, (kind, res)
            one_pass = nnodes == 1 and kind != "plain"
            assert counts == ([world] if one_pass else [1]), (kind, res)
            assert untouched == one_pass, (kind, res)
