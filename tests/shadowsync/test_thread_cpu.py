"""CPU by thread role (shadowsync/thread_cpu.py): OS names, live and ended threads, gloo's by name."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from cocosync.shadowsync import thread_cpu
from cocosync.shadowsync.job.summary import thread_cpu_by_kind

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def _spin(seconds: float, stop: threading.Event | None = None) -> None:
    """Burn `seconds` of this thread's CPU (or until `stop`)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end and not (stop is not None and stop.is_set()):
        sum(range(10_000))


@linux
def test_roles_count_live_and_ended_threads_by_name():
    before = thread_cpu.snapshot()
    ended = threading.Thread(target=thread_cpu.in_role("ended-role", _spin), args=(0.3,))
    ended.start()
    ended.join(30)
    stop, named = threading.Event(), threading.Event()

    def live():
        named.set()
        _spin(60, stop)

    t = threading.Thread(target=thread_cpu.in_role("live-role", live))
    t.start()
    try:
        assert named.wait(10)
        deadline = time.time() + 20
        while time.time() < deadline and thread_cpu.native_thread_cpu()[t.native_id][1] < 0.2:
            time.sleep(0.02)
        name, cpu = thread_cpu.native_thread_cpu()[t.native_id]
        assert name == "cs-live-role" and cpu >= 0.2  # top -H and py-spy see the role
        roles = thread_cpu.role_cpu_since(before)
    finally:
        stop.set()
        t.join(30)
    assert not ended.is_alive() and not t.is_alive()
    # the ended thread's CPU from its record (its /proc entry is gone), the live one's from /proc (10 ms ticks)
    assert 0.3 <= roles["ended-role"] < 1.5
    assert roles["live-role"] >= 0.15
    assert roles.get("gloo", 0.0) < 0.05  # nothing here ran gloo work
    assert "main" in roles
    # a later snapshot does not count the ended thread again
    assert thread_cpu.role_cpu_since(thread_cpu.snapshot()).get("ended-role", 0.0) == 0.0


def test_role_names_and_errors():
    assert thread_cpu.role_of("cs-worker3") == "worker"
    assert thread_cpu.role_of("cs-hot-sync") == "hot-sync"
    assert thread_cpu.role_of("gloo_tcp_loop") == "gloo" and thread_cpu.role_of("pt_gloo_runloop") == "gloo"
    assert thread_cpu.role_of("python") == "other" and thread_cpu.role_of("python", main=True) == "main"
    with pytest.raises(ValueError, match="'worker0'"):
        thread_cpu.in_role("worker0", print)  # the digits are the thread's index, not its role
    with pytest.raises(ValueError, match="'a-very-long-role'"):
        thread_cpu.in_role("a-very-long-role", print)  # its OS name would be cut, and read back as another role


def test_cpu_by_kind_adds_up_to_every_rank():
    cpu = [("trainer", 10.0, {"worker": 7.0, "gloo": 1.0}, None), ("trainer", 9.0, {"worker": 6.5}, None),
           ("server", 2.0, {"main": 1.5, "gloo": 0.25}, {"rounds": 3})]
    got = thread_cpu_by_kind(cpu)
    assert got == {"trainer/worker": 13.5, "trainer/rest": 4.5, "server/main": 1.5, "trainer/gloo": 1.0,
                   "server/rest": 0.25, "server/gloo": 0.25}
    assert list(got)[0] == "trainer/worker"  # largest first
    assert sum(got.values()) == pytest.approx(21.0)
