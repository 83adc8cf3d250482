"""The launcher's monitor as one machine of a multi-machine job (node_launch.py): it watches and kills only its own
ranks, reads the whole job's progress, and learns a stop another machine asked for, over a real store."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist
from rich.console import Console

from cocosync.shadowsync.config import ClusterConfig, TrainConfig
from cocosync.shadowsync.job.monitor import Monitor, exit_status


def _monitor(tmp_path, store, cluster: ClusterConfig | None = None, out: io.StringIO | None = None,
             **kw) -> Monitor:
    # 2 machines x 3 ranks (1 embedding server, 2 trainers each): this machine holds ranks 3-5, trainers 2 and 3
    cfg = TrainConfig(trainers=4, out_dir=str(tmp_path), heartbeat_timeout=2.0, progress=False)
    return Monitor(cfg, "job", store, 3, cluster or ClusterConfig(), Console(file=out or io.StringIO(), width=400),
                   nodes=2, ranks=[3, 4, 5], bar=False, tail=False, **kw)


def test_labels_number_the_roles_node_by_node(tmp_path):
    m = _monitor(tmp_path, dist.HashStore())
    assert [m.label(r) for r in (0, 1, 3, 5)] == [
        "embedding server 0 (rank 0, node 0)", "trainer 0 (rank 1, node 0)", "embedding server 1 (rank 3, node 1)",
        "trainer 3 (rank 5, node 1)"]
    assert [m.trainer_of(r) for r in range(6)] == [None, 0, 1, None, 2, 3]


@pytest.mark.faults
@pytest.mark.parametrize("transport", ["rpc", "exchange"])
def test_only_this_machines_trainers_are_watched_and_killed(tmp_path, transport):
    """A trainer of this machine silent past the heartbeat timeout: where the job cannot lose it alone (RPC lookups)
    the monitor fails the job naming it, and kills this machine's ranks only; with the lookup exchange (a lone
    trainer is survived across machines) it kills that trainer alone, whose keeper records the loss."""
    store = dist.HashStore()
    out = io.StringIO()
    m = _monitor(tmp_path, store, cluster=ClusterConfig(lookup_transport=transport), out=out)
    m.started -= 10  # launched 10 s ago: the backdated heartbeats below are this job's
    p = m.store
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        p.set("pid/1", str(sleepers[0].pid))  # another machine's trainer: its pid means nothing here
        p.set("pid/5", str(sleepers[1].pid))
        p.set("beat/0", repr(time.monotonic() - 100))  # another machine's clock: never compared with this one's
        p.set("beat/2", "done")
        p.set("beat/3", repr(time.monotonic()))
        assert m._stalled() is None and not m.trainers_done
        p.set("beat/3", repr(time.monotonic() - 5))
        why = "no heartbeat for 5s (--heartbeat-timeout 2s; the process is stopped, hung or not scheduled)"
        if transport == "rpc":
            assert m._stalled() == f"trainer 3 (pid {sleepers[1].pid}) stopped responding: {why}"
            m.kill_ranks()
        else:
            assert m._stalled() is None  # (killed: the job goes on without it)
            assert f"trainer 3 (pid {sleepers[1].pid}) stopped responding: {why}; killing it" in out.getvalue()
            assert not m.may_lose(2)  # (across machines, the job's first loss only)
        assert sleepers[1].wait(10) == -9
        assert sleepers[0].poll() is None
        p.set("beat/3", "done")
        assert m._stalled() is None and m.trainers_done
    finally:
        for s in sleepers:
            s.kill()
            s.wait()


def test_the_store_is_untrusted_no_planted_pid_is_signalled_and_no_planted_beat_fails_the_job(tmp_path):
    """Anyone who reaches the store can write it: a pid there is signalled only if this launcher started that
    process, and a heartbeat from before the launch, or not a number, is not a trainer's."""
    m = _monitor(tmp_path, dist.HashStore())
    p = m.store
    # an unrelated process (its parent exits at once: not this process's descendant)
    out = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
    stranger = int(out.stdout.strip())
    try:
        p.set("pid/5", str(stranger))
        p.set("pid/4", "not a pid")
        p.set("beat/3", "0")  # planted before the ranks start: 'no heartbeat for days'
        p.set("beat/2", "soon")
        assert m._stalled() is None  # no false failure
        m.kill_ranks()
        time.sleep(0.2)
        assert subprocess.run(["kill", "-0", str(stranger)]).returncode == 0  # still alive: never signalled
        assert m._pid(5) is None and m._pid(4) is None
        mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # what the agent starts
        p.set("pid/5", str(mine.pid))  # the real rank overwrites the planted pid
        assert m._pid(5) == mine.pid
        m.kill_ranks()
        assert mine.wait(10) == -9
    finally:
        subprocess.run(["kill", "-9", str(stranger)])


