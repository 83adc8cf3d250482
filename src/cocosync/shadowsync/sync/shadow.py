"""Shadow mode: a background thread per trainer that calls `algorithm.sync()` in a loop while the workers train.

The workers never wait for it: the thread reads a snapshot of the dense buffer, synchronizes (all_reduce or
the EASGD center), and adds the resulting delta back, lock-free. torch ops release the GIL, and `interval`
seconds of sleep between syncs bound its share of the CPU. The loop ends when `sync()` reports no active
trainer (collectives: every trainer has finished; local algorithms: this one has).

A checkpoint of a collective algorithm needs every trainer's sync state from the same round: `paused()` asks for
a hold (a flag riding on the round's all-reduce); after the first round in which every trainer asked, every shadow
thread parks, so the states read then are from one round.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from cocosync.shadowsync.sync.base import SyncAlgorithm
from cocosync.shadowsync.thread_cpu import in_role

__all__ = ["ShadowThread"]


class ShadowThread:
    """Runs `algorithm.sync(active=is_active())` every `interval` seconds in a daemon thread.

    `iterations()` returns the trainer's worker-iteration count (for the sync gap). `error` holds the
    exception that stopped the loop, if any; `join()` re-raises nothing, the trainer checks `error`.
    """

    def __init__(self, algorithm: SyncAlgorithm, *, interval: float, is_active: Callable[[], bool],
                 iterations: Callable[[], int] = lambda: 0, name: str = "shadow-sync",
                 recover: Callable[[SyncAlgorithm], SyncAlgorithm | None] | None = None,
                 changed: Callable[[], bool] = lambda: False):
        """`recover(algorithm)`: called when a round raised, or before a round when `changed()` (the trainers in the
        job changed: one joined); the algorithm to go on with (the sync re-formed among the trainers in the job), or
        None to stop with the error (a changed sync is tried as it is: it raises if it cannot go on)."""
        self.algorithm, self.interval, self._recover, self._changed = algorithm, interval, recover, changed
        self._is_active, self._iterations = is_active, iterations
        self.error: BaseException | None = None
        self.active_syncs = 0  # syncs that started while this trainer was still training
        self.sync_seconds = 0.0
        self.gate = threading.Lock()  # held during each round: a checkpoint reads a state between two rounds
        self._abort = threading.Event()
        self._parked = threading.Event()
        self._thread = threading.Thread(target=in_role("shadow-sync", self._loop), name=name, daemon=True)

    def start(self) -> "ShadowThread":
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while not self._abort.is_set():
                active = self._is_active()
                if self._recover is not None and self._changed():
                    self.algorithm = self._recover(self.algorithm) or self.algorithm
                    continue  # (as after a failed round: every member asks `changed` before its new group's first)
                t0 = time.perf_counter()
                try:
                    with self.gate:
                        n_active = self.algorithm.sync(active)
                except Exception:
                    new = self._recover(self.algorithm) if self._recover is not None else None
                    if new is None:
                        raise
                    self.algorithm = new
                    continue
                self.sync_seconds += time.perf_counter() - t0
                if active:
                    self.active_syncs += 1
                if n_active == 0:
                    return
                if self.algorithm.collective and self.algorithm.holds == self.algorithm.group_size():
                    self._park()
                if active and self.interval > 0:
                    self._abort.wait(self.interval)
        except BaseException as e:  # surfaced by the trainer, which owns the error report
            self.error = e

    def _park(self) -> None:
        """Wait until this trainer's hold is lifted (paused() exits): every trainer asked for it in the last round."""
        self._parked.set()
        while self.algorithm.holding and not self._abort.wait(0.005):
            pass
        self._parked.clear()

    @contextlib.contextmanager
    def paused(self, give_up: Callable[[], bool] = lambda: False) -> Iterator[bool]:
        """Pause the loop between two rounds; for a collective algorithm, after a round every trainer paused at.
        Yields False (nothing paused) if `give_up()` turns true first (a peer will not come)."""
        if not self.algorithm.collective:
            with self.gate:
                yield True
            return
        self.algorithm.holding = True
        try:
            while not self._parked.wait(0.01):
                if not self._thread.is_alive():
                    break  # the loop has ended: nothing runs any more
                if give_up():
                    yield False
                    return
            yield True
        finally:
            self.algorithm.holding = False  # a parked loop (now or after the round in flight) goes on

    def abort(self) -> None:
        """Stop after the current sync (used on errors; a clean finish ends through the active flag)."""
        self._abort.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the loop to end; True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
