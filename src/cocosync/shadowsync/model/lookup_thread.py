"""What the trainers' tables see of a lookup transport that runs in a background thread of its own (the exchange's
rounds, a trainer's relay to its node's exchange): pushes counted until applied, `flush`, `close`, and the error that
every waiting worker gets when the transport breaks."""

from __future__ import annotations

import threading

from cocosync.shadowsync.model.transport import TransportCounters
from cocosync.shadowsync.thread_cpu import in_role

__all__ = ["ExchangeLost", "TransportClosed", "LookupThread"]


class ExchangeLost(RuntimeError):
    """The exchange with the other nodes broke (a peer died or its machine is unreachable); the message names them."""


class TransportClosed(RuntimeError):
    """A lookup or push came to a transport that is closing (the job's end, or a transport replaced while a worker
    held it: `ShardedEmbeddings.adopt`)."""


class LookupThread:
    """Subclasses implement `_run` (the thread) and call `_start(name, role)` once their state is set (`role`: its
    CPU's in the job summary, thread_cpu.py) and keep the counters below."""

    n: int  # the nodes it talks to, itself included
    rounds: int
    bytes_sent: int
    cpu_s: float

    def _start(self, name: str, role: str) -> None:
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._pushes_queued = self._pushes_answered = 0
        self._closing = False
        self._error: Exception | None = None
        self._thread = threading.Thread(target=in_role(role, self._run), name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        raise NotImplementedError

    def counters(self) -> TransportCounters:
        """What this transport sent to the other nodes."""
        return TransportCounters(rounds=self.rounds, messages=self.rounds * (self.n - 1), wire_bytes=self.bytes_sent,
                                 cpu_s=self.cpu_s)

    @property
    def failed(self) -> bool:
        """Whether this transport broke (a peer was lost: every lookup it held failed with the reason)."""
        return self._error is not None

    def _check(self) -> None:
        """Under the lock, before queueing: the transport's error, or its end."""
        if self._error is not None:
            raise self._error
        if self._closing:
            raise TransportClosed("the lookup exchange is closed")

    def flush(self) -> None:
        """Wait until every push queued so far is applied on its server."""
        with self._cv:
            target = self._pushes_queued
            while self._pushes_answered < target and self._error is None:
                self._cv.wait(1.0)
            if self._error is not None:
                raise self._error

    def close(self) -> None:
        """No more lookups from this trainer: the thread finishes what it owes (an exchange: serves its peers until
        every one of them is done too), then stops."""
        with self._lock:
            self._closing = True
        self._thread.join()
        if self._error is not None:
            raise self._error