def test_progress_is_the_whole_jobs_and_a_stop_elsewhere_is_learnt(tmp_path):
    m = _monitor(tmp_path, dist.HashStore())
    for t, (n, ne) in enumerate([(100, 0.7), (200, 0.8), (300, None), (400, 0.9)]):
        m.store.set(f"progress/{t}", json.dumps({"trainer_examples": n, "trainer_eps": 10.0, "train_ne": ne}))
    examples, eps, ne = m._progress()
    assert (examples, eps) == (1000, 40.0) and abs(ne - 0.8) < 1e-12
    assert not m._check(time.monotonic()) and not m.interrupted
    m.store.set("stop", "SIGTERM")  # node 0's launcher took a SIGTERM
    assert not m._check(time.monotonic())
    assert m.interrupted and m.stop_reason == "SIGTERM" and exit_status(m.stop_reason) == 143


def test_exit_status_says_what_stopped_the_job():
    assert [exit_status(r) for r in ("SIGTERM", "Ctrl-C", "--timeout 20 s reached", None)] == [143, 130, 124, 130]


def test_once_its_trainers_are_done_the_monitor_leaves_the_store_but_a_second_signal_still_aborts(tmp_path):
    """After this machine's trainers said 'done' the store may leave with the agent that hosts it: the monitor stops
    reading it while the servers and the agent finish, and still takes a second Ctrl-C as an abort."""
    m = _monitor(tmp_path, dist.HashStore())
    for t in (2, 3):
        m.store.set(f"beat/{t}", "done")
    finished = threading.Event()
    agent = threading.Thread(target=finished.wait, args=(30,), daemon=True)  # an agent still closing the job
    agent.start()
    threading.Timer(1.0, lambda: setattr(m, "presses", 2)).start()
    t0 = time.monotonic()
    try:
        m.run(agent)
    finally:
        finished.set()
    assert m.trainers_done and m.failure == "aborted by a second Ctrl-C"
    assert time.monotonic() - t0 < 5


class _GoneStore(dist.Store):
    """A store (in Python, through torch's store trampoline) whose host leaves when told: every read then fails, as a
    TCPStore client's does (where c10d also logs a C++ stack trace)."""

    def __init__(self):
        super().__init__()
        self.data: dict[str, bytes] = {}
        self.reads = 0
        self.gone = False

    def set(self, key, value):
        self.data[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        self._read()
        return self.data[key]

    def check(self, keys):
        self._read()
        return all(k in self.data for k in keys)

    def _read(self):
        self.reads += 1
        if self.gone:
            raise RuntimeError("recvValue failed: connection closed")


def test_once_this_machines_ranks_have_exited_the_monitor_reads_the_store_no_more(tmp_path):
    """Across machines the agent that hosts the store leaves as soon as every agent passed torch's exit barrier,
    which this machine's agent reaches only after its ranks exited: a monitor that stops reading once its ranks are
    gone never reads a store that left (a job that succeeded printed c10d's stack trace for such a read)."""
    store = _GoneStore()
    m = _monitor(tmp_path, store)
    ranks = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in m.ranks]
    for rank, proc in zip(m.ranks, ranks):
        m.store.set(f"pid/{rank}", str(proc.pid))
    assert not m.ranks_exited() or all(p.poll() is not None for p in ranks)
    for p in ranks:
        p.wait()
    assert m.ranks_exited()
    store.gone, reads = True, store.reads
    assert reads > 0  # (the monitor's reads reach this store's check)
    finished = threading.Event()
    agent = threading.Thread(target=finished.wait, args=(30,), daemon=True)  # the agent in its exit barrier
    agent.start()
    threading.Timer(1.0, finished.set).start()
    m.run(agent)
    assert store.reads == reads and m.failure is None  # no read of the store that left


def test_a_rank_still_running_keeps_the_monitor_watching(tmp_path):
    m = _monitor(tmp_path, dist.HashStore())
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        m.store.set("pid/3", str(alive.pid))
        assert not m.ranks_exited()  # ranks 4 and 5 have not said their pids yet
        for rank in (4, 5):
            m.store.set(f"pid/{rank}", "999999999")  # (no such process)
        assert not m.ranks_exited()
        alive.kill()
        alive.wait()
        assert m.ranks_exited()
    finally:
        alive.kill()
        alive.wait()
