"""A lost trainer does not stop a one-machine job: killed (kill -9) or silent past --heartbeat-timeout, the trainers
left re-form their dense sync, read its unread rows and end the run with a summary and a checkpoint; below
--min-trainers the job stops naming the trainer, as before. Real jobs through `cocosync train`, with timeouts."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from cocosync.runtime.comm.topology import Topology
from cocosync.shadowsync.job.membership import ABSENT, EPOCH, LOSS_ACROSS, Membership, loss_across, record_change
from cocosync.shadowsync.job.roles import Roles
from cocosync.testing.sockets import job_ranks

EXAMPLES = 400_000


def _start(tmp_path: Path, *extra: str, trainers: int = 4, examples: int = EXAMPLES,
           stderr: Path | None = None) -> tuple[subprocess.Popen, Path]:
    """The job, its launcher's stderr piped (or written to `stderr`, read while it runs)."""
    out = tmp_path / "run"
    (tmp_path / "c.toml").write_text("[data_options]\ntable_size = 2000\n[model]\nembedding_dim = 8\n"
                                     "bottom_mlp = [32, 8]\ntop_mlp = [32]\n")
    cmd = [sys.executable, "-m", "cocosync_start", "train", "--trainers", str(trainers), "--examples", str(examples),
           "--eval-examples", "4000", "--no-progress", "--out", str(out), "--timeout", "200", "--config",
           str(tmp_path / "c.toml"), *extra]
    err = subprocess.PIPE if stderr is None else open(stderr, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    return proc, out


def _trainer_pid(proc: subprocess.Popen, out: Path, t: int, after: int = 30_000, local_rank: int | None = None) -> int:
    """Trainer t's pid once the job has trained `after` examples (local rank t + 1: the embedding server is 0), or
    that of the rank at `local_rank`."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        metrics = out / "metrics.jsonl"
        records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        if any(r.get("event") == "train" and r["examples"] >= after for r in records):
            return job_ranks(proc.pid)[t + 1 if local_rank is None else local_rank]
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"training did not start: {proc.communicate(timeout=10)}")


def _finish(proc: subprocess.Popen, timeout: float = 150) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _scores_as_it_ended(out: Path, summary: dict) -> None:
    """The run's last checkpoint scores (cocosync eval) the eval NE the run ended with."""
    scored = subprocess.run([sys.executable, "-m", "cocosync_start", "eval", str(out), "--json"], capture_output=True,
                            text=True, timeout=120)
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert json.loads(scored.stdout.strip().splitlines()[-1])["ne"] == pytest.approx(summary["eval_ne"], rel=1e-5)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("cocosync")}


@pytest.mark.faults
def test_a_killed_trainer_leaves_the_others_training_and_its_rows_read(tmp_path):
    before = _shm()
    proc, out = _start(tmp_path)
    victim = _trainer_pid(proc, out, 2)
    os.kill(victim, signal.SIGKILL)
    stdout, stderr = _finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"trainer 2 (pid {victim}) was lost (killed by SIGKILL)" in stderr, stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert [(x["trainer"], x["pid"], x["signal"]) for x in s["lost"]] == [(2, victim, "SIGKILL")]
    assert s["trainers_left"] == 3 and not s["stopped"] and s["short_by"] == 0
    assert [m["trainers"] for m in s["membership"]] == [4, 3] and s["membership"][1]["lost"] == 2
    # every row read once: the lost trainer's before it died, the rest of its share by the others
    assert s["examples"] == EXAMPLES, s["examples"]
    assert s["lost"][0]["examples"] + s["takeover_rows"] == EXAMPLES // 4
    assert s["lost"][0]["examples"] >= 30_000 // 4 and s["takeover_rows"] > 0
    assert s["eval_ne"] < 0.9, s["eval_ne"]
    # the last checkpoint stands in for the lost trainer's part (every row read): it scores and resumes
    meta = json.loads((Path(s["checkpoint"]) / "meta.json").read_text())
    assert "lost_trainers" not in meta and meta["examples_seen"] == EXAMPLES
    _scores_as_it_ended(out, s)
    assert not _alive(victim)
    assert _shm() - before == set()


