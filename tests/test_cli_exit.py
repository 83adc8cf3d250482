"""The `cocosync` command's exit (cli.run): the status Python would give, the exit hooks and the threads still
running are honoured, and everything written reaches its reader; only the interpreter's teardown is skipped."""

import os
import subprocess
import sys
import textwrap

import pytest

_COMMAND = textwrap.dedent("""
    import atexit, os, sys, threading, time
    mark = os.environ["MARK"]
    atexit.register(lambda: open(mark + ".hook", "w").close())
    threading.Thread(target=lambda: (time.sleep(0.5), open(mark + ".thread", "w").close())).start()  # not a daemon
    sys.stdout.write("buffered, not flushed")
    sys.argv = ["cocosync", *sys.argv[1:]]
    from cocosync.cli import run
    run()
    print("not reached: run() exits")
""")


@pytest.mark.parametrize(("args", "status", "stderr"), [
    (["--version"], 0, ""),
    (["train", "--batch-size", "0"], 2, "batch_size=0 is invalid"),  # a usage error: click's status and its message
    (["no-such-command"], 2, "No such command"),
])
def test_the_command_exits_with_its_status_after_its_hooks_and_threads(tmp_path, args, status, stderr):
    mark = tmp_path / "mark"
    proc = subprocess.run([sys.executable, "-c", _COMMAND, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MARK": str(mark)})
    assert proc.returncode == status, proc.stderr[-3000:]
    assert stderr in proc.stderr
    assert proc.stdout.startswith("buffered, not flushed") and "not reached" not in proc.stdout
    assert (tmp_path / "mark.hook").exists() and (tmp_path / "mark.thread").exists()


def test_a_message_given_to_sys_exit_is_printed_with_status_1(tmp_path):
    code = ("import sys, cocosync.cli as c\n"
            "c.main = lambda: sys.exit('stopped: a reason')\n"
            "c.run()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr.strip()) == (1, "stopped: a reason")
