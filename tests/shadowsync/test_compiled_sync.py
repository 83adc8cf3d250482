"""MA and BMUF as compiled DSL programs on shared memory (sync/compiled.py): each schedule (replicated for small
vectors, sliced state for large) equals the hand-written classes round by round, on 2 and 3 real ranks with sizes
that do not divide; the program equals the reference interpreter; the state a checkpoint holds round-trips."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cocosync.interp import interpret
from cocosync.programs.sync import bmuf_program
from cocosync.shadowsync.config import SyncConfig
from cocosync.shadowsync.sync import BMUF, ModelAveraging
from cocosync.shadowsync.sync.compiled import CompiledSync

N = 11  # not a multiple of 2 or 3: padding


def _start() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, N)  # every trainer starts from the same point


def _move(r: int, k: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(100 * k + r))


def _rounds(algorithm: str, sliced: bool, nesterov: bool, rounds: int = 4, kernels: str = "eager"):
    import os

    before = os.environ.get("COCOSYNC_KERNELS")
    os.environ["COCOSYNC_KERNELS"] = kernels  # read when the plan and the copies compile; the pool's ranks live on
    try:
        return _rounds_with(algorithm, sliced, nesterov, rounds, kernels)
    finally:
        if before is None:
            os.environ.pop("COCOSYNC_KERNELS", None)
        else:
            os.environ["COCOSYNC_KERNELS"] = before


def _rounds_with(algorithm: str, sliced: bool, nesterov: bool, rounds: int, kernels: str):
    r = dist.get_rank()
    cfg = SyncConfig(algorithm=f"fr-{algorithm}", nesterov=nesterov, block_momentum=0.4, block_lr=0.9)
    ours, ref = _start(), _start()
    # with Inductor kernels, the copies in and out as generated loops too (from 1M elements in a job); the sliced
    # eager runs fork through the native streaming copy (from 2M elements in a job), the replicated ones through torch
    compiled = CompiledSync(ours, cfg, sliced=sliced, fused_copies_from=1 if kernels == "inductor" else 1 << 20,
                            stream_fork_from=1 if kernels == "eager" and sliced else 1 << 62)
    reference = (BMUF if algorithm == "bmuf" else ModelAveraging)(ref, cfg)
    out = []
    for k in range(rounds):
        active = k < rounds - 2 or (k == rounds - 2 and r == 0)  # then only rank 0 trains, then none
        for x in (ours, ref):
            x.add_(_move(r, k))
        n_ours, n_ref = compiled.sync(active), reference.sync(active)
        out.append((ours.clone(), ref.clone(), n_ours, n_ref))
    return out, compiled.sliced, compiled.plan.fast_steps, compiled.state(), reference.state()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("algorithm, nesterov", [("ma", False), ("bmuf", False), ("bmuf", True)])
@pytest.mark.parametrize("sliced", [False, True], ids=["replicated", "sliced"])
def test_compiled_sync_equals_the_hand_written_class(rank_pool, world, algorithm, nesterov, sliced):
    for rounds, was_sliced, fast, state, ref_state in rank_pool(world).run(_rounds, algorithm, sliced, nesterov):
        assert was_sliced == sliced
        if was_sliced:
            assert len(fast) == 1 and fast[0].startswith("fused_collective"), fast  # one fused collective a round
        for ours, ref, n_ours, n_ref in rounds:
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
            assert n_ours == n_ref
        assert state.keys() == ref_state.keys()
        for k in state:  # BMUF's global model and block momentum, gathered from the slices
            torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm, sliced", [("ma", False), ("bmuf", True)])
def test_generated_kernels_and_copies_equal_the_hand_written_class(rank_pool, algorithm, sliced):
    for rounds, *_ in rank_pool(2).run(_rounds, algorithm, sliced, False, 4, "inductor"):
        for ours, ref, n_ours, n_ref in rounds:
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
            assert n_ours == n_ref


def _oracle(sliced: bool):
    r, P = dist.get_rank(), dist.get_world_size()
    n = 12
    x = torch.randn(n, generator=torch.Generator().manual_seed(r))
    s0, g0, d0 = (torch.randn(n, generator=torch.Generator().manual_seed(50 + i)) for i in range(3))
    sync = CompiledSync(torch.zeros(n - 2), SyncConfig(algorithm="fr-bmuf"), sliced=sliced)  # + 2 flag slots
    assert sync.padded == n
    lo, k = sync._lo, sync.glob.numel()
    sync.s.copy_(s0)
    sync.glob.copy_(g0[lo:lo + k])
    sync.delta.copy_(d0[lo:lo + k])
    sync.x.copy_(x)
    sync.plan(x=sync.x, s=sync.s, glob=sync.glob, delta=sync.delta, mom=0.3, blr=0.7, nm=0.3)
    def whole(local: torch.Tensor) -> torch.Tensor:
        return torch.cat([sync._comm.arena.peer_view(local, p) for p in range(P)]) if sliced else local.clone()

    return sync.s.clone(), whole(sync.glob), whole(sync.delta), P


@pytest.mark.parametrize("sliced", [False, True], ids=["replicated", "sliced"])
def test_bmuf_program_equals_the_interpreter(rank_pool, sliced):
    got = rank_pool(2).run(_oracle, sliced)
    xs = [torch.randn(12, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    s0, g0, d0 = (torch.randn(12, generator=torch.Generator().manual_seed(50 + i)) for i in range(3))
    ref = interpret(bmuf_program(12), 2, {"x": xs, "s": s0, "glob": g0, "delta": d0, "mom": 0.3, "blr": 0.7,
                                          "nm": 0.3})
    for (s, glob, delta, _), want in zip(got, ref):
        torch.testing.assert_close(s, want["s"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(glob, want["glob"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(delta, want["delta"], rtol=1e-6, atol=1e-6)


def _round_trip():
    r = dist.get_rank()
    cfg = SyncConfig(algorithm="fr-bmuf")
    a = CompiledSync(_start(), cfg, sliced=True)
    for k in range(2):
        a.flat.add_(_move(r, k))
        a.sync()
    saved = a.state()
    b = CompiledSync(torch.zeros(N), cfg, sliced=True)
    b.load_state(saved)
    dist.barrier()  # state() reads the peers' slices: after every rank has loaded its own
    return saved, b.state()


def test_sliced_bmuf_state_round_trips_through_a_checkpoint(rank_pool):
    for saved, loaded in rank_pool(2).run(_round_trip):
        assert saved.keys() == loaded.keys() == {"bmuf.global", "bmuf.start", "bmuf.delta"}
        for k in saved:
            assert torch.equal(saved[k], loaded[k]), k


@pytest.mark.parametrize("algorithm, nesterov, sliced", [("ma", False, False), ("bmuf", False, True),
                                                         ("bmuf", True, True)])
def test_across_two_nodes_the_compiled_rounds_equal_the_class(rank_pool, algorithm, nesterov, sliced):
    """4 trainers on 2 simulated nodes: the runtime's hierarchical communicator (shared memory within a node, gloo
    between nodes); the sliced state a checkpoint reads is gathered across the nodes."""
    for rounds, was_sliced, fast, state, ref_state in rank_pool(4, nnodes=2).run(_rounds, algorithm, sliced,
                                                                                  nesterov):
        assert was_sliced == sliced
        for ours, ref, n_ours, n_ref in rounds:
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
            assert n_ours == n_ref
        assert state.keys() == ref_state.keys()
        for k in state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-6)
