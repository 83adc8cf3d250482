"""The arena refuses a segment that /dev/shm cannot hold (every local rank at once, with the sizes), and a segment
name left by a job killed while creating it is swept by the next arena."""

from __future__ import annotations

import os
import time

import torch

from cocosync.runtime.comm import shm
from cocosync.runtime.comm.shm import SHM_PREFIX, ArenaFull, shm_space, sweep_stale_segments


def _too_big() -> tuple[str, str, float]:
    arena = shm.Arena(timeout=60)
    free, total = shm_space()
    t0 = time.monotonic()
    try:
        arena.empty(total // 4 + 1, torch.float32)  # more bytes than the whole /dev/shm
    except ArenaFull as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "", "", time.monotonic() - t0


def test_a_segment_larger_than_dev_shm_is_refused_on_every_rank_at_once(rank_pool):
    for kind, msg, seconds in rank_pool(2).run(_too_big):
        assert kind == "ArenaFull" and "does not fit in /dev/shm" in msg and "free of" in msg, msg
        assert seconds < 5, seconds


def test_stale_segment_names_are_swept_and_fresh_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))  # not the real /dev/shm: other tests watch it
    stale, fresh = f"{tmp_path}/{SHM_PREFIX}test-stale-ctl", f"{tmp_path}/{SHM_PREFIX}test-fresh-ctl"
    try:
        for path in (stale, fresh):
            with open(path, "wb") as f:
                f.write(b"x")
        old = time.time() - 2 * shm.STALE_SECONDS
        os.utime(stale, (old, old))
        removed = sweep_stale_segments()
        assert os.path.basename(stale) in removed and not os.path.exists(stale)
        assert os.path.exists(fresh)
    finally:
        for path in (stale, fresh):
            if os.path.exists(path):
                os.unlink(path)
