"""Nothing is lost on one machine: periodic checkpoints (--checkpoint-every) survive a killed launcher or trainer,
and a resumed run continues every trainer's state exactly (replica, dense Adagrad, BMUF state, tables, readers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cocosync.shadowsync.checkpoint import read_tensors
from cocosync.shadowsync.config import SyncConfig, TrainConfig
from cocosync.shadowsync.job.launch import run_training
from cocosync.testing.sockets import job_ranks, process_tree

SMALL = {"table_size": 2000}
MODEL = {"embedding_dim": 8, "bottom_mlp": [32, 8], "top_mlp": [32]}
CONFIG = ("[data_options]\ntable_size = 2000\n[model]\nembedding_dim = 8\nbottom_mlp = [32, 8]\ntop_mlp = [32]\n")


def _cfg(out: Path, algorithm: str, **kw) -> TrainConfig:
    base = dict(examples=24_000, eval_examples=2_000, trainers=1, workers=1, batch_size=64, progress=False, plot=False,
                out_dir=str(out), data_options=SMALL, model=MODEL, timeout=120, sync=SyncConfig(algorithm=algorithm))
    return TrainConfig(**{**base, **kw})


def _assert_equal(a: str, b: str) -> None:
    """Every tensor of two checkpoints equal (tables, accumulators, row versions, replicas, readers)."""
    ta, tb = read_tensors(a), read_tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def _seen(path) -> int:
    return sum(int(v.sum()) for k, v in read_tensors(path).items() if k.endswith(".positions"))


def _cli(out: Path, tmp: Path, *extra: str) -> subprocess.Popen:
    (tmp / "c.toml").write_text(CONFIG)
    cmd = [sys.executable, "-m", "cocosync_start", "train", "--config", str(tmp / "c.toml"), "--no-progress",
           "--out", str(out), "--timeout", "120", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_checkpoint(proc: subprocess.Popen, out: Path, timeout: float = 90) -> dict:
    """The first 'checkpoint' record of a running CLI's metrics."""
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                if '"event": "checkpoint"' in line:
                    return json.loads(line)
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no checkpoint was written: {proc.communicate(timeout=10)}")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("algorithm", ["none", "shadow-bmuf"])
def test_stop_and_resume_continue_exactly_as_an_uninterrupted_run(tmp_path, algorithm):
    """One trainer, one worker: the order is fixed, so stopping after N examples and resuming ends bit for bit where
    the uninterrupted run ends (dense Adagrad accumulator and table accumulators included). Also with the default
    shadow-bmuf: one trainer has nothing to sync, so no shadow thread rewrites the replica at times of its own."""
    whole = run_training(_cfg(tmp_path / "whole", algorithm))
    first = run_training(_cfg(tmp_path / "parts", algorithm), stop_after=10_000)
    done = first.summary["examples"]
    assert first.summary["stopped"] and 10_000 <= done < 10_000 + 64  # whole batches
    second = run_training(_cfg(tmp_path / "parts", algorithm), resume=first.checkpoint)
    assert second.summary["resumed_from"] == done and second.summary["examples"] == 24_000 - done
    _assert_equal(whole.checkpoint, second.checkpoint)
    assert second.summary["eval_ne"] == whole.summary["eval_ne"]