RESTART_EXAMPLES = 1_600_000  # (long enough for a restart, ~5 s on a loaded 2-core machine, to join before the end)


def _restarted_pid(proc: subprocess.Popen, old: int, t: int) -> int:
    """Trainer t's pid once a process other than `old` runs it (its restart)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pid = job_ranks(proc.pid).get(t + 1)
        if pid is not None and pid != old:
            return pid
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"trainer {t} was not started again: {proc.communicate(timeout=10)}")


@pytest.mark.faults
def test_a_killed_trainer_started_again_takes_the_model_from_a_peer_and_reads_the_rest_of_its_rows(tmp_path):
    """--max-restarts: the keeper starts the killed trainer again; the new process joins the running job (the others
    never stop), takes the dense model from a trainer in the job and reads the rest of its own rows: every row is read
    once, none by the others. Then the restart is killed too: with no restart left, the others read its rows."""
    before = _shm()
    log = tmp_path / "stderr"
    # (the periodic checkpoints after the loss are skipped: a restart takes no part in them, and waits for none)
    proc, out = _start(tmp_path, "--max-restarts", "1", "--checkpoint-every", "400000", examples=RESTART_EXAMPLES,
                       stderr=log)
    victim = _trainer_pid(proc, out, 2, after=100_000)
    os.kill(victim, signal.SIGKILL)
    restarted = _restarted_pid(proc, victim, 2)
    _finish(proc)
    stderr = log.read_text()
    assert proc.returncode == 0, stderr[-3000:]
    assert f"trainer 2 (pid {victim}) was lost (killed by SIGKILL)" in stderr, stderr[-3000:]
    assert f"trainer 2 (pid {restarted}) joined again (restart 1 of 1)" in stderr, stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert [m["trainers"] for m in s["membership"]] == [4, 3, 4] and s["membership"][2]["joined"] == 2
    [r] = s["restarts"]
    assert (r["trainer"], r["restart"], r["pid"], r["read_own_rows"]) == (2, 1, restarted, True)
    assert r["state_from"] in (0, 1, 3) and r["trains_after_s"] < 10, r
    # every row read once: trainer 2's rows by its two processes, none by the others
    assert s["examples"] == RESTART_EXAMPLES and s["takeover_rows"] == 0 and s["short_by"] == 0
    assert s["lost"][0]["examples"] + r["examples"] == RESTART_EXAMPLES // 4 and r["examples"] > 0
    assert s["trainers_left"] == 4 and s["eval_ne"] < 0.9, s["eval_ne"]
    meta = json.loads((Path(s["checkpoint"]) / "meta.json").read_text())
    assert meta["examples_seen"] == RESTART_EXAMPLES
    # the first mark after the loss is skipped, said once, and none after it is saved
    at = s["checkpoints_stopped_at"]
    assert at in (400_000, 800_000, 1_200_000), at
    assert stderr.count("periodic checkpoints (every 400,000 examples) stop at") == 1, stderr[-3000:]
    assert f"stop at {at:,}: the job's trainers changed since it started" in stderr, stderr[-3000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["examples"] < at for r in records if r.get("event") == "checkpoint"), records
    assert [r["examples"] for r in records if r.get("event") == "checkpoints-stopped"] == [at]
    assert f"no periodic checkpoint was saved from {at:,} examples on" in stderr, stderr[-2000:]  # (the report)
    _scores_as_it_ended(out, s)
    assert _shm() - before == set()


@pytest.mark.faults
def test_a_restart_killed_in_turn_stays_lost_and_the_others_read_its_rows(tmp_path):
    before = _shm()
    log = tmp_path / "stderr"
    proc, out = _start(tmp_path, "--max-restarts", "1", examples=RESTART_EXAMPLES, stderr=log)
    victim = _trainer_pid(proc, out, 1, after=100_000)
    os.kill(victim, signal.SIGKILL)
    restarted = _restarted_pid(proc, victim, 1)
    _wait_for(log, f"trainer 1 (pid {restarted}) joined again", proc)
    time.sleep(1.0)  # (it trains)
    os.kill(restarted, signal.SIGKILL)
    _finish(proc)
    stderr = log.read_text()
    assert proc.returncode == 0, stderr[-3000:]
    assert f"trainer 1 (pid {restarted}) was lost (killed by SIGKILL)" in stderr, stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert [m["trainers"] for m in s["membership"]] == [4, 3, 4, 3]
    assert [(x["trainer"], x["pid"], x["restart"]) for x in s["lost"]] == [(1, victim, 0), (1, restarted, 1)]
    assert s["restarts"] == [] and s["trainers_left"] == 3  # (the restart's own result died with it)
    # every row read once: trainer 1's by its two processes and, the rest, by the others
    assert s["examples"] == RESTART_EXAMPLES and s["short_by"] == 0
    assert sum(x["examples"] for x in s["lost"]) + s["takeover_rows"] == RESTART_EXAMPLES // 4
    assert s["takeover_rows"] > 0
    assert _shm() - before == set()


def _wait_for(log: Path, line: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while line not in log.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"never said {line!r}: {log.read_text()[-3000:]}")
        time.sleep(0.05)


@pytest.mark.faults
def test_a_killed_embedding_server_leaves_the_job_training_and_its_shard_in_the_checkpoint(tmp_path):
    """The server's shard lives in the machine's shared memory, which the trainers update in place: they train on,
    trainer 0 saves the shard in the periodic checkpoints that follow, and the first trainer in the last one, which
    scores as the run did."""
    before = _shm()
    # one periodic checkpoint, at 600k: after the kill
    proc, out = _start(tmp_path, "--checkpoint-every", "600000", trainers=2, examples=3 * EXAMPLES)
    victim = _trainer_pid(proc, out, 0, local_rank=0)
    os.kill(victim, signal.SIGKILL)
    stdout, stderr = _finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"embedding server 0 (pid {victim}) was lost (killed by SIGKILL)" in stderr, stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert [(x["server"], x["pid"], x["signal"]) for x in s["lost_servers"]] == [(0, victim, "SIGKILL")]
    assert s["lost"] == [] and s["examples"] == 3 * EXAMPLES and not s["stopped"]
    assert s["eval_ne"] < 0.9, s["eval_ne"]
    assert (Path(s["checkpoint"]) / "meta.json").is_file()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    saved = [r for r in records if r.get("event") == "checkpoint"]
    assert [r["examples"] // 600_000 for r in saved] == [1], saved  # (at the batch that crossed it)
    periodic = subprocess.run([sys.executable, "-m", "cocosync_start", "eval", saved[-1]["path"], "--json"],
                              capture_output=True, text=True, timeout=120)  # (the shard is in it)
    assert periodic.returncode == 0, periodic.stderr[-2000:]
    _scores_as_it_ended(out, s)
    assert not _alive(victim)
    assert _shm() - before == set()


@pytest.mark.faults
def test_an_embedding_server_lost_while_the_job_ends_is_survived_and_takes_no_part_in_its_checkpoints(tmp_path):
    """On one machine the trainers save the shards from shared memory: a periodic checkpoint is taken while the server
    is stopped (SIGSTOP), and the server, killed once the job has scored its model (its end has begun), is recorded as
    lost; the job ends with every shard in its last checkpoint."""
    before = _shm()
    proc, out = _start(tmp_path, "--checkpoint-every", "200000", trainers=2)
    victim = _trainer_pid(proc, out, 0, local_rank=0)
    os.kill(victim, signal.SIGSTOP)
    deadline = time.monotonic() + 120
    metrics = out / "metrics.jsonl"
    while not any(json.loads(x).get("event") == "eval" for x in metrics.read_text().splitlines()):
        if time.monotonic() > deadline or proc.poll() is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the job did not score its model with its server stopped: {proc.communicate(timeout=10)}")
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    stdout, stderr = _finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"embedding server 0 (pid {victim}) was lost (killed by SIGKILL)" in stderr, stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert [(x["server"], x["pid"]) for x in s["lost_servers"]] == [(0, victim)]
    assert s["examples"] == EXAMPLES and s["lost"] == [] and s["server_cpu_seconds"] == 0  # (its record died with it)
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["examples"] // 200_000 for r in records if r.get("event") == "checkpoint"] == [1]
    _scores_as_it_ended(out, s)
    assert not _alive(victim)
    assert _shm() - before == set()


@pytest.mark.faults
def test_a_silent_trainer_0_is_killed_at_the_heartbeat_timeout_and_the_first_left_finishes_the_job(tmp_path):
    """Trainer 0 (which started the run's metrics) stopped: killed at the heartbeat timeout, and trainer 1 writes the
    summary and the checkpoint, which scores."""
    proc, out = _start(tmp_path, "--heartbeat-timeout", "3", "--sync", "fr-bmuf")
    victim = _trainer_pid(proc, out, 0)
    os.kill(victim, signal.SIGSTOP)
    stdout, stderr = _finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"trainer 0 (pid {victim}) stopped responding" in stderr and "killing it" in stderr, stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert [x["trainer"] for x in s["lost"]] == [0] and s["examples"] == EXAMPLES
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records].count("summary") == 1
    _scores_as_it_ended(out, s)
    assert not _alive(victim)


@pytest.mark.faults
def test_below_min_trainers_the_job_stops_naming_the_trainer(tmp_path):
    """--min-trainers 3 of 4: the first loss is survived, the second stops the job naming its trainer."""
    proc, out = _start(tmp_path, "--min-trainers", "3", "--sync", "shadow-ma")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    first = _trainer_pid(proc, out, 3)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 60  # the second loss comes once the first is recorded (the monitor says it)
    while not any("was lost" in x for x in lines) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    second = job_ranks(proc.pid)[2]
    os.kill(second, signal.SIGKILL)
    try:
        proc.wait(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    stderr = "".join(lines)
    assert proc.returncode == 1, stderr[-3000:]
    assert f"trainer 3 (pid {first}) was lost" in stderr, stderr[-3000:]
    assert f"trainer 1 (rank 2) (pid {second}) was killed by signal SIGKILL" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


def _roles(trainers: int) -> Roles:
    return Roles(Topology(rank=0, world_size=trainers + 1, local_rank=0, local_world_size=trainers + 1, node=0), 1, 0)


def test_the_membership_reads_losses_in_order_and_agrees_without_the_lost(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    m = Membership(dist.PrefixStore("cocosync/", store), _roles(4), 1, timeout=5.0)
    assert m.epoch() == 0 and m.live() == [0, 1, 2, 3]
    record_change(m.store, "lost", 2, pid=7, signal="SIGKILL")
    assert m.wait_for_change(0) == 1 and m.live() == [0, 1, 3]
    assert [x.describe() for x in m.losses()] == ["trainer 2 (pid 7) was lost: killed by SIGKILL"]
    assert m.alive_ranks([0, 1, 3]) == [0, 1, 2, 4]  # the embedding server (rank 0) and the trainers left
    for t in (0, 1):
        m.store.set(f"agree/end/{t}", "0")  # (arrived: its first process, restart 0)
    assert m.agree("end", 3) == 1  # every live trainer is there: the lost one is not waited for
    assert m.agree("late", 0, give_up=lambda: True) is None
    assert m.wait_for_change(1, timeout=0.2) is None
    # a trainer still training is waited for past the membership's timeout (without a collective sync the trainers
    # finish apart)
    slow = Membership(dist.PrefixStore("job2/", store), _roles(2), 1, timeout=0.2)
    threading.Timer(1.0, lambda: slow.store.set("agree/apart/1", "0")).start()
    assert slow.agree("apart", 0) == 0


def test_the_membership_replays_losses_and_joins_and_a_restart_claims_its_rows_only_before_an_agreement(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    m = Membership(dist.PrefixStore("cocosync/", store), _roles(3), 1, timeout=5.0)
    lost = record_change(m.store, "lost", 1, pid=7, signal="SIGKILL")
    record_change(m.store, "joined", 1, pid=8, restart=1)
    record_change(m.store, "lost", 2, pid=9, signal="SIGKILL")
    assert m.live(1) == [0, 2] and m.live(2) == [0, 1, 2] and m.live() == [0, 1]
    assert m.first_live() == [0]  # (trainer 1's process is a restart: in none of the job's process groups)
    assert [x.describe() for x in m.changes()] == ["trainer 1 (pid 7) was lost: killed by SIGKILL",
                                                   "trainer 1 (pid 8) joined again (restart 1)",
                                                   "trainer 2 (pid 9) was lost: killed by SIGKILL"]
    assert m.restarts(1) == 1 and m.restarts(1, epoch=1) == 0
    # an arrival at an agreement counts for the process that made it: the lost one's is not its restart's
    m.store.set("agree/end/1", "0")
    assert m.agree("end", 0, give_up=lambda: True) is None
    m.store.set("agree/end/1", "1")
    assert m.agree("end", 0) == 3
    # trainer 1's rows go to whichever claims them first: its restart, or an agreement that shares them out
    assert m.claim_rows(lost, "join") == "join" and m.claim_rows(lost, "phase1") == "join"
    assert m.claim_rows(3, "phase1") == "phase1" and m.claim_rows(3, "join") == "phase1"


_KEEPER = textwrap.dedent("""
    import datetime, os, signal, sys
    import torch.distributed as dist
    from cocosync.shadowsync.job.membership import keep_trainer
    port, how, trainers, least = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    def store():
        return dist.PrefixStore("cocosync/", dist.TCPStore("127.0.0.1", port, is_master=False,
                                                           timeout=datetime.timedelta(seconds=10)))
    if keep_trainer(1, trainers, least, store) is not None:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3 if how == "fail" else 0)
    print("keeper returns")
