"""Embedding lookups between machines as rounds of one gloo all_to_all: the lookup exchange.

A node's shards live in its shared memory, so any process of the node can serve them. Trainer i of every node joins
one exchange group (a process per node). Each runs a background thread that, every `interval` seconds, takes what its
workers queued for other nodes (each batch's remote rows to look up, its row gradients) and swaps it with its peers in
ONE `all_to_all_single` of bytes: one message per peer and round, however many batches, workers and servers it
carries, and gloo loops over the peers in C++. The message from A to B in round k holds, each part 8-byte aligned:

1. a header: the sizes of the request A sends B in round k+1 (rows to look up, rows pushed) and A's done flag;
2. A's answer to the request B sent in round k-1 (B knows its size): the pushes' summed staleness, versions, rows;
3. A's request announced in round k-1: global row ids to look up; pushed ids, their versions when fetched, gradients.

B serves the requests of all its peers at once right after the round, on its node's shards in place (the pushes
first, then the lookups, as one RPC did) and answers in the next round. A request queued before round k is announced
in k, sent in k+1, answered in k+2: a lookup waits 2-3 intervals, hidden by the trainer's prefetch. A trainer done
with its lookups keeps serving until every peer is done (`close`).

Why: a message costs ~100-400 us of CPU on each side in gloo's process group (~450 us in TensorPipe RPC) whatever
its size, and row-hash sharding sends every batch's lookup to every machine (bench/server_costs.py, BENCHMARKS.md,
issue 31). Rounds turn the cost per message into a cost per round that the batches of an interval share; the Python
work of a round is a fixed number of tensor operations over everything it carries, not a loop over batches.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["LookupExchange", "ExchangeLost"]

_HEADER = 4  # int64s: rows to look up, rows pushed, done, unused
_EMPTY = torch.empty(0, dtype=torch.uint8)


class ExchangeLost(RuntimeError):
    """The exchange with the other nodes broke (a peer died or its machine is unreachable); the message names them."""


def _align(n: int) -> int:
    return (n + 7) // 8 * 8


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    b = t.contiguous().view(-1).view(torch.uint8)
    pad = _align(b.numel()) - b.numel()
    return torch.cat([b, b.new_zeros(pad)]) if pad else b


def _request_nbytes(looked: int, pushed: int, dim: int) -> int:
    return 8 * (looked + 2 * pushed) + _align(4 * pushed * dim)


def _answer_nbytes(looked: int, pushed: int, dim: int) -> int:
    return 8 * (1 + looked) + _align(4 * looked * dim) if looked or pushed else 0


def _bounds(counts: list[int]) -> list[int]:
    return [0, *itertools.accumulate(counts)]


@dataclass
class _Part:
    ids: torch.Tensor  # global rows, none of them on this node
    future: torch.futures.Future | None  # a lookup's (rows, versions); None for a push
    versions: torch.Tensor | None = None  # a push: the rows' versions when fetched
    grads: torch.Tensor | None = None


@dataclass
class _Round:
    """The parts one round's messages carry, their rows sorted by node (one slice per peer)."""

    lookups: list[_Part] = field(default_factory=list)
    ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    perm: torch.Tensor | None = None  # sorted position -> position in the concatenated lookups
    looked: list[int] = field(default_factory=list)  # rows to look up per node
    pushes: int = 0  # push parts
    push_ids: torch.Tensor | None = None
    push_versions: torch.Tensor | None = None
    grads: torch.Tensor | None = None
    pushed: list[int] = field(default_factory=list)  # rows pushed per node


