"""The warm fork server's start, importable before torch (this package imports nothing but the standard library).

Every rank of `cocosync train` is forked from one fork server per launcher, which imports torch and the ranks' code
once (cocosync/runtime/warm_start.py says why). The `cocosync` command starts that server before it imports cocosync
itself (`cocosync_start.__main__`): importing cocosync imports torch (~1.5 s of CPU), and the server's own imports
(~3 s) then run beside the launcher's instead of after them. Inside the `cocosync` package, importing anything
imports torch first, so the start lives here.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from multiprocessing import forkserver

__all__ = ["WARM_MODULES", "WARM_START_ENV", "EARLY_ENV", "context", "start", "warm", "starts_ranks"]

#: imported once by the fork server: torch, and what a rank of `cocosync train` imports (the pools' ranks import less)
WARM_MODULES = ("cocosync.runtime.server_exit", "torch", "torch.distributed", "numpy", "cocosync.shadowsync.job.rank",
                "cocosync.shadowsync.job.rank_start", "torch.distributed.checkpoint", "matplotlib.pyplot")
#: "0": every rank is a fresh `python -m cocosync.shadowsync` that imports torch itself (no fork server)
WARM_START_ENV = "COCOSYNC_WARM_START"
#: the launcher's pid, in the environment of a server started before its launcher imported cocosync: that server dies
#: with the launcher's main thread at once, not after its imports (runtime/server_exit.py), since a command refused at
#: its checks never forks a rank from it
EARLY_ENV = "COCOSYNC_EARLY_SERVER"
#: the subcommands that start ranks on this machine
_STARTS_RANKS = ("train", "demo")


def context() -> multiprocessing.context.BaseContext:
    """multiprocessing's fork-server context, its server preloading WARM_MODULES (set before the server starts; a server
    already running keeps its list)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(WARM_MODULES))
    return ctx


def start() -> None:
    """Start the fork server now, so that it imports while this process does other work (its first child waits for
    the imports). Idempotent: one server per process."""
    context()
    forkserver.ensure_running()


def warm() -> bool:
    """Whether ranks fork from the warm server (`COCOSYNC_WARM_START` is not "0")."""
    return os.environ.get(WARM_START_ENV, "1") != "0"


def starts_ranks(args: Sequence[str]) -> bool:
    """Whether the `cocosync` command line `args` (without the program) starts ranks on this machine at once: `train`
    or `demo`, not asking for help, on one machine. A machine of a multi-machine job (`--nnodes`) starts its server
    while it waits for the others (job/node_launch.py), and may find a running job to join, whose ranks it forks
    itself: there the server's imports would only take CPU from the launcher's (on a machine still training, its
    decision took 2.5-3.5x as long)."""
    words = [a for a in args if a != "--debug"]
    flags = {a.split("=", 1)[0] for a in args}
    return bool(words) and words[0] in _STARTS_RANKS and not {"-h", "--help", "--nnodes"} & flags
