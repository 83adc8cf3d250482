"""Shadow mode: a background thread per trainer that calls `algorithm.sync()` in a loop while the workers train.

The workers never wait for it: the thread reads a snapshot of the dense buffer, synchronizes (all_reduce or
the EASGD center), and adds the resulting delta back, lock-free. torch ops release the GIL, and `interval`
seconds of sleep between syncs bound its share of the CPU. The loop ends when `sync()` reports no active
trainer (collectives: every trainer has finished; local algorithms: this one has).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from cocosync.shadowsync.sync.base import SyncAlgorithm

__all__ = ["ShadowThread"]


class ShadowThread:
    """Runs `algorithm.sync(active=is_active())` every `interval` seconds in a daemon thread.

    `iterations()` returns the trainer's worker-iteration count (for the sync gap). `error` holds the
    exception that stopped the loop, if any; `join()` re-raises nothing, the trainer checks `error`.
    """

    def __init__(self, algorithm: SyncAlgorithm, *, interval: float, is_active: Callable[[], bool],
                 iterations: Callable[[], int] = lambda: 0, name: str = "shadow-sync"):
        self.algorithm, self.interval = algorithm, interval
        self._is_active, self._iterations = is_active, iterations
        self.error: BaseException | None = None
        self.active_syncs = 0  # syncs that started while this trainer was still training
        self.sync_seconds = 0.0
        self.gate = threading.Lock()  # held during each round: a checkpoint reads a state between two rounds
        self._abort = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> "ShadowThread":
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while not self._abort.is_set():
                active = self._is_active()
                t0 = time.perf_counter()
                with self.gate:
                    n_active = self.algorithm.sync(active)
                self.sync_seconds += time.perf_counter() - t0
                if active:
                    self.active_syncs += 1
                if n_active == 0:
                    return
                if active and self.interval > 0:
                    self._abort.wait(self.interval)
        except BaseException as e:  # surfaced by the trainer, which owns the error report
            self.error = e

    def abort(self) -> None:
        """Stop after the current sync (used on errors; a clean finish ends through the active flag)."""
        self._abort.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the loop to end; True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
