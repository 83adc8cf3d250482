"""The line between the ranks of a ShadowSync job and the `cocosync train` process that launched them.

`cocosync train` on one machine starts the job's ranks through torch's elastic agent on a rendezvous store it owns
(loopback only, launch.py) and names that store's port in COCOSYNC_MONITOR_PORT. Over a client of the same store,
under the prefix `cocosync/`, every rank publishes its pid, each trainer its heartbeat and progress, a failing rank
its message; the launcher sets `stop` (Ctrl-C, --timeout), which every trainer polls. Across machines
(`cocosync train --nnodes`, node_launch.py) the store is the job's rendezvous store (COCOSYNC_MONITOR_HOST names its
host), and any machine's launcher sets `stop` there (its value: why) on Ctrl-C, SIGTERM or --timeout. Under plain
torchrun (no launcher) there is no link: `Link.from_env()` is None and the job runs as before.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from cocosync.runtime.comm.shm import unlink_pending
from cocosync.shadowsync.thread_cpu import in_role

__all__ = ["Link", "store_client", "env_store_client", "job_prefix", "MONITOR_PORT_ENV", "MONITOR_HOST_ENV", "PREFIX",
           "SECRET_ENV", "FIRST_FAILURE", "report_failure"]

MONITOR_PORT_ENV = "COCOSYNC_MONITOR_PORT"
MONITOR_HOST_ENV = "COCOSYNC_MONITOR_HOST"  # (unset: 127.0.0.1, the one-machine launcher's store)
PREFIX = "cocosync/"
#: a local run's secret (set by its launcher, in its ranks' environment): the job's keys live under PREFIX + it, so a
#: process that reaches the store's port but cannot read the ranks' environment (another user) cannot write them
SECRET_ENV = "COCOSYNC_JOB_SECRET"
FIRST_FAILURE = "first-failure"  # {"rank", "time", "message"} of the job's first rank to fail (set once)


def report_failure(store: Any, rank: int, message: str) -> None:
    """Record why `rank` failed: under failed/<rank>, and as the job's first failure unless one was recorded (so
    every machine's launcher can name the cause, not only the failures it caused)."""
    rec = json.dumps({"rank": rank, "time": time.time(), "message": message})
    store.set(f"failed/{rank}", rec)
    store.compare_set(FIRST_FAILURE, "", rec)  # (sets it only where it is not set)


def leave_fenced(trainer: int) -> None:
    """Trainer `trainer` was recorded as lost while it still ran (its machine fell silent and the job went on without
    it): leave at once (exit status 1), reporting nothing, so that it never trains beside the trainers that took its
    place."""
    print(f"trainer {trainer}: this machine was recorded as lost (the job went on without it): leaving",
          file=sys.stderr, flush=True)
    unlink_pending()
    os._exit(1)


def job_prefix(secret: str | None = None) -> str:
    """The prefix of the job's keys in its store: PREFIX, then the run's secret where it has one (default: the one
    SECRET_ENV names)."""
    secret = os.environ.get(SECRET_ENV, "") if secret is None else secret
    return f"{PREFIX}{secret}/" if secret else PREFIX


def store_client(host: str, port: int) -> Any:
    """A client of the launcher's store, under the job's prefix."""
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))
    return dist.PrefixStore(job_prefix(), store)


def env_store_client() -> Any:
    """`store_client` of the store the environment names (a rank's launcher's)."""
    return store_client(os.environ.get(MONITOR_HOST_ENV, "127.0.0.1"), int(os.environ[MONITOR_PORT_ENV]))


def get_if_set(store: Any, key: str) -> bytes | None:
    """The value of `key`, or None when nobody has set it (a plain `get` would wait for it)."""
    return store.get(key) if store.check([key]) else None