class LookupExchange:
    """This trainer's side of the lookup exchange (see the module doc). `group`: gloo group of one trainer per node,
    in node order (group rank = node); `shards`: this node's shards by global server index; `servers`: the job's
    server count S (global row g lives on server g % S, at its row g // S); `servers_per_node`: server s lives on node
    s // servers_per_node; `labels[n]`: how errors name node n's peer."""

    def __init__(self, group: Any, shards: Mapping[int, Any], *, servers: int, servers_per_node: int, dim: int,
                 interval: float, labels: Sequence[str]):
        self.group, self.dim, self.interval = group, int(dim), float(interval)
        self.me, self.n = dist.get_rank(group), dist.get_world_size(group)
        self.shards, self.servers, self.per_node = dict(shards), int(servers), int(servers_per_node)
        self.labels = list(labels)
        self.rounds = 0
        self.bytes_sent = 0  # every message of every round, headers and answers included
        self.cpu_s = 0.0  # this thread's CPU in its rounds (packing, the all_to_all, serving the peers)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._queue: list[_Part] = []
        self._pushes_queued = self._pushes_answered = 0
        self._stale = 0
        self._closing = False
        self._error: ExchangeLost | None = None
        self._thread = threading.Thread(target=self._run, name="cocosync-lookups", daemon=True)
        self._thread.start()

    # -- the client side (the trainer's workers) ----------------------------------------------------------------
    def node_of(self, rows: torch.Tensor) -> torch.Tensor:
        return (rows % self.servers).div_(self.per_node, rounding_mode="floor")

    def lookup(self, rows: torch.Tensor) -> torch.futures.Future:
        """Look up global rows of other nodes' shards; the future gives (rows [len, dim], their versions)."""
        fut: torch.futures.Future = torch.futures.Future()
        self._put(_Part(rows, fut))
        return fut

    def push(self, rows: torch.Tensor, grads: torch.Tensor, versions: torch.Tensor) -> None:
        """Queue the gradients of global rows of other nodes' shards (`versions`: theirs when fetched); applied
        before the lookups that reach the same server in the same round or later."""
        self._put(_Part(rows, None, versions, grads))

    def _put(self, part: _Part) -> None:
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._closing:
                raise RuntimeError("the lookup exchange is closed")
            self._queue.append(part)
            self._pushes_queued += part.future is None

    def take_stale(self) -> int:
        """Updates the pushed rows received between their fetch and their gradient, summed since the last call."""
        with self._lock:
            stale, self._stale = self._stale, 0
            return stale

    def flush(self) -> None:
        """Wait until every push queued so far is applied on its server."""
        with self._cv:
            target = self._pushes_queued
            while self._pushes_answered < target and self._error is None:
                self._cv.wait(1.0)
            if self._error is not None:
                raise self._error

    def close(self) -> None:
        """No more lookups from this trainer; serve the peers until every one of them is done too, then stop."""
        with self._lock:
            self._closing = True
        self._thread.join()
        if self._error is not None:
            raise self._error

    # -- the rounds ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        n, dim = self.n, self.dim
        announced = awaiting = _Round(looked=[0] * n, pushed=[0] * n)  # sent this round / answered this round
        incoming = [(0, 0)] * n  # (looked, pushed) each peer announced last round
        owed = [_EMPTY] * n  # answers served after last round
        drained = False
        deadline = time.monotonic()
        try:
            while True:
                deadline = max(deadline + self.interval, time.monotonic())
                time.sleep(max(0.0, deadline - time.monotonic()))
                cpu0 = time.thread_time()
                with self._lock:
                    fresh, self._queue = self._queue, []
                    done = self._closing and not fresh
                nxt = self._sorted(fresh)
                send, in_sizes, out_sizes = [], [0] * n, [0] * n
                lb, pb = _bounds(announced.looked), _bounds(announced.pushed)
                for p in range(n):
                    if p == self.me:
                        continue
                    head = torch.tensor([nxt.looked[p], nxt.pushed[p], int(done), 0], dtype=torch.int64)
                    chunk = [_as_bytes(head), owed[p]]
                    if lb[p] < lb[p + 1]:
                        chunk.append(_as_bytes(announced.ids[lb[p]:lb[p + 1]]))
                    if pb[p] < pb[p + 1]:
                        chunk += [_as_bytes(announced.push_ids[pb[p]:pb[p + 1]]),
                                  _as_bytes(announced.push_versions[pb[p]:pb[p + 1]]),
                                  _as_bytes(announced.grads[pb[p]:pb[p + 1]])]
                    send.extend(chunk)
                    in_sizes[p] = sum(c.numel() for c in chunk)
                    out_sizes[p] = (8 * _HEADER + _answer_nbytes(awaiting.looked[p], awaiting.pushed[p], dim)
                                    + _request_nbytes(*incoming[p], dim))
                sendbuf = torch.cat(send) if send else _EMPTY
                recvbuf = torch.empty(sum(out_sizes), dtype=torch.uint8)
                dist.all_to_all_single(recvbuf, sendbuf, out_sizes, in_sizes, group=self.group)
                self.rounds += 1
                self.bytes_sent += sendbuf.numel()
                everyone_done, heads, answers, requests = done, [(0, 0)] * n, [], []
                off = 0
                for p in range(n):
                    if p == self.me:
                        continue
                    msg = recvbuf[off:off + out_sizes[p]]
                    off += out_sizes[p]
                    head = msg[:8 * _HEADER].view(torch.int64).tolist()
                    heads[p] = (head[0], head[1])
                    everyone_done = everyone_done and bool(head[2])
                    cut = 8 * _HEADER + _answer_nbytes(awaiting.looked[p], awaiting.pushed[p], dim)
                    answers.append((p, msg[8 * _HEADER:cut]))
                    requests.append((p, msg[cut:]))
                self._answered(awaiting, answers)
                owed = self._serve(requests, incoming)
                incoming, awaiting, announced = heads, announced, nxt
                self.cpu_s += time.thread_time() - cpu0
                # everyone said done and announced nothing: one more round carries the last answers, then stop
                if drained:
                    return
                drained = everyone_done
        except BaseException as e:  # noqa: BLE001 - every waiting worker gets the reason
            peers = ", ".join(f"node {p} ({self.labels[p]})" for p in range(n) if p != self.me)
            self._fail(ExchangeLost(f"the embedding lookup exchange with {peers} broke: {e}"),
                       announced.lookups + awaiting.lookups)

    def _sorted(self, parts: list[_Part]) -> _Round:
        """The round of `parts`: lookups and pushes each concatenated and sorted by node."""
        rnd = _Round(looked=[0] * self.n, pushed=[0] * self.n)
        rnd.lookups = [p for p in parts if p.future is not None]
        pushes = [p for p in parts if p.future is None]
        if rnd.lookups:
            ids = torch.cat([p.ids for p in rnd.lookups])
            node = self.node_of(ids)
            rnd.perm = torch.argsort(node, stable=True)
            rnd.ids = ids[rnd.perm]
            rnd.looked = torch.bincount(node, minlength=self.n).tolist()
        if pushes:
            ids = torch.cat([p.ids for p in pushes])
            node = self.node_of(ids)
            perm = torch.argsort(node, stable=True)
            rnd.push_ids, rnd.pushes = ids[perm], len(pushes)
            rnd.push_versions = torch.cat([p.versions for p in pushes])[perm]
            rnd.grads = torch.cat([p.grads for p in pushes]).to(torch.float32)[perm]
            rnd.pushed = torch.bincount(node, minlength=self.n).tolist()
        return rnd

    def _answered(self, rnd: _Round, answers: list[tuple[int, torch.Tensor]]) -> None:
        """Hand each lookup of `rnd` its rows from the peers' answers (in node order, as `rnd.ids` is sorted)."""
        dim, stale, rows, versions = self.dim, 0, [], []
        for p, msg in answers:
            if not msg.numel():
                continue
            L = rnd.looked[p]
            stale += int(msg[:8].view(torch.int64))
            versions.append(msg[8:8 + 8 * L].view(torch.int64))
            rows.append(msg[8 + 8 * L:8 + 8 * L + 4 * L * dim].view(torch.float32).view(L, dim))
        if rnd.lookups:
            got_rows, got_versions = torch.empty(rnd.ids.numel(), dim), torch.empty(rnd.ids.numel(), dtype=torch.int64)
            got_rows[rnd.perm], got_versions[rnd.perm] = torch.cat(rows), torch.cat(versions)
            sizes = [p.ids.numel() for p in rnd.lookups]
            for part, r, v in zip(rnd.lookups, got_rows.split(sizes), got_versions.split(sizes)):
                part.future.set_result((r, v))
        with self._cv:
            self._stale += stale
            self._pushes_answered += rnd.pushes
            self._cv.notify_all()

    def _serve(self, requests: list[tuple[int, torch.Tensor]], sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Apply every peer's pushes, then look up every peer's rows, on this node's shards; each peer's answer."""
        dim, owed = self.dim, [_EMPTY] * self.n
        ids, push_ids, push_versions, grads, who = [], [], [], [], []
        for p, msg in requests:
            L, K = sizes[p]
            ids.append(msg[:8 * L].view(torch.int64))
            push_ids.append(msg[8 * L:8 * (L + K)].view(torch.int64))
            push_versions.append(msg[8 * (L + K):8 * (L + 2 * K)].view(torch.int64))
            grads.append(msg[8 * (L + 2 * K):8 * (L + 2 * K) + 4 * K * dim].view(torch.float32).view(K, dim))
            who.append(p)
        if not any(sizes[p] != (0, 0) for p in who):
            return owed
        pushed = [sizes[p][1] for p in who]
        stale = torch.zeros(len(who), dtype=torch.int64)
        if sum(pushed):
            per_row = self._apply(torch.cat(push_ids), torch.cat(grads), torch.cat(push_versions))
            stale.index_add_(0, torch.repeat_interleave(torch.arange(len(who)), torch.tensor(pushed)), per_row)
        rows, versions = self._read(torch.cat(ids))
        lb = _bounds([sizes[p][0] for p in who])
        for i, p in enumerate(who):
            if sizes[p] != (0, 0):
                owed[p] = torch.cat([_as_bytes(stale[i:i + 1]), _as_bytes(versions[lb[i]:lb[i + 1]]),
                                     _as_bytes(rows[lb[i]:lb[i + 1]])])
        return owed

    def _by_shard(self, rows: torch.Tensor):
        """(shard, positions in `rows` or None for all of them, local rows) for each of this node's servers."""
        S = self.servers
        if len(self.shards) == 1:
            (shard,) = self.shards.values()
            yield shard, None, rows // S
            return
        owner = rows % S
        for server, shard in self.shards.items():
            where = (owner == server).nonzero().view(-1)
            if where.numel():
                yield shard, where, rows[where] // S

    def _apply(self, rows: torch.Tensor, grads: torch.Tensor, versions: torch.Tensor) -> torch.Tensor:
        stale = torch.zeros(rows.numel(), dtype=torch.int64)
        for shard, where, local in self._by_shard(rows):
            if where is None:
                return shard.apply_rows(local, grads, versions)
            stale[where] = shard.apply_rows(local, grads[where], versions[where])
        return stale

    def _read(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(rows.numel(), self.dim)
        versions = torch.empty(rows.numel(), dtype=torch.int64)
        for shard, where, local in self._by_shard(rows):
            r, v = shard.lookup(local)
            if where is None:
                return r, v
            out[where], versions[where] = r, v
        return out, versions

    def _fail(self, err: ExchangeLost, lookups: list[_Part]) -> None:
        with self._cv:
            self._error = err
            lookups = lookups + [p for p in self._queue if p.future is not None]
            self._queue = []
            self._cv.notify_all()
        for part in lookups:
            if not part.future.done():
                part.future.set_exception(err)
