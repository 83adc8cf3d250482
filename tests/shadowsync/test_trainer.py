"""ShadowSync trainers end to end: configs, a short run that learns, checkpoint + eval, a killed trainer,
Ctrl-C, and no process or /dev/shm leftovers (real spawned processes, gloo at 127.0.0.1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cocosync.shadowsync.checkpoint import read_tensors
from cocosync.shadowsync.config import ConfigError, SyncConfig, TrainConfig, load_train_config
from cocosync.shadowsync.job.launch import run_training
from cocosync.shadowsync.job.trainer import TrainerFailure
from cocosync.testing.sockets import job_ranks

SMALL = {"table_size": 2000}
MODEL = {"embedding_dim": 8, "bottom_mlp": [32, 8], "top_mlp": [32]}


def _shm() -> set[str]:
    # Other suites running concurrently on this machine create transient entries (semaphores of multiprocessing and
    # joblib: sem.mp-*, sem.loky-*; the runtime arena's cocosync-* segments). The trainers create none: pipes, not
    # queues, and shared tensors that never have a name (file-descriptor sharing), which the /proc/PID/maps check
    # proves.
    if not os.path.isdir("/dev/shm"):
        return set()
    return {f for f in os.listdir("/dev/shm") if not f.startswith(("sem.", "cocosync-"))}


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _group_members(pgid: int) -> list[str]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(f"{d.name}: {(d / 'cmdline').read_text().replace(chr(0), ' ')[:200]}")
    return out


def _group_alive(pgid: int) -> bool:
    return bool(_group_members(pgid))


# ------------------------------------------------------------------------------------------- configs
def test_config_errors_name_the_value_and_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"sync.algorithm='shadow-sgd'.*shadow-bmuf"):
        SyncConfig(algorithm="shadow-sgd")
    with pytest.raises(ConfigError, match=r"trainers=0 is invalid: expected an integer >= 1"):
        TrainConfig(trainers=0)
    with pytest.raises(ConfigError, match=r"block_momentum=1.0"):
        SyncConfig(block_momentum=1.0)
    p = tmp_path / "run.toml"
    p.write_text('trainers = 3\nexamples = 9000\n[sync]\nalgorithm = "fr-ma"\nevery = 4\n')
    cfg = load_train_config(p, workers=2)
    assert (cfg.trainers, cfg.workers, cfg.sync.algorithm, cfg.sync.every, cfg.sync.mode) == (3, 2, "fr-ma", 4,
                                                                                              "foreground")
    (tmp_path / "bad.json").write_text(json.dumps({"trainer": 2}))
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['trainer'\]"):
        load_train_config(tmp_path / "bad.json")


# ------------------------------------------------------------------------------------------- end to end
def _cfg(tmp_path, algorithm, **kw) -> TrainConfig:
    base = dict(examples=40_000, eval_examples=8_000, trainers=2, batch_size=128, progress=False, plot=False,
                out_dir=str(tmp_path / algorithm), data_options=SMALL, model=MODEL, timeout=120,
                sync=SyncConfig(algorithm=algorithm, **kw.pop("sync", {})))
    return TrainConfig(**{**base, **kw})


def test_crowded_shadow_averages_are_warned_about(tmp_path, monkeypatch):
    """More trainers than cores with a plain shadow average: the launcher says so and names the algorithms that held
    their NE there; with a core each, or with shadow-bmuf / fr-ma, it says nothing."""
    from io import StringIO

    from rich.console import Console

    from cocosync.shadowsync.job import launch

    advice = launch.crowded_shadow_advice
    for algorithm in ("shadow-ma", "shadow-easgd", "shadow-dssync"):
        msg = advice(_cfg(tmp_path, algorithm), trainers_here=16, cores=2)
        assert "16 trainers share 2 cores" in msg and algorithm in msg and "shadow-bmuf or fr-ma" in msg, msg
        assert advice(_cfg(tmp_path, algorithm), trainers_here=2, cores=2) is None
    for algorithm in ("shadow-bmuf", "fr-ma", "fr-easgd", "none"):
        assert advice(_cfg(tmp_path, algorithm), trainers_here=16, cores=2) is None
    monkeypatch.setattr(launch, "_cores", lambda: 1)  # the launcher's own check, on a run it starts
    out = StringIO()
    res = run_training(_cfg(tmp_path, "shadow-ma", examples=8_000, checkpoint=False),
                       console=Console(file=out, width=200))
    assert res.summary["examples"] == 8_000
    said = out.getvalue()
    assert "2 trainers share 1 core on this machine: with more trainers than cores shadow-ma" in said, said


def test_replica_lr_scale_multiplies_the_dense_step(tmp_path):
    """One trainer is deterministic: dense lr 0.1 at scale 0.5 trains the same bits as 0.05 at scale 1, and 0.1 at
    scale 1 does not (the scale reaches the trainer's update, not only the config)."""
    def ne(name, lr, scale):
        cfg = _cfg(tmp_path / name, "none", trainers=1, examples=8_000, checkpoint=False, dense_lr=lr,
                   sync={"replica_lr_scale": scale})
        return run_training(cfg).summary["eval_ne"]

    base = ne("a", 0.05, 1.0)
    assert ne("b", 0.1, 0.5) == base
    assert ne("c", 0.1, 1.0) != base


def test_shadow_bmuf_learns_checkpoints_and_leaves_nothing(tmp_path):
    before = _shm()
    res = run_training(_cfg(tmp_path, "shadow-bmuf", plot=True))
    s = res.summary
    assert s["examples"] == 40_000 and not s["interrupted"]
    # clearly below 1 (the base-rate predictor) and on its way to the Bayes NE (0.655). Alone it reaches 0.74-0.77;
    # under a parallel test run's load the shadow thread syncs at other moments and it once reached only 0.864
    assert s["eval_ne"] < 0.9, s
    assert s["excess_ne"] < 0.25, s
    assert s["syncs"] > 2 and s["sync_gap"] > 0
    assert Path(res.plot).stat().st_size > 0 and json.loads(Path(res.out_dir, "summary.json").read_text())
    ckpt = read_tensors(res.checkpoint)
    assert sum(int(ckpt[f"trainer.{t}.positions"].sum()) for t in (0, 1)) == 40_000
    from click.testing import CliRunner

    from cocosync.cli import main

    scored = CliRunner().invoke(main, ["eval", res.out_dir, "--json"])  # the run's latest checkpoint, scored alone
    assert scored.exit_code == 0, scored.output
    assert json.loads(scored.output.strip().splitlines()[-1])["ne"] == pytest.approx(s["eval_ne"], rel=1e-5)
    assert _shm() - before == set()


def test_foreground_easgd_runs_and_counts_its_sync_gap(tmp_path):
    # foreground mode + the EASGD center in shared memory (shadow mode + collectives: the test above)
    res = run_training(_cfg(tmp_path, "fr-easgd", examples=20_000, checkpoint=False, sync={"every": 3}))
    s = res.summary
    assert s["eval_ne"] < 0.95, s
    assert s["sync_gap"] == pytest.approx(3.0, rel=0.05)


# ------------------------------------------------------------------------------------------- failures
def _start_cli(tmp_path, *extra: str) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "cocosync_start", "train", "--examples", "150000", "--eval-examples", "4000",
           "--no-progress", "--batch-size", "64", "--out", str(out), "--timeout", "120", "--config",
           str(tmp_path / "c.toml"), *extra]
    (tmp_path / "c.toml").write_text("[data_options]\ntable_size = 2000\n[model]\nembedding_dim = 8\n"
                                     "bottom_mlp = [32, 8]\ntop_mlp = [32]\n")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline:  # wait until the trainers are training
        if metrics.exists() and '"event": "train"' in metrics.read_text():
            return proc, out
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"training did not start: {proc.communicate(timeout=10)}")


