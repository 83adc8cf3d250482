"""The shared-memory arena: owner-only segments, shared views, nothing left in /dev/shm, and a dead peer
makes the survivors raise CollectiveTimeout naming the collective and the missing rank."""

from __future__ import annotations

import os
import signal
import stat
import time

import pytest
import torch
import torch.distributed as dist

from cocosync.runtime.comm import shm
from cocosync.runtime.comm.collectives import ShmCommunicator
from cocosync.runtime.comm.shm import Arena, CollectiveTimeout, leftover_segments
from cocosync.testing.launch import RankFailure, RankPool


def _arena_semantics() -> dict:
    r = dist.get_rank()
    seen_modes = []
    orig_map = Arena._map

    def spy(self, path, nbytes, what):  # record the mode of every segment while it still has a name
        buf = orig_map(self, path, nbytes, what)
        seen_modes.append(stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else None)
        return buf

    Arena._map = spy
    try:
        arena = Arena(timeout=30)
        mine = arena.empty((3, 4), torch.float32)
        shared = arena.shared_empty(10, torch.bfloat16)
    finally:
        Arena._map = orig_map
    mine.fill_(r)
    if r == 0:
        shared.copy_(torch.arange(10))
    arena.flags.barrier("test")
    peer = arena.peer_view(mine, 1 - r)
    out = {
        "modes": seen_modes,
        "peer": peer[0, 0].item(),
        "shared": shared.float().tolist(),
        "located": arena.locate(mine[1]) is not None and arena.locate(torch.zeros(3)) is None,
        "left": leftover_segments(),
    }
    arena.flags.barrier("test end")
    return out


def test_arena_segments_owner_only_shared_and_unlinked(rank_pool):
    out = rank_pool(2).run(_arena_semantics, timeout=60)
    for r, o in enumerate(out):
        assert all(m in (0o600, None) for m in o["modes"]) and 0o600 in out[0]["modes"]
        assert o["peer"] == 1 - r
        assert o["shared"] == list(map(float, range(10)))
        assert o["located"]
        assert o["left"] == []  # unlinked as soon as every local rank mapped them
    assert leftover_segments() == []


def _die_mid_collective(victim: int, how: str) -> str:
    comm = ShmCommunicator(timeout=8)
    t = torch.ones(1 << 16)
    comm.all_reduce(t)  # a healthy call first
    if dist.get_rank() == victim:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.all_reduce(t)
    except CollectiveTimeout as e:
        raise CollectiveTimeout(f"{e} [after {time.monotonic() - start:.1f}s]") from None
    return "no error"


def test_killed_rank_makes_survivors_raise():
    pool = RankPool(2, timeout=60)
    try:
        with pytest.raises(RankFailure) as info:
            # the survivor raises within ~0.2 s (dead peer seen); the short deadline only bounds how long the pool
            # waits for the result of the killed rank, which never comes
            pool.run(_die_mid_collective, 1, "sigkill", timeout=10)
    finally:
        pool.close(force=True)
    msg = str(info.value)
    assert "CollectiveTimeout" in msg and "all_reduce (call #" in msg, msg
    assert "global rank 1" in msg, msg
    assert leftover_segments() == []


def _stall(timeout: float) -> str:
    comm = ShmCommunicator(timeout=timeout)
    if dist.get_rank() == 1:
        time.sleep(timeout + 3)  # alive but late
        return "slept"
    try:
        comm.broadcast(torch.ones(4), root=0)
    except CollectiveTimeout as e:
        return str(e)
    return "no error"


def test_stalled_peer_times_out_with_names(rank_pool):
    out = rank_pool(2).run(_stall, 1.5, timeout=60)
    assert "timed out" in out[0] and "broadcast" in out[0] and "global rank 1" in out[0], out[0]


def test_timeout_env(monkeypatch):
    monkeypatch.setenv(shm.TIMEOUT_ENV, "2.5")
    assert shm.default_timeout() == 2.5
    monkeypatch.setenv(shm.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="COCOSYNC_COLLECTIVE_TIMEOUT='soon'"):
        shm.default_timeout()


def test_single_process_arena_and_comm():
    comm = ShmCommunicator()
    t = comm.arena.empty(5)
    t.fill_(2.0)
    assert comm.all_reduce(t).tolist() == [2.0] * 5
    assert comm.all_gather(torch.ones(2)).tolist() == [1.0, 1.0]
    assert leftover_segments() == []
