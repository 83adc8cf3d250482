"""One lookup exchange per node: a node's trainers hand their remote lookups and pushes to the node's first
embedding server through shared memory, and only that server talks to the other nodes (`--lookup-transport
node-exchange`).

With an exchange per trainer, every trainer of a node runs its own rounds: a node of Tn trainers sends Tn x (N - 1)
messages a round, each paying gloo's fixed cost (~450 us + ~130 us per peer of CPU in its threads, BENCHMARKS.md), and
the same cold row is looked up once per trainer that needs it. Here the node's first embedding server (a process
with no workers: on a machine with a core per process its core is otherwise idle) runs the node's one
`LookupExchange`, and each trainer owns a `Mailbox` in the node's shared memory:

- every poll (a quarter of the exchange interval) the trainer's relay thread writes what its workers queued
  (lookups, and pushes with their versions and gradients) into the next free slot of its request ring;
- at the start of each round the server takes every trainer's published slots as the round's parts (their rows
  deduplicated across the node's trainers by the round's sort);
- once a round has answered them, the server writes each trainer's rows, versions and pushes applied into the next
  free slots of its answer ring, which the trainer reads at its next poll.

Rings of `SLOTS` slots, so a trainer publishes at every poll of a round without waiting for the server to take the
last one (one slot made a part queued after the round's first poll wait a second round). A lookup waits ~half a poll
longer than with an exchange of its own; the node saves Tn - 1 exchanges a round and the trainers' processes run no
rounds. Each control word is written by one side only and counts up (x86 stores are not reordered with each other: a
slot is written before the count that publishes it, as shm.py's flags rely on); ClusterConfig refuses this transport
by name on other processors.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cocosync.shadowsync.model.lookup_thread import ExchangeLost, LookupThread

__all__ = ["Mailbox", "RelayClient", "RelayHost", "SLOTS", "mailbox_nbytes"]

# control words: request published / taken, answer published / taken, client closed, leader failed, leader rounds
_REQ, _REQ_TAKEN, _ANS, _ANS_TAKEN, _CLOSED, _FAILED, _BEAT = range(7)
_CONTROL = 8
SLOTS = 4  # slots of each ring: the client polls 4 times a round, the leader takes them all once a round


def mailbox_nbytes(rows: int, dim: int) -> int:
    """Bytes of one slot for `rows` rows a message (ids, versions and fp32 vectors) and up to 1024 parts."""
    return 64 + rows * (24 + 4 * dim) + 8 * 3 * 1024


@dataclass
class Mailbox:
    """A client's two rings of slots and its control words: views into the node's shared memory (or any memory two
    processes map)."""

    control: torch.Tensor  # int64 [_CONTROL]
    request: torch.Tensor  # uint8 [SLOTS, slot bytes]
    answer: torch.Tensor  # uint8 [SLOTS, slot bytes]

    def __post_init__(self) -> None:
        # the same memory through numpy: a scalar access ~20x cheaper than torch's, a small copy ~5x
        self.words = self.control.numpy()
        self.requests, self.answers = self.request.numpy(), self.answer.numpy()

    @classmethod
    def of(cls, buf: torch.Tensor, slot: int) -> Mailbox:
        """Carve a mailbox of `slot`-byte slots out of a uint8 buffer of `Mailbox.nbytes(slot)` bytes."""
        ring = SLOTS * slot
        return cls(buf[:8 * _CONTROL].view(torch.int64), buf[8 * _CONTROL:8 * _CONTROL + ring].view(SLOTS, slot),
                   buf[8 * _CONTROL + ring:8 * _CONTROL + 2 * ring].view(SLOTS, slot))

    @staticmethod
    def nbytes(slot: int) -> int:
        return 8 * _CONTROL + 2 * SLOTS * slot


def _write(region: np.ndarray, parts: list) -> int:
    """Arrays (numpy, int lists, or CPU tensors, which numpy views without a copy) one after another into the uint8
    `region` as bytes, each 8-aligned; the bytes used."""
    off = 0
    for a in parts:
        if isinstance(a, torch.Tensor):
            a = a.numpy()
        elif isinstance(a, list):
            a = np.array(a, dtype=np.int64)
        b = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        region[off:off + b.size] = b
        off += (b.size + 7) // 8 * 8
    return off


class _Reader:
    """Reads back what `_write` wrote, in order: `ints` as a list, `take` as a tensor of its own (a copy)."""

    def __init__(self, region: np.ndarray):
        self.region, self.off = region, 0

    def _next(self, n: int, dtype: type) -> np.ndarray:
        size = n * np.dtype(dtype).itemsize
        a = self.region[self.off:self.off + size].view(dtype)
        self.off += (size + 7) // 8 * 8
        return a

    def ints(self, n: int) -> list[int]:
        return self._next(n, np.int64).tolist()

    def take(self, n: int, dtype: torch.dtype, cols: int = 1) -> torch.Tensor:
        t = torch.from_numpy(self._next(n * cols, np.int64 if dtype == torch.int64 else np.float32).copy())
        return t.view(n, cols) if cols > 1 else t


class RelayClient(LookupThread):
    """A trainer's side: the `LookupExchange` interface the tables use (lookup, push, flush, take_stale, close and
    the counters), carried by the node's exchange (the `leader`: how errors name it); `timeout`: seconds without a
    round of the leader before the lookups fail."""

    def __init__(self, box: Mailbox, *, n: int, dim: int, interval: float, leader: str, timeout: float = 60.0):
        self.box, self.n, self.dim = box, int(n), int(dim)
        self.poll, self.leader, self.timeout = max(interval / SLOTS, 5e-4), leader, float(timeout)
        self.rounds = self.bytes_sent = 0  # this trainer sends nothing to other nodes: its leader does
        self.cpu_s = 0.0  # the relay thread's CPU (copies in and out of the mailbox)
        self.relayed_bytes = 0
        self._max_rows = (box.request.shape[1] - 64 - 24) // (16 + 4 * self.dim)  # of one part, as sized below
        self._queue: collections.deque = collections.deque()  # ('l', id, rows, future) | ('p', rows, versions, grads)
        self._futures: dict[int, torch.futures.Future] = {}
        self._next_id = 0
        self._start("cocosync-relay", "relay")

    def lookup(self, rows: torch.Tensor) -> torch.futures.Future:
        """A lookup larger than a slot (a snapshot of a whole shard) goes in slot-sized pieces, answered as one."""
        rows = rows.to(torch.int64)
        if rows.numel() > self._max_rows:
            pieces = [self.lookup(p) for p in rows.split(self._max_rows)]
            return torch.futures.collect_all(pieces).then(
                lambda f: tuple(torch.cat(t) for t in zip(*(p.wait() for p in f.wait()))))
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            self._check()
            self._queue.append(("l", self._next_id, rows, fut))
            self._futures[self._next_id] = fut
            self._next_id += 1
        return fut

    def push(self, rows: torch.Tensor, grads: torch.Tensor, versions: torch.Tensor) -> None:
        k = self._max_rows
        with self._lock:
            self._check()
            for i in range(0, max(rows.numel(), 1), k):
                self._queue.append(("p", rows[i:i + k].to(torch.int64), versions[i:i + k].to(torch.int64),
                                    grads[i:i + k].detach().to(torch.float32)))
                self._pushes_queued += 1

    def take_stale(self) -> int:
        return 0  # the leader counts the node's staleness (its peers answer it per request, not per part)

    def _run(self) -> None:
        c = self.box.words
        last_beat, beat_at = int(c[_BEAT]), time.monotonic()
        try:
            while True:
                time.sleep(self.poll)
                cpu0 = time.thread_time()
                if int(c[_FAILED]):
                    raise ExchangeLost(f"the node's lookup exchange on {self.leader} broke")
                beat = int(c[_BEAT])
                if beat != last_beat or not (self._queue or self._futures):  # (waiting for nothing: not late)
                    last_beat, beat_at = beat, time.monotonic()
                elif time.monotonic() - beat_at > self.timeout:
                    raise ExchangeLost(f"{self.leader}, which runs this node's lookup exchange, ran no round in "
                                     f"{self.timeout:g} s")
                for seq in range(int(c[_ANS_TAKEN]), int(c[_ANS])):
                    self._read_answer(self.box.answers[seq % SLOTS])
                    c[_ANS_TAKEN] = seq + 1
                if int(c[_REQ]) - int(c[_REQ_TAKEN]) < SLOTS:
                    self._send_request(self.box.requests[int(c[_REQ]) % SLOTS])
                with self._lock:
                    idle = (self._closing and not self._queue and not self._futures
                            and self._pushes_answered == self._pushes_queued and int(c[_REQ]) == int(c[_REQ_TAKEN]))
                self.cpu_s += time.thread_time() - cpu0
                if idle:
                    c[_CLOSED] = 1
                    return
        except BaseException as e:  # noqa: BLE001 - every waiting worker gets the reason
            err = e if isinstance(e, ExchangeLost) else ExchangeLost(f"the relay to {self.leader} broke: {e!r}")
            with self._cv:
                self._error = err
                futures, self._futures = list(self._futures.values()), {}
                self._queue.clear()
                self._cv.notify_all()
            for f in futures:
                if not f.done():
                    f.set_exception(err)

    def _send_request(self, slot: np.ndarray) -> None:
        room, used = slot.size, 64
        lookups, pushes = [], []
        with self._lock:
            while self._queue:
                part = self._queue[0]
                rows = part[2 if part[0] == "l" else 1].numel()
                size = 24 + (16 + 4 * self.dim) * rows if part[0] == "l" else 8 + (16 + 4 * self.dim) * rows
                if used + size > room:  # (lookups counted at their answer's size: it fits one answer slot)
                    break  # (a part alone always fits: lookup and push cut bigger ones)
                used += size
                self._queue.popleft()
                if part[0] == "l":
                    lookups.append(part)
                else:
                    pushes.append(part[1:])
        if not lookups and not pushes:
            return
        parts = [[len(lookups), len(pushes), 0, 0], [p[1] for p in lookups], [p[2].numel() for p in lookups],
                 [p[0].numel() for p in pushes], *(p[2] for p in lookups), *(p[0] for p in pushes),
                 *(p[1] for p in pushes), *(p[2] for p in pushes)]  # each part's rows 8-aligned on their own
        self.relayed_bytes += _write(slot, parts)
        self.box.words[_REQ] += 1

    def _read_answer(self, slot: np.ndarray) -> None:
        r = _Reader(slot)
        n, pushes, rows, _ = r.ints(4)
        ids, lens = r.ints(n), r.ints(n)
        versions, vectors = r.take(rows, torch.int64), r.take(rows, torch.float32, self.dim)
        self.relayed_bytes += r.off
        with self._cv:
            futures = [self._futures.pop(i) for i in ids]
            self._pushes_answered += pushes
            self._cv.notify_all()
        for fut, v, x in zip(futures, versions.split(lens), vectors.split(lens)):
            fut.set_result((x, v))


class _Relayed:
    """Stands in for a relayed lookup's future in the leader's round: its result goes to the client's outbox."""

    def __init__(self, outbox: list, part_id: int):
        self.outbox, self.part_id, self._done = outbox, part_id, False

    def done(self) -> bool:
        return self._done

    def set_result(self, result: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._done = True
        self.outbox.append((self.part_id, *result))

    def set_exception(self, err: BaseException) -> None:
        self._done = True  # the clients learn it from the failed flag


class RelayHost:
    """The node exchange's side (the leader): takes its trainers' requests into its rounds, writes the answers back."""

    def __init__(self, boxes: list[Mailbox], dim: int):
        self.boxes, self.dim = list(boxes), int(dim)
        self.outboxes: list[list] = [[] for _ in self.boxes]
        self.pushes_applied = [0] * len(self.boxes)  # not yet reported to the client
        self.relayed_bytes = 0

    def take(self, make_part: Any) -> list:
        """Every client's new request as the leader's parts: pushes first, then lookups (`make_part(ids, future,
        versions, grads, owner)` builds one)."""
        out = []
        for owner, box in enumerate(self.boxes):
            c = box.words
            c[_BEAT] += 1
            for seq in range(int(c[_REQ_TAKEN]), int(c[_REQ])):
                out += self._parse(box.requests[seq % SLOTS], owner, make_part)
                c[_REQ_TAKEN] = seq + 1
        return out

    def _parse(self, slot: np.ndarray, owner: int, make_part: Any) -> list:
        r = _Reader(slot)
        nl, np_, _, _ = r.ints(4)
        ids, lens, plens = r.ints(nl), r.ints(nl), r.ints(np_)
        lookups = [r.take(k, torch.int64) for k in lens]
        rows = [r.take(k, torch.int64) for k in plens]
        versions = [r.take(k, torch.int64) for k in plens]
        grads = [r.take(k, torch.float32, self.dim) for k in plens]
        self.relayed_bytes += r.off
        out = [make_part(pr, None, pv, pg, owner) for pr, pv, pg in zip(rows, versions, grads)]
        return out + [make_part(lk, _Relayed(self.outboxes[owner], i), None, None, owner)
                      for i, lk in zip(ids, lookups)]

    def applied(self, owner: int, pushes: int) -> None:
        self.pushes_applied[owner] += pushes

    def deliver(self) -> None:
        """Each client's answers so far into its free answer slots (what finds none waits for the next round)."""
        for owner, box in enumerate(self.boxes):
            c, out = box.words, self.outboxes[owner]
            while (out or self.pushes_applied[owner]) and int(c[_ANS]) - int(c[_ANS_TAKEN]) < SLOTS:
                slot = box.answers[int(c[_ANS]) % SLOTS]
                used, take = 64 + 16 * len(out), 0
                for _, x, _v in out:  # a part always fits alone: its request was bounded by its answer's size
                    used += x.shape[0] * (8 + 4 * self.dim) + 16
                    if used > slot.size and take:
                        break
                    take += 1
                sent, out[:] = out[:take], out[take:]
                parts = [[take, self.pushes_applied[owner], sum(x.shape[0] for _, x, _v in sent), 0],
                         [i for i, _x, _v in sent], [x.shape[0] for _, x, _v in sent]]
                if sent:  # versions, then rows: one block each (a version and a row are 8-aligned whatever the count)
                    parts += [np.concatenate([v.numpy() for _, _x, v in sent]),
                              np.concatenate([x.numpy() for _, x, _v in sent])]
                self.relayed_bytes += _write(slot, parts)
                self.pushes_applied[owner] = 0
                c[_ANS] += 1

    def idle(self) -> bool:
        """Every client closed (it closes once answered in full) and nothing left to deliver."""
        return all(int(b.words[_CLOSED]) for b in self.boxes) and not any(self.outboxes)

    def fail(self) -> None:
        for b in self.boxes:
            b.words[_FAILED] = 1