@pytest.mark.faults
def test_a_killed_launcher_resumes_exactly_from_its_last_periodic_checkpoint(tmp_path):
    whole = run_training(_cfg(tmp_path / "whole", "none", examples=60_000))
    out = tmp_path / "killed"
    proc = _cli(out, tmp_path, "--sync", "none", "--trainers", "1", "--examples", "60000", "--eval-examples", "2000",
                "--batch-size", "64", "--checkpoint-every", "6000")
    rec = _wait_for_checkpoint(proc, out)
    ranks = list(job_ranks(proc.pid).values())
    assert len(ranks) == 2, ranks  # an embedding server and the trainer
    tree = process_tree(proc.pid)[1:]  # the ranks, the warm fork server, multiprocessing's resource tracker
    os.kill(proc.pid, signal.SIGKILL)  # no chance to write anything more
    deadline = time.monotonic() + 5  # the ranks die with their launcher, then the helpers (the server lives as long
    proc.communicate(timeout=30)     # as any rank: each holds its liveness pipe, and it holds the launcher's stdout)
    while time.monotonic() < deadline and any(_alive(t) for t in tree):
        time.sleep(0.1)
    left = [t for t in tree if _alive(t)]
    assert not left, [Path(f"/proc/{t}/cmdline").read_bytes()[:100] for t in left]
    seen = _seen(out)  # its latest checkpoint
    assert seen % 6000 < 64 and 6000 <= seen < 60_000 and rec["examples"] <= seen  # a mark, not the end
    resumed = run_training(_cfg(out, "none", examples=60_000), resume=out)
    assert resumed.summary["resumed_from"] == seen and resumed.summary["examples"] == 60_000 - seen
    _assert_equal(whole.checkpoint, resumed.checkpoint)


@pytest.mark.faults
def test_a_killed_trainer_loses_only_what_followed_the_last_checkpoint(tmp_path):
    """Two trainers x two Hogwild workers with Shadow-BMUF, both needed (--min-trainers 2): a trainer killed after a
    periodic checkpoint fails the run naming it; the resumed run restores every trainer's replica and BMUF state and
    sees every example once."""
    out = tmp_path / "run"
    proc = _cli(out, tmp_path, "--sync", "shadow-bmuf", "--trainers", "2", "--workers", "2", "--examples", "150000",
                "--eval-examples", "4000", "--batch-size", "64", "--checkpoint-every", "20000", "--min-trainers", "2")
    _wait_for_checkpoint(proc, out)
    ranks = job_ranks(proc.pid)
    saved = _seen(out)
    os.kill(ranks[2], signal.SIGKILL)  # local rank 2: trainer 1 (the embedding server is rank 0)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "trainer 1" in err and "SIGKILL" in err, err[-3000:]
    seen = _seen(out)
    assert seen >= saved and seen < 150_000
    ckpt = read_tensors(out)
    assert {f"trainer.{t}.{k}" for t in (0, 1) for k in ("flat", "accumulator")} <= set(ckpt)
    bmuf = sorted(k for k in ckpt if k.startswith("trainer.0.bmuf"))
    assert bmuf, sorted(ckpt)
    cfg = _cfg(out, "shadow-bmuf", trainers=2, workers=2, examples=150_000, eval_examples=4_000)
    resumed = run_training(cfg, resume=out)
    s = resumed.summary
    assert s["resumed_from"] == seen and s["examples"] == 150_000 - seen  # every example exactly once
    assert s["eval_ne"] < 0.9, s


def test_foreground_collective_sync_checkpoints_at_common_rounds_without_deadlock(tmp_path):
    """FR-MA, two trainers x two workers: marks open only after a sync round every trainer ran, so no trainer waits
    in the all-reduce for one paused at a mark."""
    cfg = _cfg(tmp_path / "fr", "fr-ma", trainers=2, workers=2, examples=40_000, sync=SyncConfig(algorithm="fr-ma",
                                                                                                   every=3))
    res = run_training(cfg, checkpoint_every=4_000)
    marks = [json.loads(line) for line in (tmp_path / "fr" / "metrics.jsonl").read_text().splitlines()
             if '"event": "checkpoint"' in line]
    assert len(marks) >= 5 and res.summary["examples"] == 40_000
    ckpt = read_tensors(res.checkpoint)
    a, b = ckpt["trainer.0.flat"], ckpt["trainer.1.flat"]
    assert torch.allclose(a, b, atol=1e-6)  # the last round averaged them (x + (mean - x): equal up to rounding)
