"""Ranks started warm: a fork server that imported torch once forks every rank this process starts on this machine.

A fresh Python process spends ~3.5-4.5 s of CPU importing torch and cocosync, more than a small job trains. The
ranks that `cocosync train` starts on one machine, and the test pools' ranks (testing/launch.py), come instead from
multiprocessing's fork server: a process started once (from a clean exec, so no thread of this one is forked) that
imports WARM_MODULES and then forks a child per rank, for every job this process launches. A fork is ~10 ms.

What a fork takes from the server rather than from its launcher is the environment (the server's is the launcher's
when the server started) and any state a preloaded module computed at import. So a rank is handed its launcher's
environment at launch time (`adopt_environment`), and preloaded modules read the environment when called, not at
import. A rank outlives no launcher (`die_with`): the server, its parent, lives as long as any of its children
does, so the kernel's parent-death signal that a cold rank asks for would not come when the launcher dies.

Unlike other multiprocessing children, ours do not run the launcher's main module again (`main_not_rerun`): a rank
needs nothing from it, a script that calls `run_training` needs no `if __name__ == "__main__"` guard, and a child
does not import what the main module imports (the `cocosync` command imports every subcommand).

The server leaves without the interpreter's teardown when its launcher exits (runtime/server_exit.py, preloaded
first): tearing torch's modules down cost ~0.8 s of CPU after every `cocosync train`, with the command's output
still open in the server. The `cocosync` command starts the server before it imports torch (the `cocosync_start`
package, where `WARM_MODULES`, `context` and `start` live, outside this package whose import imports torch).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from multiprocessing import spawn

from cocosync_start import WARM_MODULES, context, start, warm

__all__ = ["WARM_MODULES", "context", "start", "warm", "main_not_rerun", "adopt_environment", "die_with"]

_starts = threading.local()
_preparation_data = spawn.get_preparation_data


def _without_main(name: str) -> dict:
    data = _preparation_data(name)
    if getattr(_starts, "skip_main", False):
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
    return data


@contextmanager
def main_not_rerun() -> Iterator[None]:
    """Processes this thread starts in the block skip the step where a multiprocessing child imports its parent's
    main module again (their targets must live in importable modules, as ours do); other threads' are unchanged."""
    spawn.get_preparation_data = _without_main
    _starts.skip_main = True
    try:
        yield
    finally:
        _starts.skip_main = False


def adopt_environment(launcher_env: dict[str, str], rank_keys: Iterable[str] = ()) -> None:
    """In a forked rank: make os.environ its launcher's `launcher_env`, keeping the `rank_keys` already set here (the
    server's environment, inherited, may be an earlier job's)."""
    keep = {k: os.environ[k] for k in rank_keys if k in os.environ}
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(keep)


def die_with(pid: int) -> None:
    """In a forked rank: SIGKILL this process as soon as process `pid` (its launcher) exits, as PR_SET_PDEATHSIG does
    for a direct child (a daemon thread waiting on a pidfd; polling where there is none)."""
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):  # no pidfd_open (Linux < 5.3, other systems)
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while _exists(pid):
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="cocosync-launcher-watch", daemon=True).start()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True