""")

_KEEPER_ACROSS = _KEEPER.replace("keep_trainer(1, trainers, least, store)",
                                 "keep_trainer(1, trainers, least, store, per_node=int(sys.argv[5]))")


@pytest.mark.parametrize("how,trainers,least,code,lost", [
    ("kill", 2, 1, 0, True),  # lost, enough left: the keeper ends as a rank that finished
    ("kill", 2, 2, -signal.SIGKILL, False),  # too few left: it dies by the trainer's signal
    ("fail", 2, 1, 3, False),  # a trainer that failed (an exit status) is no loss
    ("done", 2, 1, 0, False),
])
def test_the_keeper_records_a_loss_only_where_the_job_can_go_on(tmp_path, how, trainers, least, code, lost):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    script = tmp_path / "keeper.py"
    script.write_text(_KEEPER)
    proc = subprocess.run([sys.executable, str(script), str(store.port), how, str(trainers), str(least)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert ("keeper returns" in proc.stdout) == (code == 0)
    view = dist.PrefixStore("cocosync/", store)
    assert view.check(["change/1"]) == lost
    assert int(view.add(EPOCH, 0)) == int(lost)



@pytest.mark.parametrize("per_node,first,code,lost", [
    (2, None, 0, True),  # the job's first loss across machines, its machine keeps a trainer: a lone trainer's loss
    (1, None, -signal.SIGKILL, False),  # its machine keeps none: the keeper dies, the machine leaves as a lost one
    (2, "node", -signal.SIGKILL, False),  # a machine was lost first: a later loss is not survived
    (2, "trainer 3", -signal.SIGKILL, False),  # so was another trainer
])
def test_across_machines_the_keeper_records_a_lone_trainers_loss_only_as_the_first(tmp_path, per_node, first, code,
                                                                                     lost):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    view = dist.PrefixStore("cocosync/", store)
    if first is not None:
        view.set(LOSS_ACROSS, first)
    script = tmp_path / "keeper.py"
    script.write_text(_KEEPER_ACROSS)
    proc = subprocess.run([sys.executable, str(script), str(store.port), "kill", "4", "1", str(per_node)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert view.check(["change/1"]) == lost and int(view.add(EPOCH, 0)) == int(lost)
    assert loss_across(view) == ("trainer 1" if lost else first)
    assert int(view.add(ABSENT, 0)) == int(lost)


_RESTARTING_KEEPER = textwrap.dedent("""
    import datetime, os, signal, sys
    import torch.distributed as dist
    from cocosync.shadowsync.job.membership import ABSENT, keep_trainer
    port, restarts = int(sys.argv[1]), int(sys.argv[2])
    def store():
        return dist.PrefixStore("cocosync/", dist.TCPStore("127.0.0.1", port, is_master=False,
                                                           timeout=datetime.timedelta(seconds=10)))
    restart = keep_trainer(1, 2, 1, store, restarts)
    if restart is not None:  # every process of trainer 1 is killed (a restart joins first: it is back in the job)
        print(f"restart {restart}", flush=True)
        if restart:
            store().add(ABSENT, -1)
        os.kill(os.getpid(), signal.SIGKILL)
    print("keeper returns", flush=True)
