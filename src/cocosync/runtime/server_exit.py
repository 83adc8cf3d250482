"""Imported by the warm fork server only (the first of warm_start.WARM_MODULES): when its launcher exits, the server
leaves without the interpreter's teardown.

The server holds nothing to flush or release, and tearing down torch's modules cost it ~0.8 s of CPU at every exit,
with the launcher's stdout and stderr still open: a caller reading the command's output to its end (a test, a pipe)
waited for it after the command had finished. Its ranks never run this hook: a forked child leaves through os._exit.
"""

from __future__ import annotations

import atexit
import os
import sys

if sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules:  # the server's own `python -c` (not a rank)
    # exit hooks run last-registered first: the preloaded modules' run before this one; multiprocessing's own,
    # registered before it, is skipped (it finalizes child Process objects, and the server has none)
    atexit.register(os._exit, 0)
