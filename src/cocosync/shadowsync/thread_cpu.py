"""CPU time of a process's threads by role: where a ShadowSync process spends its CPU (the workers, the lookup
exchange, the hot rows' sync, the shadow sync, gloo's I/O threads, the main thread).

The job's threads run their target through `in_role(role, fn)`, which gives the OS thread the name `cs-<role>`
(Linux: `top -H`, py-spy and /proc show it; Python 3.12 names no OS thread) and, when the target returns, records
the thread's CPU time, so a role keeps the CPU of its threads that have ended. `role_cpu_since(before)` sums, per
role, the CPU of every thread since a `snapshot()`: live threads from /proc/self/task by name,
ended ones from their record. Threads a role's thread starts inherit its OS name (torch's intra-op workers started
by a worker count as the worker's), gloo's threads carry gloo's names. What no thread accounts for is the process's
`rest` (short-lived threads, CPU before the snapshot of threads started after it): the summary reports it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import time
from collections import Counter
from functools import wraps
from pathlib import Path
from typing import Any, Callable, NamedTuple

__all__ = ["in_role", "snapshot", "role_cpu_since", "native_thread_cpu", "role_of", "Snapshot", "GLOO_THREADS",
           "PREFIX"]

PREFIX = "cs-"
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # torch's gloo process-group workers, gloo's socket loop
_PR_SET_NAME = 15

_lock = threading.Lock()
_ended: list[tuple[int, str, float]] = []  # (thread id, role, its CPU seconds at its end)


def native_thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds of each live thread of this process by thread id, with its OS name (/proc/self/task; {} where
    there is none)."""
    out: dict[int, tuple[str, float]] = {}
    try:
        tick = os.sysconf("SC_CLK_TCK")
        tasks = os.listdir("/proc/self/task")
    except (OSError, ValueError, AttributeError):
        return out
    for tid in tasks:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on: utime, stime are fields 14, 15
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _name_os_thread(name: str) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the thread keeps its name, its CPU counts as the rest
        pass


def in_role(role: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as a thread target that runs in `role` (a short name, no digits at its end: 'worker', 'exchange')."""
    if not role or role[-1].isdigit() or len(PREFIX + role) > 15:
        raise ValueError(f"thread role {role!r}: expected a name of 1-{15 - len(PREFIX)} characters that does not end "
                         "in a digit (Linux keeps 15 characters of a thread's name)")

    @wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        _name_os_thread(PREFIX + role)
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _ended.append((threading.get_native_id(), role, time.thread_time()))

    return run


def role_of(name: str, *, main: bool = False) -> str:
    """The role of a thread with OS name `name` (`main`: the process's main thread)."""
    if main:
        return "main"
    if name.startswith(PREFIX):
        return name[len(PREFIX):].rstrip("0123456789") or "other"
    return "gloo" if name in GLOO_THREADS else "other"


class Snapshot(NamedTuple):
    threads: dict[int, tuple[str, float]]  # native_thread_cpu()
    ended: int  # threads that had ended through `in_role`


def snapshot() -> Snapshot:
    """The point `role_cpu_since` counts from."""
    with _lock:
        ended = len(_ended)
    return Snapshot(native_thread_cpu(), ended)


def role_cpu_since(before: Snapshot) -> dict[str, float]:
    """CPU seconds per role of this process's threads since `before`: live threads by their OS names, threads that
    ran through `in_role` and ended since by their record."""
    now = native_thread_cpu()
    out: Counter = Counter()
    main = os.getpid()
    for tid, (name, cpu) in now.items():
        out[role_of(name, main=tid == main)] += cpu - before.threads.get(tid, (name, 0.0))[1]
    with _lock:
        ended = [e for e in _ended[before.ended:] if e[0] not in now]  # a live thread may reuse an ended one's id
    for tid, role, cpu in ended:
        out[role] += cpu - before.threads.get(tid, ("", 0.0))[1]
    return {role: max(0.0, s) for role, s in out.items()}
