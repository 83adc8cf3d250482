"""Shared-memory collectives against a plain torch reference, on 2 and 4 ranks and on 2 nodes x 2 local ranks.

Every case of one layout runs in a single pool call (spawning ranks costs seconds); a rank returns the list of
cases that disagreed with the reference, so a failure names them all.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from cocosync.runtime.comm.collectives import ShmCommunicator
from cocosync.runtime.comm.shm import CollectiveTimeout, leftover_segments

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPS = ("sum", "mean", "max", "min")
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
       torch.float16: dict(rtol=1e-3, atol=1e-3)}


def _inputs(W: int, shape, dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(W)]


def _ref(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    f = torch.stack([x.float() for x in xs])
    out = {"sum": f.sum(0), "mean": f.mean(0), "max": f.amax(0), "min": f.amin(0)}[op]
    return out.to(xs[0].dtype)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a.float(), b.float(), **TOL[a.dtype])


def _all_cases() -> list[str]:
    """Run every collective x dtype x op x size (plain and arena tensors); return the failing cases."""
    comm = ShmCommunicator(timeout=60)
    # the same arena, all_reduce always in three phases (the default runs small vectors one-shot)
    phased = ShmCommunicator(timeout=60, one_shot_bytes=0, arena=comm.arena)
    r, W = dist.get_rank(), dist.get_world_size()
    bad: list[str] = []
    seed = 0
    for dt in DTYPES:
        for shape in ((1,), (13,), (4, 250), (W * 20_000 + 3,)):  # the last spans several chunks, uneven split
            for op in OPS:
                seed += 1
                xs = _inputs(W, shape, dt, seed)
                for c, how in ((comm, "one-shot" if comm.nnodes == 1 else "phased"), (phased, "phased")):
                    t = xs[r].clone()
                    if c.all_reduce(t, op) is not t or not _close(t, _ref(xs, op)):
                        bad.append(f"all_reduce {how} {dt} {shape} {op}")
                    out = torch.full_like(t, float("nan"))
                    if c.all_reduce(xs[r], op, out=out) is not out or not _close(out, _ref(xs, op)):
                        bad.append(f"all_reduce out= {how} {dt} {shape} {op}")
                    if len(shape) == 2:  # a non-contiguous out
                        out = torch.empty(shape[::-1], dtype=dt).t()
                        if not _close(c.all_reduce(xs[r], op, out=out), _ref(xs, op)):
                            bad.append(f"all_reduce non-contiguous out= {how} {dt} {shape} {op}")
                if not torch.equal(xs[r], _inputs(W, shape, dt, seed)[r]):
                    bad.append(f"all_reduce out= modified its input {dt} {shape} {op}")
            # reduce_scatter / reduce / all_gather / broadcast (first dim divisible by W)
            rows = (shape[0] // W + 1) * W
            seed += 1
            xs = _inputs(W, (rows, 3), dt, seed)
            for op in OPS:
                got = comm.reduce_scatter(xs[r], op)
                if not _close(got, _ref(xs, op).chunk(W)[r]):
                    bad.append(f"reduce_scatter {dt} {rows} {op}")
                for root in {0, W - 1}:
                    t = xs[r].clone()
                    comm.reduce(t, op, root=root)
                    want = _ref(xs, op) if r == root else xs[r]
                    if not _close(t, want):
                        bad.append(f"reduce {dt} {rows} {op} root={root}")
            got = comm.all_gather(xs[r])
            if not torch.equal(got, torch.cat(xs)):
                bad.append(f"all_gather {dt} {rows}")
            for root in range(W):
                t = xs[r].clone()
                comm.broadcast(t, root=root)
                if not torch.equal(t, xs[root]):
                    bad.append(f"broadcast {dt} {rows} root={root}")
    # zero-copy: tensors that live in the arena, alone and mixed with plain tensors on other ranks
    for dt in DTYPES:
        n = W * 30_001
        xs = _inputs(W, (n,), dt, 1000)
        a = comm.arena.empty((n,), dt)
        for c, how in ((comm, "one-shot"), (phased, "phased")):
            a.copy_(xs[r])
            c.all_reduce(a)
            if not _close(a, _ref(xs, "sum")):
                bad.append(f"arena all_reduce {how} {dt}")
            a.copy_(xs[r])
            mixed = a if r % 2 == 0 else xs[r].clone()
            c.all_reduce(mixed, "max")
            if not _close(mixed, _ref(xs, "max")):
                bad.append(f"mixed arena/plain all_reduce {how} {dt}")
            a.copy_(xs[r])
            out = torch.empty_like(a)
            c.all_reduce(a, out=out)
            if not (_close(out, _ref(xs, "sum")) and torch.equal(a, xs[r])):
                bad.append(f"arena all_reduce out= {how} {dt}")
        a.copy_(xs[r])
        if not _close(comm.reduce_scatter(a), _ref(xs, "sum").chunk(W)[r]):
            bad.append(f"arena reduce_scatter {dt}")
        sl = comm.arena.empty((7,), dt)
        sl.fill_(r)
        if not torch.equal(comm.all_gather(sl), torch.arange(W).repeat_interleave(7).to(dt)):
            bad.append(f"arena all_gather {dt}")
        a.copy_(xs[r])
        comm.broadcast(a, root=W - 1)
        if not torch.equal(a, xs[W - 1]):
            bad.append(f"arena broadcast {dt}")
    # the three-phase all_reduce in many small chunks, uneven slices (the pipelined variant it replaced is gone)
    chunked = ShmCommunicator(timeout=60, chunk_bytes=4096, one_shot_bytes=0, arena=comm.arena)
    for dt in DTYPES:
        for op in OPS:
            xs = _inputs(W, (W * 5000 + 1,), dt, 2000)
            t = xs[r].clone()
            chunked.all_reduce(t, op)
            if not _close(t, _ref(xs, op)):
                bad.append(f"chunked three-phase all_reduce {dt} {op}")
    # non-contiguous input, results bitwise identical on every rank
    x = _inputs(W, (64, 30), torch.float32, 7)
    for c, how in ((comm, "one-shot"), (phased, "phased")):
        t = x[r].clone().t()
        c.all_reduce(t)
        if not _close(t, _ref([y.t() for y in x], "sum")):
            bad.append(f"non-contiguous all_reduce {how}")
        gathered = [torch.empty_like(t) for _ in range(W)]
        dist.all_gather(gathered, t.contiguous())
        if not all(torch.equal(g, gathered[0]) for g in gathered):
            bad.append(f"ranks disagree bitwise {how}")
    return bad


@pytest.mark.parametrize("world,nnodes", [(2, 1), (4, 1), (4, 2), (2, 2)], ids=["P2", "P4", "2x2", "1x2"])
def test_collectives_match_reference(rank_pool, world, nnodes):
    results = rank_pool(world, nnodes=nnodes).run(_all_cases, timeout=240)
    assert results == [[]] * world, results
    assert leftover_segments() == []


def _bad_inputs() -> dict[str, str]:
    comm = ShmCommunicator(timeout=30)
    r = dist.get_rank()
    msgs = {}
    for key, fn in {
        "size": lambda: comm.all_reduce(torch.ones(10 + r)),
        "dtype_mismatch": lambda: comm.all_reduce(torch.ones(4, dtype=torch.float32 if r == 0 else torch.float16)),
        "unsupported": lambda: comm.all_reduce(torch.ones(4, dtype=torch.int64)),
        "divisible": lambda: comm.reduce_scatter(torch.ones(3)),
        "op": lambda: comm.all_reduce(torch.ones(4), op="prod"),
        "root": lambda: comm.broadcast(torch.ones(4), root=5),
        "gather_size": lambda: comm.all_gather(torch.ones(2 + r)),
        "out_shape": lambda: comm.all_reduce(torch.ones(4), out=torch.empty(2, 2)),
        "one_shot": lambda: ShmCommunicator(arena=comm.arena, one_shot_bytes=r).all_reduce(torch.ones(4)),
        "one_shot_value": lambda: ShmCommunicator(arena=comm.arena, one_shot_bytes=-1),
    }.items():
        try:
            fn()
            msgs[key] = "no error"
        except (ValueError, TypeError, RuntimeError) as e:
            msgs[key] = f"{type(e).__name__}: {e}"
    t = torch.ones(8)
    comm.all_reduce(t)  # still usable after the errors
    msgs["after"] = str(t[0].item())
    return msgs


def test_bad_inputs_name_the_problem(rank_pool):
    out = rank_pool(2).run(_bad_inputs, timeout=120)
    for m in out:
        assert "number of elements differs" in m["size"] and "rank 0: 10" in m["size"] and "rank 1: 11" in m["size"]
        assert "dtype differs" in m["dtype_mismatch"] and "torch.float16" in m["dtype_mismatch"]
        assert "unsupported dtype torch.int64" in m["unsupported"] and "torch.bfloat16" in m["unsupported"]
        assert "not divisible by the world size 2" in m["divisible"]
        assert "unsupported op 'prod'" in m["op"]
        assert "root=5" in m["root"]
        assert "number of elements differs" in m["gather_size"]
        assert "out has shape (2, 2)" in m["out_shape"] and "expected (4,)" in m["out_shape"]
        assert "one_shot_bytes differ" in m["one_shot"] and "rank 1: 262144/1" in m["one_shot"]
        assert "one_shot_bytes=-1 must be >= 0" in m["one_shot_value"]
        assert m["after"] == "2.0"


def _left_across_nodes() -> dict:
    """Rank 0 waits in an all-reduce's cross-node stage for rank 1 (on the other node), which comes 2 s late; rank 0
    leaves its collectives 0.3 s in (from another thread, as a trainer does once a loss is recorded)."""
    comm = ShmCommunicator(timeout=60)
    t = torch.ones(8)
    if dist.get_rank() == 1:
        time.sleep(2.0)
        comm.all_reduce(t)  # (matches rank 0's abandoned collective, which gloo then completes: the pool goes on)
        return {"sum": float(t[0])}
    threading.Timer(0.3, comm.flags.leave, args=("a peer was lost",)).start()
    t0 = time.monotonic()
    try:
        comm.all_reduce(t)
        return {"error": None, "seconds": time.monotonic() - t0}
    except CollectiveTimeout as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    finally:
        time.sleep(2.5)  # (rank 1's late all-reduce completes before the pool's next call)


def test_a_collective_across_nodes_ends_once_its_rank_left_its_collectives(rank_pool):
    """A rank whose peer on another node left the collective for new groups would wait in gloo until the group's
    timeout; once it leaves its own collectives (`leave_collectives`), the wait ends at once."""
    mine, late = rank_pool(2, nnodes=2).run(_left_across_nodes, timeout=60)
    assert mine["error"] is not None and "was given up: this rank left its collectives (a peer was lost)" in \
        mine["error"], mine
    assert 0.3 <= mine["seconds"] < 1.9, mine  # (rank 1 comes at 2 s)
    assert late == {"sum": 2.0}