""")


@pytest.mark.parametrize("when,code,restarts,changes", [
    ("reading", 0, [0, 1, 2], 3),  # while the trainers read their own rows: started again, up to --max-restarts
    ("phase1", 0, [0], 1),  # a trainer has read its own rows: lost, not started again (the others read its rows)
    ("end", -signal.SIGKILL, [0], 0),  # the job's end is agreed (collective): no loss the job goes on from
])
def test_the_keeper_starts_a_lost_trainer_again_only_while_the_trainers_read_their_own_rows(tmp_path, when, code,
                                                                                              restarts, changes):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    view = dist.PrefixStore("cocosync/", store)
    if when != "reading":
        view.set(f"agree/{when}/any", "1")
        view.set(f"agree/{when}/epoch", "0")
    script = tmp_path / "keeper.py"
    script.write_text(_RESTARTING_KEEPER)
    proc = subprocess.run([sys.executable, str(script), str(store.port), "2"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert [int(x.split()[1]) for x in proc.stdout.splitlines() if x.startswith("restart")] == restarts
    assert int(view.add(EPOCH, 0)) == changes
    if when == "phase1":
        assert "trainer 1 is not started again" in proc.stderr


def _rows(segments: list) -> list[tuple[int, int]]:
    """The (base shard, row) pairs of plan segments."""
    return [(base, r) for base, first, n in segments for r in range(first, first + n)]


def test_a_trainer_lost_while_reading_a_lost_trainers_rows_leaves_the_rest_to_the_others():
    """Trainer 3 is lost with most of its rows unread; trainers 0-2 share them out. Trainer 2 is lost halfway through
    its share, and trainer 1 before it started the next one: each time the trainers left read the rest between them,
    and every row of trainer 3's shards is read exactly once. The shares are computed as each trainer's Recovery
    computes them, through a real store (no timing: an end-to-end kill could not choose the moment)."""
    from types import SimpleNamespace

    import torch

    from cocosync.shadowsync.config import TrainConfig
    from cocosync.shadowsync.data.sources import build_configs
    from cocosync.shadowsync.job.recovery import Recovery

    T, W, E = 4, 2, 8000
    per = E // (T * W)
    cfg = TrainConfig(examples=E, trainers=T, workers=W)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    m = Membership(dist.PrefixStore("cocosync/", store), _roles(T), 1, timeout=5.0)
    job = SimpleNamespace(cfg=cfg, data=build_configs(cfg)[0], plan=None, roles=_roles(T),
                          positions=torch.full((T, W), per, dtype=torch.int64),
                          share_positions=torch.zeros(T, W + 1, dtype=torch.int64))
    recovery = {t: Recovery(job, m, t) for t in range(T)}

    def lose(t: int) -> None:
        record_change(m.store, "lost", t, pid=1, signal="SIGKILL")

    def agree(phase: int, trainers: list[int]) -> dict[int, list]:
        """Every trainer in `trainers` (the ones left) takes its share at agreement `phase`."""
        for t in trainers:  # (they all arrived: no call waits for another)
            m.store.set(f"agree/phase{phase}/{t}", "0")
        shares = {}
        for t in trainers:
            got = recovery[t].takeover()
            assert got is not None and got.shards == len(trainers) * W
            live, parts = recovery[t].shares[phase]
            shares[t] = parts[live.index(t) * W:(live.index(t) + 1) * W]
        return shares

    job.positions[3] = torch.tensor([300, 200])  # trainer 3 read this much of its two shards
    lose(3)
    read = _rows([(6, 0, 300), (7, 0, 200)])
    first = agree(1, [0, 1, 2])
    for t in (0, 1, 2):
        assert (recovery[t].begin() == 0).all()
    assert job.share_positions[:3, 0].tolist() == [1, 1, 1]
    read += _rows([s for t in (0, 1) for part in first[t] for s in part])  # 0 and 1 read their shares to the end
    job.share_positions[2, 1:] = torch.tensor([50, 10])  # trainer 2 is lost 60 rows into its share
    read += [x for part, k in zip(first[2], (50, 10)) for x in _rows(part)[:k]]
    lose(2)
    assert recovery[0].share_rows_read(2) == 60 and recovery[0].share_rows_read(3) == 0
    second = agree(2, [0, 1])
    assert sum(len(_rows(p)) for t in (0, 1) for p in second[t]) == sum(len(_rows(p)) for p in first[2]) - 60
    recovery[0].begin()  # trainer 0 starts its share; trainer 1 is lost before it starts its own
    read += _rows([s for part in second[0] for s in part])
    lose(1)
    third = agree(3, [0])  # all of trainer 1's second share goes to trainer 0
    read += _rows([s for part in third[0] for s in part])
    assert sorted(read) == _rows([(6, 0, per), (7, 0, per)])  # every row of trainer 3's shards, each once
    assert recovery[0].share_rows_read(1) == sum(len(_rows(p)) for p in first[1])


@pytest.mark.parametrize("got_back", [False, True])
def test_a_trainer_lost_twice_has_its_rows_shared_out_once(got_back):
    """Trainer 2 is lost, started again, and its restart is lost too: the agreement that follows shares out the rest
    of trainer 2's own rows once, whether the restart got them back and read some (`got_back`), or never did (it
    gave up joining): then the rows are the first loss's, not its restart's."""
    from types import SimpleNamespace

    import torch

    from cocosync.shadowsync.config import TrainConfig
    from cocosync.shadowsync.data.sources import build_configs
    from cocosync.shadowsync.job.recovery import Recovery

    T, W, E = 3, 1, 3000
    cfg = TrainConfig(examples=E, trainers=T, workers=W)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    m = Membership(dist.PrefixStore("cocosync/", store), _roles(T), 1, timeout=5.0)
    job = SimpleNamespace(cfg=cfg, data=build_configs(cfg)[0], plan=None, roles=_roles(T),
                          positions=torch.full((T, W), 1000, dtype=torch.int64),
                          share_positions=torch.zeros(T, W + 1, dtype=torch.int64))
    job.positions[2] = 300
    first = record_change(m.store, "lost", 2, pid=1, signal="SIGKILL")
    record_change(m.store, "joined", 2, pid=2, restart=1)
    if got_back:
        assert m.claim_rows(first, "join") == "join"
        job.positions[2] = 700  # the restart read 400 more
    record_change(m.store, "lost", 2, pid=2, signal="SIGKILL")
    rows = 0
    for t in (0, 1):
        m.store.set(f"agree/phase1/{t}", "0")
    for t in (0, 1):
        got = Recovery(job, m, t).takeover()
        assert got is not None
        rows += sum(r for shard in got.source.plan for _, _, r in shard) // 2  # (each sees every part)
    assert rows == 1000 - (700 if got_back else 300)


def test_a_command_is_the_first_value_set_and_a_rank_whose_giver_may_be_lost_can_set_the_fallback():
    """Every rank counts the job's commands alike and gets the same one: a waiting rank that gives up (its giver, a
    trainer, may be lost) sets the fallback, and a giver that comes later gets that back, not its own."""
    from cocosync.shadowsync.job.link import Link

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    leader, waiter, server = (Link(store.port, rank) for rank in (1, 2, 0))
    assert leader.command({"name": "checkpoint"}) == {"name": "checkpoint"}  # command 0: given
    assert waiter.command(None, fallback={"name": "skip"}, give_up=lambda: True) == {"name": "checkpoint"}
    assert server.command(None) == {"name": "checkpoint"}
    assert waiter.command(None, fallback={"name": "skip"}, give_up=lambda: True) == {"name": "skip"}  # command 1
    assert leader.command({"name": "checkpoint"}) == {"name": "skip"}  # (it came after the fallback)
    assert server.command(None) == {"name": "skip"}
    late = threading.Timer(0.3, lambda: leader.command({"name": "end"}))  # command 2: waited for, not given up
    late.start()
    assert waiter.command(None, fallback={"name": "skip"}, give_up=lambda: False) == {"name": "end"}
    late.join()
