"""The native (C++) all_reduce loops, one-shot and three-phase, against the Python path, their reference: the same
bits for fp32, bf16 and fp16 sums and means at sizes 1 to 50k, in place and into out=, on 2 and 3 ranks, with and
without streaming stores (the three-phase loop's large-vector form, forced at every size); a rank on
the native path and a rank on the Python path interoperate in the same call; mismatched calls raise the Python
path's errors. It must build wherever a compiler and ninja exist (CI included)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist

from cocosync.runtime.comm import native
from cocosync.runtime.comm.collectives import ShmCommunicator

SIZES = (1, 7, 1000, 4096, 50_000)


def test_it_builds_where_a_compiler_and_ninja_exist():
    if not (shutil.which("c++") or shutil.which("g++")) or not shutil.which("ninja"):
        pytest.skip("no C++ compiler or ninja: the Python path runs")
    assert native.one_shot() is not None


class _Counting:
    """The native module, counting the calls that reached its loop."""

    def __init__(self, module):
        self.module, self.calls = module, 0

    def OneShot(self, *a):  # noqa: N802 - stands for the module's class
        inner, outer = self.module.OneShot(*a), self

        class Counted:
            def run(self, *b):
                outer.calls += 1
                return inner.run(*b)

            def finish(self, *b):
                return inner.finish(*b)

            def three_phase(self, phase, *b):
                outer.calls += phase == 0
                return inner.three_phase(phase, *b)
        return Counted()


def _compare(mixed: bool, three_phase: bool = False, stream: bool = False) -> dict:
    r = dist.get_rank()
    one_shot = 0 if three_phase else None  # 0: every size in three phases (reduce-scatter, all-gather)
    fast = ShmCommunicator(timeout=60, native=not mixed or r == 0, one_shot_bytes=one_shot)  # mixed: rank 0 only
    ref = ShmCommunicator(timeout=60, native=False, one_shot_bytes=one_shot)
    if fast._native is not None:
        fast._native = _Counting(fast._native)
    if stream:  # streaming stores at every size: unaligned heads and tails, ranges of odd length
        fast.stream_ws_bytes = fast.stream_result_bytes = 0
    bad = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for op in ("sum", "mean"):
            for n in SIZES:
                g = torch.Generator().manual_seed(n * 7 + r)
                x = torch.randn(n, generator=g).to(dtype)
                a, b = x.clone(), x.clone()
                fast.all_reduce(a, op)
                ref.all_reduce(b, op)
                out = torch.full_like(x, float("nan"))
                fast.all_reduce(x, op, out=out)
                if not (torch.equal(a, b) and torch.equal(out, b)):
                    bad.append(f"{dtype} {op} n={n}")
    return {"bad": bad, "native_calls": fast._native.calls if fast._native is not None else 0}


@pytest.mark.parametrize("P, three_phase, stream", [(2, False, False), (3, False, False), (2, True, False),
                                                     (3, True, False), (2, True, True), (3, True, True)])
def test_native_all_reduce_equals_the_python_path_bit_for_bit(rank_pool, P, three_phase, stream):
    if native.one_shot() is None:
        pytest.skip("the native path did not build here")
    got = rank_pool(P).run(_compare, False, three_phase, stream)
    assert all(g["bad"] == [] for g in got), got
    calls = 3 * 2 * len(SIZES) * 2
    assert all(g["native_calls"] >= calls - 2 * 2 for g in got), got  # all but the first call per workspace


@pytest.mark.parametrize("three_phase", [False, True])
def test_a_native_and_a_python_rank_share_a_call(rank_pool, three_phase):
    if native.one_shot() is None:
        pytest.skip("the native path did not build here")
    got = rank_pool(2).run(_compare, True, three_phase)
    assert got[0]["bad"] == got[1]["bad"] == [] and got[0]["native_calls"] > 0 and got[1]["native_calls"] == 0


def _mismatch() -> str:
    comm = ShmCommunicator(timeout=20, native=True)
    r = dist.get_rank()
    comm.all_reduce(torch.ones(8))  # the workspaces exist: the next calls go native
    comm.all_reduce(torch.ones(8))
    try:
        comm.all_reduce(torch.ones(10 + r))
    except ValueError as e:
        return str(e)
    return "no error"


def test_mismatched_calls_raise_the_python_paths_error(rank_pool):
    if native.one_shot() is None:
        pytest.skip("the native path did not build here")
    got = rank_pool(2).run(_mismatch)
    assert all("number of elements differs across ranks" in g for g in got), got


def _arena_and_plain() -> list[bool]:
    """Rank 0 reduces an arena tensor (its peers read it in place), the others plain ones (native loop): the
    native rank sees the arena peer after the header exchange and finishes the call as the Python path does."""
    r, W = dist.get_rank(), dist.get_world_size()
    comm = ShmCommunicator(timeout=30, native=True, one_shot_bytes=0)  # three phases at every size
    ok = []
    for n in (8, 5000, 100_000):
        for _ in range(3):  # the first calls grow the workspaces (Python path); later ones go native on plain ranks
            x = torch.arange(n, dtype=torch.float32) * (r + 1)
            a = comm.arena.empty(n)  # collective: every rank allocates, rank 0 alone uses it
            t = a if r == 0 else x.clone()
            t.copy_(x)
            comm.all_reduce(t)
            ok.append(torch.equal(t, torch.arange(n, dtype=torch.float32) * sum(range(1, W + 1))))
    return ok


@pytest.mark.parametrize("P", [2, 3])
def test_a_native_rank_finishes_a_call_with_an_arena_peer_in_python(rank_pool, P):
    if native.one_shot() is None:
        pytest.skip("the native path did not build here")
    got = rank_pool(P).run(_arena_and_plain)
    assert all(all(g) for g in got), got


def _gather_and_scatter_streamed() -> list[str]:
    """all_gather and reduce_scatter with streaming stores at every size (native copies) against the plain copies."""
    r, W = dist.get_rank(), dist.get_world_size()
    fast = ShmCommunicator(timeout=60, native=True)
    fast.stream_ws_bytes = fast.stream_result_bytes = fast.stream_gather_bytes = 0
    ref = ShmCommunicator(timeout=60, native=False)
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 7, 1000, 50_001):
            x = torch.randn(n * W, generator=torch.Generator().manual_seed(n + r)).to(dtype)
            if not torch.equal(fast.all_gather(x[:n]), ref.all_gather(x[:n])):
                bad.append(f"all_gather {dtype} n={n}")
            if not torch.equal(fast.reduce_scatter(x), ref.reduce_scatter(x)):
                bad.append(f"reduce_scatter {dtype} n={n}")
    return bad


@pytest.mark.parametrize("P", [2, 3])
def test_streamed_copies_of_all_gather_and_reduce_scatter_equal_plain_ones(rank_pool, P):
    if native.one_shot() is None:
        pytest.skip("the native path did not build here")
    assert rank_pool(P).run(_gather_and_scatter_streamed) == [[]] * P
