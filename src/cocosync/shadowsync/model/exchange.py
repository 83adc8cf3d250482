"""Embedding lookups between machines as rounds of one gloo all_to_all: the lookup exchange.

A node's shards live in its shared memory, so any process of the node can serve them. Trainer i of every node joins
one exchange group (a process per node). Each runs a background thread that, every `interval` seconds, takes what its
workers queued for other nodes (each batch's remote rows to look up, its row gradients) and swaps it with its peers in
ONE `all_to_all_single` of bytes: one message per peer and round, however many batches, workers and servers it
carries, and gloo loops over the peers in C++. The message from A to B in round k holds, each part 8-byte aligned:

1. a header: the room B may use for its request to A in round k+1 (rows to look up, rows pushed), and A's done flag;
2. A's answer to the request B sent in round k-1 (B knows its size): the pushes' summed staleness, versions, rows;
3. A's request, padded to the room B announced in round k-1: its sizes, the global row ids to look up, the pushed
   ids, their versions when fetched, and the gradients.

B serves the requests of all its peers at once right after the round, on its node's shards in place (the pushes
first, then the lookups, as one RPC did) and answers in the next round: a lookup queued before round k is answered
in round k+1, 1-2 intervals later, hidden by the trainer's prefetch. The room is 1.25x the most sent over the last
rounds (so a request rarely waits; one that does not fit goes in the next round, with room announced for it: all
gloo needs is every message's size before the all_to_all). A trainer done with its lookups keeps serving until every
peer is done (`close`).

Why: a message costs ~100-400 us of CPU on each side in gloo's process group (~450 us in TensorPipe RPC) whatever
its size, and row-hash sharding sends every batch's lookup to every machine (bench/server_costs.py, BENCHMARKS.md).
Rounds turn the cost per message into a cost per round that the batches of an interval share; the Python work of a
round is a fixed number of tensor operations over everything it carries, not a loop over batches. Sorting a
round's rows by node (deduplicating its lookups) and writing every peer's message into the send buffer are one C++
pass each when the native module is built (runtime/comm/native/lookup_rounds.cpp; `sort_lookups`, `sort_pushes` and
`pack_messages` here are their Python references).
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch.distributed import AllToAllOptions

from cocosync.runtime.comm.native import one_shot as native_module
from cocosync.shadowsync.model.lookup_thread import ExchangeLost, LookupThread
from cocosync.shadowsync.model.node_relay import RelayHost

__all__ = ["LookupExchange", "ExchangeLost"]

_HEADER = 4  # int64s: room for the next request (rows to look up, rows pushed), done, unused
_NODE_SHIFT = 40  # a lookup's sort key: node << 40 | global row (tables up to 2^40 rows)
_ROW_MASK = (1 << _NODE_SHIFT) - 1
_MEMORY = 8  # rounds whose sizes set the room announced for the next request
_EMPTY = torch.empty(0, dtype=torch.uint8)
_NO_VERSIONS, _NO_ROWS = torch.empty(0, dtype=torch.int64), torch.empty(0)  # a peer owed no answer (native packing)


def _align(n: int) -> int:
    return (n + 7) // 8 * 8


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    b = t.contiguous().view(-1).view(torch.uint8)
    pad = _align(b.numel()) - b.numel()
    return torch.cat([b, b.new_zeros(pad)]) if pad else b


def _request_nbytes(cap_looked: int, cap_pushed: int, dim: int) -> int:
    """A request padded to its capacity: [looked, pushed], ids, pushed ids, versions, gradients (none if no room)."""
    if not (cap_looked or cap_pushed):
        return 0
    return 16 + 8 * (cap_looked + 2 * cap_pushed) + _align(4 * cap_pushed * dim)


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `rows` rows, as bytes."""
    if t.shape[0] < rows:
        t = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
    return _as_bytes(t)


def _parse_request(msg: torch.Tensor, cap: tuple[int, int], dim: int) -> tuple[torch.Tensor, ...]:
    """(ids, pushed ids, their versions, gradients) of a request padded to `cap`."""
    cap_l, cap_k = cap
    L, K = msg[:16].view(torch.int64).tolist()
    pos = 16 + 8 * cap_l
    ids = msg[16:16 + 8 * L].view(torch.int64)
    push_ids = msg[pos:pos + 8 * K].view(torch.int64)
    versions = msg[pos + 8 * cap_k:pos + 8 * (cap_k + K)].view(torch.int64)
    grads = msg[pos + 16 * cap_k:pos + 16 * cap_k + 4 * K * dim].view(torch.float32).view(K, dim)
    return ids, push_ids, versions, grads


