"""A checkpoint in the layout of the release before the parts became Stateful (data/run-c92ecf7: `cocosync train
--examples 4096 --table-size 64 --embedding-dim 4 --bottom-mlp 8,4 --top-mlp 8,4 --eval-examples 1000` at commit
c92ecf7, with `cocosync eval`'s scores of it then in eval.json) still scores the same and resumes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "data" / "run-c92ecf7"


def _cocosync(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cocosync_start", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_an_older_checkpoint_scores_as_it_did(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    out = _cocosync("eval", str(run), "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    now, then = json.loads(out.stdout.strip().splitlines()[-1]), json.loads((FIXTURE / "eval.json").read_text())
    assert now["examples"] == then["examples"]
    for key in ("ne", "auc", "log_loss"):
        assert now[key] == pytest.approx(then[key], abs=1e-6), key


def test_an_older_checkpoint_resumes_into_a_second_pass(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    out = _cocosync("train", "--resume", str(run), "--out", str(run), "--epochs", "2", "--no-progress", "--json",
                    timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["resumed_from"] == 4096 and summary["examples"] == 4096
    assert (run / "checkpoints" / "seen-8192" / "meta.json").is_file()
