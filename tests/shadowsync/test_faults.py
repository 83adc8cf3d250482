"""Faults during a run: a stopped trainer is named within the heartbeat timeout, the error prints as plain text
(tracebacks hold [brackets] that rich would read as markup), and no process outlives the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cocosync.testing.sockets import job_ranks


def _trainers(pid: int) -> list[int]:
    """The job's trainers (local ranks 1 and 2; rank 0 is the embedding server)."""
    ranks = job_ranks(pid)
    return [ranks[r] for r in sorted(ranks) if r >= 1]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.split(") ")[1][0] != "Z"


@pytest.mark.faults
def test_a_stopped_trainer_is_named_within_the_heartbeat_timeout(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "cocosync_start", "train", "--sync", "fr-ma", "--sync-every", "2", "--examples",
           "3000000", "--eval-examples", "2000", "--no-progress", "--out", str(out), "--timeout", "300",
           "--heartbeat-timeout", "4", "--min-trainers", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stopped = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until both trainers train
            metrics = out / "metrics.jsonl"
            events = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
            if any(e.get("event") == "train" for e in events) and len(_trainers(proc.pid)) == 2:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        trainers = _trainers(proc.pid)
        assert len(trainers) == 2, trainers
        stopped = trainers[-1]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        stdout, stderr = proc.communicate(timeout=90)
        waited = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 1, stderr[-3000:]
    text = stdout + stderr
    assert "stopped responding" in text and f"pid {stopped}" in text, text[-3000:]
    assert "MarkupError" not in text and "Traceback" not in text, text[-3000:]
    assert waited < 4 + 30, waited  # the heartbeat timeout, then the teardown's grace and kill
    assert not _alive(stopped), "the stopped trainer outlived the run"


def test_a_second_run_on_the_same_output_directory_is_refused(tmp_path):
    from cocosync.shadowsync.job.launch import OutputLock as _OutputLock

    out = tmp_path / "run"
    out.mkdir()
    with _OutputLock(out):
        res = subprocess.run([sys.executable, "-m", "cocosync_start", "train", "--examples", "20000", "--no-progress",
                              "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "is in use by another run" in res.stderr and f"pid {os.getpid()}" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    with _OutputLock(out):  # released: it can be taken again
        pass
