"""A killed native build leaves torch's build lock behind, on which every later process would wait forever: the
loader waits for a live build and removes a stale lock with a warning (runtime/comm/native)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from cocosync.runtime.comm.native import clear_stale_lock


def test_no_lock_no_wait(tmp_path):
    assert clear_stale_lock(tmp_path / "lock") is False


def test_a_stale_lock_is_removed_with_a_warning(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match=r"stale build lock .*lock \(3\d\d\d s old"):
        assert clear_stale_lock(lock, stale_after=300) is True
    assert not lock.exists()


def test_a_live_build_is_waited_for_and_its_lock_left_alone(tmp_path, capfd):
    lock = tmp_path / "lock"
    lock.write_text("")
    timer = threading.Timer(0.3, lock.unlink)  # the other process's build finishes
    timer.start()
    t0 = time.monotonic()
    assert clear_stale_lock(lock, stale_after=60, poll=0.02, say_after=0.1) is False
    assert time.monotonic() - t0 >= 0.25
    assert "waiting for another process's build" in capfd.readouterr().err


def test_a_brief_lock_is_waited_for_silently(tmp_path, capfd):
    """torch holds the lock for every load's version check too: a short wait says nothing."""
    lock = tmp_path / "lock"
    lock.write_text("")
    timer = threading.Timer(0.1, lock.unlink)
    timer.start()
    assert clear_stale_lock(lock, stale_after=60, poll=0.02, say_after=2.0) is False
    assert "waiting" not in capfd.readouterr().err


def test_a_lock_that_grows_stale_while_waited_on_is_removed(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")
    with pytest.warns(RuntimeWarning, match="stale build lock"):
        assert clear_stale_lock(lock, stale_after=0.2, poll=0.02) is True
    assert not lock.exists()
