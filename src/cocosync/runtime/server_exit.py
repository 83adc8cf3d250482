"""Imported by the warm fork server only (the first of warm_start.WARM_MODULES): when its launcher exits, the server
leaves without the interpreter's teardown.

The server holds nothing to flush or release, and tearing down torch's modules cost it ~0.8 s of CPU at every exit,
with the launcher's stdout and stderr still open: a caller reading the command's output to its end (a test, a pipe)
waited for it after the command had finished. Its ranks never run this hook: a forked child leaves through os._exit.

A server that the `cocosync` command started before its own imports (cocosync_start) dies with the command at once:
where the command stops at its checks, no rank is forked from it, and it would otherwise import for seconds more.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys

from cocosync_start import EARLY_ENV


def _die_with_launcher(launcher: int) -> None:
    """SIGKILL this server when its launcher's main thread (which started it) ends, even in the middle of its imports
    (Linux's parent-death signal; elsewhere it leaves after its imports, as below)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher:  # (it ended before the prctl)
        os._exit(0)


if sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules:  # the server's own `python -c` (not a rank)
    # exit hooks run last-registered first: the preloaded modules' run before this one; multiprocessing's own,
    # registered before it, is skipped (it finalizes child Process objects, and the server has none)
    atexit.register(os._exit, 0)
    if os.environ.get(EARLY_ENV, "").isdigit():
        _die_with_launcher(int(os.environ[EARLY_ENV]))