def _fit(pending: list[_Part], cap: list[tuple[int, int]]) -> tuple[list[_Part], list[_Part], tuple[list, list]]:
    """The parts, in order, that fit every peer's capacity this round, the rest (kept in order: a push stays before
    the lookups queued after it), and the rows they use per peer (lookups before the round's deduplication)."""
    left_l, left_k = [c[0] for c in cap], [c[1] for c in cap]
    fit = len(pending)
    for i, part in enumerate(pending):
        left = left_l if part.future is not None else left_k
        if any(c > room for c, room in zip(part.counts, left)):
            fit = i
            break
        for p, c in enumerate(part.counts):
            left[p] -= c
    used = ([c[0] - x for c, x in zip(cap, left_l)], [c[1] - x for c, x in zip(cap, left_k)])
    return pending[:fit], pending[fit:], used


def _next_caps(recent: collections.deque, deferred: list[_Part], n: int) -> list[tuple[int, int]]:
    """Room to announce for the next round: a quarter more than the most sent to a peer over the last rounds, or
    than what waits for it (a burst, or the first requests after a quiet spell, wait one round for their room).
    Room unused is bytes sent for nothing: ~1.25x the requests' bytes in a steady state."""
    wait_l, wait_k = [0] * n, [0] * n
    for part in deferred:
        acc = wait_l if part.future is not None else wait_k
        for p, c in enumerate(part.counts):
            acc[p] += c
    return [(_room(max(max(r[0][p] for r in recent), wait_l[p])), _room(max(max(r[1][p] for r in recent), wait_k[p])))
            for p in range(n)]


def _room(rows: int) -> int:
    return rows + (rows + 3) // 4


def _answer_nbytes(looked: int, pushed: int, dim: int) -> int:
    return 8 * (1 + looked) + _align(4 * looked * dim) if looked or pushed else 0


def _bounds(counts: list[int]) -> list[int]:
    return [0, *itertools.accumulate(counts)]


def _node_of(rows: torch.Tensor, servers: int, per_node: int, owners: torch.Tensor | None = None) -> torch.Tensor:
    """The peer each global row is sent to: its server's node (server s on node s // per_node), or `owners[s]`."""
    if owners is not None:
        return owners.index_select(0, rows % servers)
    return (rows % servers).div_(per_node, rounding_mode="floor")


def sort_lookups(parts: list[torch.Tensor], servers: int, per_node: int, n: int, *, native: Any = None,
                 owners: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A round's lookups (int64 global rows per part): its distinct rows node-major (ascending within a node: the
    batches of a round share their hot rows), where each row of the parts concatenated is in them, rows per node.
    `native`: the C++ module (runtime/comm/native, the same bits), else this Python path, its reference."""
    parts = [p.to(torch.int64).contiguous() for p in parts]
    if native is not None:
        ids, where, counts = native.sort_lookups(parts, servers, per_node, n)
        return ids, where, counts.tolist()
    ids = torch.cat(parts)
    keys, where = torch.unique(_node_of(ids, servers, per_node, owners).bitwise_left_shift_(_NODE_SHIFT)
                               .bitwise_or_(ids), return_inverse=True)
    counts = torch.bincount(keys.bitwise_right_shift(_NODE_SHIFT), minlength=n).tolist()
    return keys.bitwise_and_(_ROW_MASK), where, counts


def sort_pushes(rows: list[torch.Tensor], versions: list[torch.Tensor], grads: list[torch.Tensor], servers: int,
                per_node: int, n: int, *, native: Any = None,
                owners: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """A round's pushes concatenated and stably ordered by node: rows, versions, float32 gradients, rows per node."""
    rows = [r.to(torch.int64).contiguous() for r in rows]
    versions = [v.to(torch.int64).contiguous() for v in versions]
    grads = [g.to(torch.float32).contiguous() for g in grads]
    if native is not None:
        ids, vers, g, counts = native.sort_pushes(rows, versions, grads, servers, per_node, n, grads[0].shape[1])
        return ids, vers, g, counts.tolist()
    ids = torch.cat(rows)
    node = _node_of(ids, servers, per_node, owners)
    perm = torch.argsort(node, stable=True)
    counts = torch.bincount(node, minlength=n).tolist()
    return ids[perm], torch.cat(versions)[perm], torch.cat(grads)[perm], counts


