"""Shared fixtures. Multi-rank tests run real processes on gloo at 127.0.0.1 through a RankPool that is
started once per world size per session (spawning ranks costs seconds; the pool is rebuilt after a failure)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Fused kernels run eagerly in tests (same code, no Inductor compile per rank); test_kernels covers Inductor.
os.environ.setdefault("COCOSYNC_KERNELS", "eager")
# Choices and constants measured by tests go to a scratch cache: tests never read the user's tuned constants nor
# leave choices in ~/.cache/cocosync (ranks inherit it: the pools start after this line)
_CACHE = tempfile.mkdtemp(prefix="cocosync-test-cache-")
os.environ["COCOSYNC_CACHE_DIR"] = _CACHE
# two simulated machines for the multi-node tests: the team's tool beside the checkout (tests skip where it fails)
_TWOHOSTS = Path(__file__).resolve().parents[2] / "shared" / "tools" / "twohosts.sh"
os.environ.setdefault("COCOSYNC_TWOHOSTS", str(_TWOHOSTS))

from cocosync.testing.launch import RankPool  # noqa: E402 - after the environment it reads

_pools: dict[tuple[int, int], RankPool] = {}


def pytest_sessionstart(session) -> None:
    """Build (or load) the native one-shot all_reduce once, here, so no rank of a timed test waits for a compile."""
    from cocosync.runtime.comm import native

    native.one_shot()


def pytest_sessionfinish(session, exitstatus) -> None:
    shutil.rmtree(_CACHE, ignore_errors=True)


def get_pool(world_size: int, nnodes: int = 1) -> RankPool:
    key = (world_size, nnodes)
    pool = _pools.get(key)
    if pool is None or pool.closed:
        pool = _pools[key] = RankPool(world_size, nnodes=nnodes, timeout=120)
    return pool


@pytest.fixture(scope="session")
def rank_pool():
    """rank_pool(P, nnodes=1) -> a live RankPool of P ranks (shared across the test session)."""
    yield get_pool
    for pool in _pools.values():
        pool.close()
    _pools.clear()