def _trainer_pids(proc) -> list[int]:
    """The job's trainers: local ranks 1 and 2 (rank 0 is the embedding server)."""
    ranks = job_ranks(proc.pid)
    return [ranks[r] for r in sorted(ranks) if r >= 1]


def _assert_no_named_shm(pid: int) -> None:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    # (/dev/shm/sem.mp-*: multiprocessing's semaphores of the agent's queues to a warm rank; its resource tracker
    # unlinks them)
    named = [m for m in maps if "/dev/shm/" in m and "(deleted)" not in m and "/dev/shm/sem.mp-" not in m]
    assert named == [], named


@pytest.mark.faults
def test_killed_trainer_fails_cleanly(tmp_path):
    before = _shm()
    proc, out = _start_cli(tmp_path, "--sync", "shadow-ma", "--min-trainers", "2")
    trainers = _trainer_pids(proc)
    assert len(trainers) == 2
    for t in trainers:
        _assert_no_named_shm(t)  # all shared tensors are unlinked: nothing can outlive the run
    os.kill(trainers[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert f"trainer 1 (rank 2) (pid {trainers[1]}) was killed by signal SIGKILL" in err, err[-3000:]
    time.sleep(0.5)
    assert not any(_alive(t) for t in trainers)
    assert _shm() - before == set()
    assert '"event": "failed"' in (out / "metrics.jsonl").read_text()


def test_ctrl_c_stops_cleanly_and_keeps_the_measurements(tmp_path):
    before = _shm()
    proc, out = _start_cli(tmp_path, "--sync", "shadow-bmuf")
    trainers = _trainer_pids(proc)
    for t in trainers:  # the launcher's session (one scheduler autogroup per job), a process group of their own
        assert (os.getsid(t), os.getpgid(t)) == (os.getsid(proc.pid), t)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and 0 < summary["examples"] < 150_000
    assert (out / "checkpoints" / "latest").exists() and "eval_ne" in summary
    time.sleep(0.5)
    assert not any(_alive(t) for t in trainers)
    deadline = time.monotonic() + 10  # nothing of the process group is left (helpers exit with the launcher)
    while time.monotonic() < deadline and _group_alive(proc.pid):
        time.sleep(0.2)
    assert not _group_alive(proc.pid), _group_members(proc.pid)
    assert _shm() - before == set()


@pytest.mark.faults
def test_sigterm_stops_like_ctrl_c_with_a_checkpoint(tmp_path):
    """What a scheduler or `kill` sends: the trainers stop, the summary and a checkpoint are written, the exit
    status says SIGTERM (143), and a resume continues from there."""
    proc, out = _start_cli(tmp_path, "--sync", "shadow-ma")
    trainers = _trainer_pids(proc)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher alone, as `kill PID` does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    assert "SIGTERM: stopping the trainers" in err and "stopped by SIGTERM" in err, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and 0 < summary["examples"] < 150_000
    assert (out / "checkpoints" / "latest").exists()
    time.sleep(0.5)
    assert not any(_alive(t) for t in trainers)


@pytest.mark.faults
def test_the_timeout_stops_the_run_and_keeps_what_it_trained(tmp_path):
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "cocosync_start", "train", "--examples", "3000000", "--no-progress",
                          "--eval-examples", "2000", "--out", str(out), "--timeout", "10", "--sync", "shadow-ma"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 124, res.stderr[-3000:]
    assert "--timeout 10 s reached: stopping the trainers" in res.stderr, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())  # (0 examples where start-up took the 10 s)
    assert summary["interrupted"] and summary["examples"] < 3_000_000 and "eval_ne" in summary
    assert (out / "checkpoints" / "latest").exists()


def test_a_raising_trainer_is_reported(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):  # a missing file is refused before any trainer starts
        run_training(_cfg(tmp_path, "none", data="/nonexistent/criteo.tsv"))
    garbage = tmp_path / "garbage.tsv"  # a trainer that raises while reading: reported naming it
    garbage.write_text("not\ta\tcriteo\tline\n" * 5000)
    with pytest.raises(ConfigError, match="garbage.tsv: 5000 of 5000 lines are malformed"):
        run_training(_cfg(tmp_path, "none", data=str(garbage)))  # estimating its click rate reads it first
    with pytest.raises(TrainerFailure, match="trainer [01]"):
        run_training(_cfg(tmp_path, "none", data=str(garbage), examples=4000, model={**MODEL, "init_ctr": 0.04}))


@pytest.mark.faults
def test_ctrl_c_in_process_then_resume_from_the_reader_positions(tmp_path):
    import threading

    cfg = _cfg(tmp_path, "shadow-ma", examples=600_000, batch_size=32, log_every=0.2)

    def interrupt_once_training():
        metrics = Path(cfg.out_dir) / "metrics.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if metrics.exists() and '"event": "train"' in metrics.read_text():
                os.kill(os.getpid(), signal.SIGINT)  # the launcher's handler: stop, keep what was measured
                return
            time.sleep(0.05)

    threading.Thread(target=interrupt_once_training, daemon=True).start()
    first = run_training(cfg)
    assert first.interrupted and 0 < first.summary["examples"] < 600_000
    done = first.summary["examples"]
    second = run_training(cfg, resume=first.checkpoint)
    assert not second.interrupted
    assert second.summary["resumed_from"] == done
    assert second.summary["examples"] == 600_000 - done  # every example exactly once over both sessions
    assert second.summary["eval_ne"] < 0.95
    with pytest.raises(ConfigError, match="trained with seed=0"):
        run_training(_cfg(tmp_path, "shadow-ma", examples=600_000, batch_size=32, seed=1), resume=first.checkpoint)
