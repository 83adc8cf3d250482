"""Nothing runs code, nothing listens beyond loopback: a crafted checkpoint is refused without running its payload;
every socket a run listens on is on 127.0.0.1 (RankPool for tests, benchmarks and the demo; the ShadowSync
launcher's rendezvous store, the job's gloo and RPC)."""

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
    """A checkpoint directory whose DCP metadata (a pickle) would run a command when loaded with plain pickle."""
    import json
    import pickle

    marker = tmp_path / "pwned"
    path = tmp_path / "run" / "checkpoints" / "seen-1"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    meta = {"config": {}, "trainers": 1, "workers": 1, "embedding_servers": 1, "sync_servers": 0, "table_rows": [1],
            "dense_params": 1, "examples_seen": 1}
    (path / "meta.json").write_text(json.dumps(meta))
    return path, marker


@pytest.mark.parametrize("args", [["eval"], ["train", "--no-progress", "--resume"]])
def test_a_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path, args):
    path, marker = _crafted(tmp_path)
    res = subprocess.run([sys.executable, "-m", "cocosync_start", *args, str(path)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert res.returncode != 0
    assert "refused to load" in res.stderr and str(path) in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert not marker.exists(), "the checkpoint's payload ran"


def test_a_real_checkpoint_still_loads_and_a_damaged_one_is_named(tmp_path):
    import torch.distributed.checkpoint as dcp

    from cocosync.shadowsync.checkpoint import CheckpointError
    from cocosync.shadowsync.safe_reader import SafeReader

    good = tmp_path / "good"
    dcp.save({"w": torch.ones(2), "i": torch.zeros(3, dtype=torch.int64)}, checkpoint_id=str(good), no_dist=True)
    state = {"w": torch.zeros(2), "i": torch.ones(3, dtype=torch.int64)}
    dcp.load(state, storage_reader=SafeReader(str(good)), no_dist=True)
    assert state["w"].tolist() == [1.0, 1.0] and state["i"].tolist() == [0, 0, 0]
    (good / ".metadata").write_bytes((good / ".metadata").read_bytes()[:40])  # cut short
    with pytest.raises(CheckpointError, match="damaged .metadata"):
        SafeReader(str(good)).read_metadata()


def test_a_checkpoint_missing_or_cut_data_files_is_named_before_it_loads(tmp_path):
    """A checkpoint saved across machines to directories they do not share holds only one machine's data files; a
    copy cut short misses a file's end. Both are named when the metadata is read (a FileNotFoundError, or a read
    past the end, mid-load before)."""
    import torch.distributed.checkpoint as dcp

    from cocosync.shadowsync.checkpoint import CheckpointError
    from cocosync.shadowsync.safe_reader import SafeReader

    path = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(1000), "i": torch.zeros(3, dtype=torch.int64)}, checkpoint_id=str(path), no_dist=True)
    (data,) = path.glob("*.distcp")
    SafeReader(str(path)).read_metadata()  # whole: reads
    whole = data.read_bytes()
    data.write_bytes(whole[:-100])
    with pytest.raises(CheckpointError, match=rf"data file {data.name} is cut short \({len(whole) - 100:,} bytes"):
        SafeReader(str(path)).read_metadata()
    data.unlink()
    with pytest.raises(CheckpointError, match=rf"is incomplete: 1 of its 1 data files are missing \({data.name}\); "
                                              "a job across machines must write to a directory every machine shares"):
        SafeReader(str(path)).read_metadata()


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
    cmd = [sys.executable, "-m", "cocosync_start", "train", "--sync", "shadow-ma", "--examples", "60000",
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


def test_a_checkpoint_whose_metadata_names_a_file_outside_it_is_refused(tmp_path):
    """A crafted .metadata whose data file is '../other-run/...' would make the loader read another run's file (its
    checksum can be matched by whoever crafts the directory): refused, naming the path."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from cocosync.shadowsync.checkpoint import CheckpointError
    from cocosync.shadowsync.safe_reader import SafeReader

    other, path = tmp_path / "other-run", tmp_path / "ckpt"
    dcp.save({"w": torch.ones(10)}, checkpoint_id=str(other), no_dist=True)
    dcp.save({"w": torch.ones(10)}, checkpoint_id=str(path), no_dist=True)
    (data,) = other.glob("*.distcp")
    metadata = pickle.loads((path / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = f"../other-run/{data.name}"
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"names the data file '\.\./other-run/.*', which is not a file of the "
                                              "checkpoint's own directory"):
        SafeReader(str(path)).read_metadata()


def test_a_writer_without_the_runs_secret_cannot_stop_a_local_run(tmp_path):
    """The launcher's store has no authentication, but a local run's keys live under a per-run secret that only the
    run's own processes hold (in their environment, which other users cannot read): a process that reaches the
    store's port and writes the keys a run reads (`stop`, heartbeats, pids) under the plain prefix changes nothing."""
    import datetime
    import json

    import torch.distributed as dist

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "cocosync_start", "train", "--examples", "800000", "--no-progress", "--out", str(out),
           "--timeout", "200"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or '"train"' not in (out / "metrics.jsonl").read_text():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        ports = {port for _, _, port in listening_sockets([proc.pid])}  # the launcher's: its store
        assert len(ports) == 1, ports
        port = ports.pop()
        intruder = dist.PrefixStore("cocosync/", dist.TCPStore("127.0.0.1", port, is_master=False,
                                                                timeout=datetime.timedelta(seconds=10)))
        intruder.set("stop", "planted")
        for t in range(2):
            intruder.set(f"beat/{t}", "0.0")
            intruder.set(f"pid/{t + 1}", str(os.getpid()))
        _, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["interrupted"] and summary["examples"] == 800_000
