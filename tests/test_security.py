"""Nothing runs code, nothing listens beyond loopback: a crafted checkpoint is refused without running its payload;
every socket a run listens on is on 127.0.0.1 (RankPool for tests, benchmarks and the demo; the ShadowSync
launcher's rendezvous store)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from cocosync.runtime.comm.store import LoopbackStore
from cocosync.testing import RankPool
from cocosync.testing.sockets import listening_sockets, process_tree


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _crafted(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "checkpoint.pt"
    torch.save({"config": {}, "dense": {}, "embeddings": {}, "positions": torch.zeros(1), "x": _Payload(str(marker))},
               path)
    return path, marker


@pytest.mark.parametrize("args", [["eval"], ["train", "--no-progress", "--resume"]])
def test_a_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path, args):
    path, marker = _crafted(tmp_path)
    res = subprocess.run([sys.executable, "-m", "cocosync.cli", *args, str(path)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert res.returncode != 0
    assert "refused to load" in res.stderr and str(path) in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert not marker.exists(), "the checkpoint's payload ran"


def test_a_real_checkpoint_still_loads(tmp_path):
    from cocosync.shadowsync.checkpoint import CheckpointError, read_checkpoint

    good = tmp_path / "good.pt"
    torch.save({"config": {"a": 1}, "dense": {"w": torch.ones(2)}, "embeddings": {}, "positions": torch.zeros(2)}, good)
    assert read_checkpoint(good)["config"] == {"a": 1}
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        read_checkpoint(tmp_path / "empty.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a torch checkpoint or corrupt"):
        read_checkpoint(tmp_path / "junk.pt")
    torch.save({"dense": {}}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a cocosync checkpoint"):
        read_checkpoint(tmp_path / "other.pt")


def _non_loopback(found):
    return [f for f in found if f[1] not in ("127.0.0.1", "::1")]


def test_loopback_store_listens_on_loopback_only():
    with LoopbackStore(timeout=30) as s:
        found = listening_sockets([os.getpid()])
        assert any(port == s.port for _, _, port in found), found
        assert not _non_loopback(found), found


def test_rank_pool_listens_on_loopback_only():
    with RankPool(2, timeout=60) as pool:
        found = listening_sockets([os.getpid(), *pool.pids])
        assert found, "expected the rendezvous store and gloo's sockets"
        assert not _non_loopback(found), found


def test_a_training_run_listens_on_loopback_only(tmp_path):
    """shadow-ma with 2 trainers: the launcher's rendezvous store and the trainers' gloo group, sampled while the
    run is alive."""
    cmd = [sys.executable, "-m", "cocosync.cli", "train", "--sync", "shadow-ma", "--examples", "60000",
           "--eval-examples", "2000", "--no-progress", "--out", str(tmp_path / "run"), "--timeout", "120"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: set = set()
    deadline = time.monotonic() + 150
    while proc.poll() is None and time.monotonic() < deadline:
        seen.update(listening_sockets(process_tree(proc.pid)))
        time.sleep(0.05)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert seen, "expected the rendezvous store to be seen listening"
    assert not _non_loopback(seen), seen