@dataclass
class _Part:
    ids: torch.Tensor  # global rows, none of them on this node
    future: torch.futures.Future | None  # a lookup's (rows, versions); None for a push
    versions: torch.Tensor | None = None  # a push: the rows' versions when fetched
    grads: torch.Tensor | None = None
    counts: list[int] = field(default_factory=list)  # rows per node
    owner: int = -1  # a part relayed for another trainer of this node: its mailbox (node_relay.py); -1: this one's


@dataclass
class _Round:
    """The parts one round's messages carry, their rows sorted by node (one slice per peer)."""

    lookups: list[_Part] = field(default_factory=list)
    ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # distinct, node-major
    where: torch.Tensor | None = None  # each looked-up row (the lookups concatenated) -> its position in `ids`
    looked: list[int] = field(default_factory=list)  # rows to look up per node
    pushes: int = 0  # push parts of this trainer
    relayed_pushes: dict = field(default_factory=dict)  # push parts relayed for the node's other trainers, per one
    push_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # node-major
    push_versions: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    grads: torch.Tensor | None = None  # [pushed rows, dim] (set by _sorted, empty without pushes)
    pushed: list[int] = field(default_factory=list)  # rows pushed per node


@dataclass
class _Answer:
    """What this trainer owes a peer after serving its request: the pushes' summed staleness, the looked-up rows'
    versions and the rows (views into the round's served tensors)."""

    stale: int
    versions: torch.Tensor
    rows: torch.Tensor


def _request_bytes(rnd: _Round, p: int, lb: list[int], pb: list[int], cap: tuple[int, int]) -> list[torch.Tensor]:
    """The request to peer p, padded to the capacity it expects: [looked, pushed], ids, pushed ids, their
    versions, gradients."""
    if cap == (0, 0):
        return []
    cap_l, cap_k = cap
    L, K = lb[p + 1] - lb[p], pb[p + 1] - pb[p]
    out = [_as_bytes(torch.tensor([L, K], dtype=torch.int64)), _padded(rnd.ids[lb[p]:lb[p + 1]], cap_l)]
    if cap_k:
        out += [_padded(t[pb[p]:pb[p + 1]], cap_k) for t in (rnd.push_ids, rnd.push_versions, rnd.grads)]
    return out


def pack_messages(me: int, heads: torch.Tensor, owed: list[_Answer | None], rnd: _Round,
                  caps: list[tuple[int, int]], dim: int, *, native: Any = None) -> tuple[torch.Tensor, list[int]]:
    """One round's send buffer and its size per peer: to each peer p != me its header `heads[p]`, the answer owed
    to it, and this trainer's request padded to the room `caps[p]` p announced. `native`: the C++ module (one
    pass, the same bytes), else this Python path, its reference."""
    lb, pb = _bounds(rnd.looked), _bounds(rnd.pushed)
    if native is not None:
        buf, sizes = native.pack_messages(
            me, heads, [a.stale if a else 0 for a in owed], [a.versions if a else _NO_VERSIONS for a in owed],
            [a.rows if a else _NO_ROWS for a in owed], [a is not None for a in owed], rnd.ids, lb, rnd.push_ids,
            rnd.push_versions, rnd.grads.reshape(-1, dim), pb, [c[0] for c in caps], [c[1] for c in caps], dim)
        return buf, list(sizes)
    send, sizes = [], [0] * len(owed)
    for p, answer in enumerate(owed):
        if p == me:
            continue
        chunk = [_as_bytes(heads[p])]
        if answer is not None:
            chunk += [_as_bytes(torch.tensor([answer.stale], dtype=torch.int64)), _as_bytes(answer.versions),
                      _as_bytes(answer.rows)]
        chunk += _request_bytes(rnd, p, lb, pb, caps[p])
        send.extend(chunk)
        sizes[p] = sum(c.numel() for c in chunk)
    return (torch.cat(send) if send else _EMPTY), sizes