class Link:
    """A rank's client of the launcher's store (see the module doc)."""

    def __init__(self, port: int, rank: int, host: str = "127.0.0.1"):
        self.host, self.port = host, port
        self.store = self.client()
        self.rank = rank
        self._commands = 0
        self._lock = threading.Lock()  # the store client is shared by the heartbeat thread and the trainer
        self._closed = threading.Event()
        self._beats: threading.Thread | None = None
        self.store.set(f"pid/{rank}", str(os.getpid()))

    def client(self) -> Any:
        """A client of the launcher's store of its own (under the job's prefix), for a thread that is not the
        heartbeat's and the trainer's."""
        return store_client(self.host, self.port)

    def command(self, value: Any | None, *, fallback: Any | None = None, give_up: Callable[[], bool] | None = None,
                poll: float = 0.02) -> Any:
        """The job's next command: `value` from the rank that gives it (set under the command's number), else
        waited for (every rank counts the commands alike). Through the store, which outlives every rank: a lost
        trainer does not break it as it would a collective. A waiting rank for which `give_up()` turns true (its
        giver may be lost) sets `fallback` instead. The first value set is the command, for every rank: a giver
        that comes later gets that one back too."""
        key = f"command/{self._commands}"
        self._commands += 1
        if value is not None:
            return self._first(key, value)
        while True:
            with self._lock:
                raw = get_if_set(self.store, key)
            if raw is not None:
                return json.loads(raw)
            if fallback is not None and give_up is not None and give_up():
                return self._first(key, fallback)
            time.sleep(poll)

    def _first(self, key: str, value: Any) -> Any:
        """Set `key` to `value` unless it is set already; the value it holds."""
        with self._lock:
            return json.loads(self.store.compare_set(key, "", json.dumps(value, default=str)))

    @classmethod
    def from_env(cls, rank: int) -> "Link | None":
        port = os.environ.get(MONITOR_PORT_ENV)
        return cls(int(port), rank, os.environ.get(MONITOR_HOST_ENV, "127.0.0.1")) if port else None

    def set(self, key: str, value: Any) -> None:
        with self._lock:
            self.store.set(key, json.dumps(value, default=str))

    def get_all(self, keys: list[str]) -> list[Any]:
        """The values of those of `keys` that are set, decoded (in `keys` order)."""
        with self._lock:
            raw = [self.store.get(k) for k in keys if self.store.check([k])]
        return [json.loads(r) for r in raw]

    def beat(self, trainer: int, stop: Any, interval: float, positions: Any = None, share_positions: Any = None,
             lost_key: str | None = None) -> None:
        """Start the heartbeat thread of trainer `trainer`: it runs whatever the trainer does (torch ops and gloo
        release the GIL), so a missing beat means the process is stopped, hung or not scheduled; it also copies the
        launcher's stop request into `stop[0]` (the workers' flag), and publishes `positions` (the trainer's reader
        positions, int64 [W]) under pos/<trainer> where the trainers of another machine read them if this one's is
        lost, and `share_positions` (int64 [W + 1]: the agreement whose share of lost trainers' rows it reads, and its
        positions there) under share-pos/<trainer>. Once `lost_key` is set (this machine was recorded as lost: the
        job went on without it) the process leaves at once (exit status 1), so that it never trains beside the machine
        that took its place."""
        def run() -> None:
            while not self._closed.is_set():
                with self._lock:
                    # CLOCK_MONOTONIC is system-wide: the launcher compares it with its own
                    self.store.set(f"beat/{trainer}", repr(time.monotonic()))
                    if positions is not None:
                        self.store.set(f"pos/{trainer}", json.dumps(positions.tolist()))
                    if share_positions is not None:
                        self.store.set(f"share-pos/{trainer}", json.dumps(share_positions.tolist()))
                    stopping = self.store.check(["stop"])
                    fenced = lost_key is not None and self.store.check([lost_key])
                if fenced:
                    leave_fenced(trainer)
                if stopping:
                    stop[0] = 1
                self._closed.wait(interval)

        self._beats = threading.Thread(target=in_role("heartbeat", run), name="cocosync-heartbeat", daemon=True)
        self._beats.start()

    def finish(self, trainer: int) -> None:
        """This trainer is done: no more beats (the monitor skips a trainer whose beat says 'done'; best effort: a
        rendezvous store across machines may already be gone)."""
        self._closed.set()
        if self._beats is not None:
            self._beats.join()
        try:
            with self._lock:
                self.store.set(f"beat/{trainer}", "done")
        except Exception:  # noqa: BLE001 - the job's work is done
            pass

    def failed(self, message: str) -> None:
        """Tell the launcher why this rank is leaving (best effort: the store may be gone)."""
        try:
            with self._lock:
                report_failure(self.store, self.rank, message)
        except Exception:  # noqa: BLE001 - the launcher reads torchrun's exit status then
            pass
