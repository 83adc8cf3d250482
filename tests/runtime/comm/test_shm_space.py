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


_ADAM = """
import torch, torch.distributed as dist
from cocosync.optim import DistributedAdam
dist.init_process_group("gloo")
opt = DistributedAdam(torch.nn.Linear(2560, 2560).parameters())  # segments that fit one by one, not together
for p in opt.param_groups[0]["params"]:
    p.grad = torch.ones_like(p)
opt.step()
dist.destroy_process_group()
"""


def test_segments_that_fit_alone_but_not_together_are_refused_not_a_sigbus(tmp_path):
    """2 ranks, DistributedAdam over 6.5M parameters in a private 64 MiB /dev/shm (a mount namespace): each segment
    fit the free space when checked alone, and the job died of SIGBUS on first touch; the pages are reserved at
    creation now, so the segment that does not fit is refused with the sizes."""
    import subprocess
    import sys

    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        import pytest

        pytest.skip("unshare -m is not permitted here (needs root): no private /dev/shm to fill")
    script = tmp_path / "adam.py"
    script.write_text(_ADAM)
    port = 20000 + os.getpid() % 20000
    run = (f"mount -t tmpfs -o size=64m tmpfs /dev/shm && {sys.executable} -m torch.distributed.run "
           f"--nproc-per-node 2 --master-addr 127.0.0.1 --master-port {port} {script}")
    res = subprocess.run(["unshare", "-m", "sh", "-c", run], capture_output=True, text=True, timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "SIGBUS" not in out, out[-3000:]
    assert "ArenaFull" in out and "does not fit in /dev/shm" in out and "free of 64.0 MiB" in out, out[-3000:]