class LookupExchange(LookupThread):
    """This trainer's side of the lookup exchange (see the module doc). `group`: gloo group of one trainer per node,
    in node order (group rank = node); `shards`: this node's shards by global server index; `servers`: the job's
    server count S (global row g lives on server g % S, at its row g // S); `servers_per_node`: server s lives on node
    s // servers_per_node; `labels[n]`: how errors name node n's peer; `native`: sort and pack each round in C++
    (the module of runtime/comm/native, when enabled and built) rather than in Python, the reference; `relays`: the
    trainers whose rows this exchange also carries (node-exchange: it runs on the node's first server); `owners`:
    int64 [servers], the group rank that serves each server's rows, where that is not its node (an exchange re-formed
    among the machines left after a loss, some holding a lost machine's shards: it sorts in Python, the
    reference)."""

    def __init__(self, group: Any, shards: Mapping[int, Any], *, servers: int, servers_per_node: int, dim: int,
                 interval: float, labels: Sequence[str], native: bool = True, relays: RelayHost | None = None,
                 owners: torch.Tensor | None = None):
        self.group, self.dim, self.interval = group, int(dim), float(interval)
        self.owners = owners
        self.native = native_module() if native and owners is None else None
        self.me, self.n = group.rank(), group.size()
        self.shards, self.servers, self.per_node = dict(shards), int(servers), int(servers_per_node)
        self.labels = list(labels)
        self.relays = relays  # node-exchange: the node's trainers' mailboxes, whose lookups this exchange carries
        self.rounds = 0
        self.bytes_sent = 0  # every message of every round, headers and answers included
        self.cpu_s = 0.0  # this thread's CPU in its rounds (packing, the all_to_all, serving the peers)
        self._queue: list[_Part] = []
        self._stale = 0
        self._start("cocosync-lookups", "exchange")

    # -- the client side (the trainer's workers) ----------------------------------------------------------------
    def node_of(self, rows: torch.Tensor) -> torch.Tensor:
        return _node_of(rows, self.servers, self.per_node, self.owners)

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
        part.counts = torch.bincount(self.node_of(part.ids), minlength=self.n).tolist()
        with self._lock:
            self._check()
            self._queue.append(part)
            self._pushes_queued += part.future is None

    def take_stale(self) -> int:
        """Updates the pushed rows received between their fetch and their gradient, summed since the last call."""
        with self._lock:
            stale, self._stale = self._stale, 0
            return stale

    # -- the rounds ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        n, dim = self.n, self.dim
        awaiting = _Round(looked=[0] * n, pushed=[0] * n)  # sent last round: answered this round
        cap_out = [(0, 0)] * n  # (lookups, pushed rows) this trainer may send each peer this round
        cap_in = [(0, 0)] * n  # ... each peer may send this trainer: the padded size of its request
        owed: list[_Answer | None] = [None] * n  # answers served after last round
        deferred: list[_Part] = []
        recent: collections.deque = collections.deque(maxlen=_MEMORY)
        rnd = awaiting
        deadline = time.monotonic()
        try:
            while True:
                deadline = max(deadline + self.interval, time.monotonic())
                time.sleep(max(0.0, deadline - time.monotonic()))
                cpu0 = time.thread_time()
                with self._lock:
                    pending, self._queue = deferred + self._queue, []
                    closing = self._closing
                if self.relays is not None:
                    pending += self.relays.take(self._relayed_part)
                done = closing and not pending and (self.relays is None or self.relays.idle())
                sent, deferred, used = _fit(pending, cap_out)
                rnd = self._sorted(sent)
                recent.append(used)
                caps = _next_caps(recent, deferred, n)
                heads = torch.tensor([[*caps[p], int(done), 0] for p in range(n)], dtype=torch.int64)
                sendbuf, in_sizes = pack_messages(self.me, heads, owed, rnd, cap_out, dim, native=self.native)
                out_sizes = [0 if p == self.me else
                             8 * _HEADER + _answer_nbytes(awaiting.looked[p], awaiting.pushed[p], dim)
                             + _request_nbytes(*cap_in[p], dim) for p in range(n)]
                recvbuf = torch.empty(sum(out_sizes), dtype=torch.uint8)
                # (the group's own call: it may be a gloo group made through the job's store, outside torch's map)
                self.group.alltoall_base(recvbuf, sendbuf, out_sizes, in_sizes, AllToAllOptions()).wait()
                self.rounds += 1
                self.bytes_sent += sendbuf.numel()
                everyone_done, caps_in, answers, requests = done, [(0, 0)] * n, [], []
                off = 0
                for p in range(n):
                    if p == self.me:
                        continue
                    msg = recvbuf[off:off + out_sizes[p]]
                    off += out_sizes[p]
                    head = msg[:8 * _HEADER].view(torch.int64).tolist()
                    caps_in[p] = (head[0], head[1])
                    everyone_done = everyone_done and bool(head[2])
                    cut = 8 * _HEADER + _answer_nbytes(awaiting.looked[p], awaiting.pushed[p], dim)
                    answers.append((p, msg[8 * _HEADER:cut]))
                    if cap_in[p] != (0, 0):
                        requests.append((p, *_parse_request(msg[cut:], cap_in[p], dim)))
                self._answered(awaiting, answers)
                if self.relays is not None:
                    self.relays.deliver()
                owed = self._serve(requests)
                awaiting, cap_out, cap_in = rnd, caps, caps_in
                self.cpu_s += time.thread_time() - cpu0
                if everyone_done:  # nobody sent a request this round, and every answer owed went out in it
                    return
        except BaseException as e:  # noqa: BLE001 - every waiting worker gets the reason
            peers = ", ".join(f"node {p} ({self.labels[p]})" for p in range(n) if p != self.me)
            self._fail(ExchangeLost(f"the embedding lookup exchange with {peers} broke: {e}"),
                       awaiting.lookups + rnd.lookups + [p for p in deferred if p.future is not None])

    def _sorted(self, parts: list[_Part]) -> _Round:
        """The round of `parts`: lookups and pushes each concatenated and sorted by node."""
        rnd = _Round(looked=[0] * self.n, pushed=[0] * self.n, grads=torch.empty(0, self.dim))
        rnd.lookups = [p for p in parts if p.future is not None]
        pushes = [p for p in parts if p.future is None]
        where = (self.servers, self.per_node, self.n)
        if rnd.lookups:
            rnd.ids, rnd.where, rnd.looked = sort_lookups([p.ids for p in rnd.lookups], *where, native=self.native,
                                                          owners=self.owners)
        if pushes:
            rnd.push_ids, rnd.push_versions, rnd.grads, rnd.pushed = sort_pushes(
                [p.ids for p in pushes], [p.versions for p in pushes], [p.grads for p in pushes], *where,
                native=self.native, owners=self.owners)
            rnd.pushes = sum(p.owner < 0 for p in pushes)
            rnd.relayed_pushes = collections.Counter(p.owner for p in pushes if p.owner >= 0)
        return rnd

    def _relayed_part(self, ids: torch.Tensor, future: Any, versions: torch.Tensor | None,
                      grads: torch.Tensor | None, owner: int) -> _Part:
        counts = torch.bincount(self.node_of(ids), minlength=self.n).tolist()
        return _Part(ids, future, versions, grads, counts, owner)

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
            got_rows, got_versions = torch.cat(rows), torch.cat(versions)  # rnd.ids' order
            for part, at in zip(rnd.lookups, rnd.where.split([p.ids.numel() for p in rnd.lookups])):
                part.future.set_result((got_rows.index_select(0, at), got_versions.index_select(0, at)))
        for owner, k in rnd.relayed_pushes.items():
            self.relays.applied(owner, k)
        with self._cv:
            self._stale += stale  # the node's: a peer answers one sum per request, whoever's parts it carried
            self._pushes_answered += rnd.pushes
            self._cv.notify_all()

    def _serve(self, requests: list[tuple]) -> list[_Answer | None]:
        """Apply every peer's pushes, then look up every peer's rows, on this node's shards; each peer's answer.
        `requests`: (peer, ids, pushed ids, their versions, gradients)."""
        owed: list[_Answer | None] = [None] * self.n
        requests = [r for r in requests if r[1].numel() or r[2].numel()]
        if not requests:
            return owed
        who = [r[0] for r in requests]
        pushed = [r[2].numel() for r in requests]
        stale = [0] * len(who)
        if sum(pushed):
            per_row = self._apply(torch.cat([r[2] for r in requests]), torch.cat([r[4] for r in requests]),
                                  torch.cat([r[3] for r in requests]))
            stale = [int(x.sum()) for x in per_row.split(pushed)]
        rows, versions = self._read(torch.cat([r[1] for r in requests]))
        lb = _bounds([r[1].numel() for r in requests])
        for i, p in enumerate(who):
            owed[p] = _Answer(stale[i], versions[lb[i]:lb[i + 1]], rows[lb[i]:lb[i + 1]])
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
        if self.relays is not None:
            self.relays.fail()
        with self._cv:
            self._error = err
            lookups = lookups + [p for p in self._queue if p.future is not None]
            self._queue = []
            self._cv.notify_all()
        for part in lookups:
            if not part.future.done():
                part.future.set_exception(err)
