"""The native module's build: a killed build stalls nobody (the kernel releases its lock; the torch build lock it
left is removed at once), a live build is waited for naming its pid, and two checkouts of the same sources share
one build (its name is a hash of what it depends on, its sources compiled from the build's own copy)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cocosync.runtime.comm import native
from cocosync.runtime.comm.native import build_lock, build_name

HOLD = """
import sys, time
from pathlib import Path
from cocosync.runtime.comm.native import build_lock
with build_lock(Path(sys.argv[1])):
    (Path(sys.argv[1]) / "lock").write_text("")  # torch's build lock, as a build in progress holds it
    print("holding", flush=True)
    time.sleep(60)
"""


def _holder(build: Path) -> subprocess.Popen:
    build.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(build)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "holding"
    return p


def test_a_killed_build_stalls_nobody(tmp_path):
    build = tmp_path / "cocosync_native_x"
    holder = _holder(build)
    os.kill(holder.pid, signal.SIGKILL)  # killed mid-build: its torch lock file stays behind
    holder.wait()
    assert (build / "lock").exists()
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="left by a build that was killed"):
        with build_lock(build):
            assert not (build / "lock").exists()
    assert time.monotonic() - t0 < 2.0  # at once (it waited 300 s for a stale lock before)


def test_a_live_build_is_waited_for_naming_its_pid(tmp_path, capfd):
    build = tmp_path / "cocosync_native_y"
    holder = _holder(build)
    threading.Timer(0.5, holder.kill).start()  # the other build ends (here: its process exits)
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning):
        with build_lock(build, say_after=0.1):
            pass
    holder.wait()
    assert time.monotonic() - t0 >= 0.4
    assert f"waiting for another process's build of the native module (pid {holder.pid}" in capfd.readouterr().err


def test_the_build_is_named_by_its_sources_not_their_place(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, text in ((a, "int f() { return 1; }"), (b, "int f() { return 1; }")):
        d.mkdir()
        (d / "one.cpp").write_text(text)
    assert build_name([a / "one.cpp"]) == build_name([b / "one.cpp"])  # another checkout, the same sources
    (b / "one.cpp").write_text("int f() { return 2; }")
    assert build_name([a / "one.cpp"]) != build_name([b / "one.cpp"])
    assert build_name().startswith("cocosync_native_")


@pytest.mark.skipif(not native.enabled(), reason="the native module is turned off")
def test_a_job_loads_the_module_at_once_past_a_killed_builds_lock():
    """The real build directory with a killed build's lock file in it: loading the (built) module takes seconds."""
    if native.one_shot() is None:
        pytest.skip("the native module does not build here")
    _, build = native._build_dir()
    (build / "lock").write_text("")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", "from cocosync.runtime.comm.native import one_shot; "
                           "assert one_shot() is not None"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert time.monotonic() - t0 < 60 and not (build / "lock").exists()
