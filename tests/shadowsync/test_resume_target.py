"""A resume writes where the user points: a copy of a run resumes into the copy (its saved config names the
original's directory), and a checkpoint outside a run directory needs --out."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys


def _train(*args):
    r = subprocess.run([sys.executable, "-m", "cocosync_start", "train", "--no-progress", *map(str, args)],
                       capture_output=True, text=True, timeout=240)
    return r


def test_a_copy_of_a_run_resumes_into_the_copy_and_never_writes_the_original(tmp_path):
    original, copy = tmp_path / "original", tmp_path / "copy"
    r = _train("--examples", 20_000, "--eval-examples", 2000, "-T", 1, "--out", original)
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.copytree(original, copy)
    before = sorted(p.name for p in (original / "checkpoints").iterdir())
    latest = (original / "checkpoints" / "latest").read_text()
    r = _train("--resume", copy, "--epochs", 2)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in (original / "checkpoints").iterdir()) == before  # nothing written there
    assert (original / "checkpoints" / "latest").read_text() == latest
    assert (copy / "checkpoints" / "latest").read_text().strip() == "seen-40000"
    assert json.loads((copy / "summary.json").read_text())["resumed_from"] == 20_000
    bare = tmp_path / "bare"  # a checkpoint directory alone, outside a run
    shutil.copytree(copy / "checkpoints" / "seen-20000", bare)
    r = _train("--resume", bare, "--epochs", 3)
    assert r.returncode == 2 and "not inside a run directory" in r.stderr and "--out" in r.stderr
