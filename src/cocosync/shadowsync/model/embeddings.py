"""The trainer's client of the embedding tables (shard.py: row hash, shards, the row update), and the servers'
RPC handlers.

One lookup touches every server (row hash); the price is paid once per batch: the client deduplicates the batch's
ids and sends one message per server.

A server's shard lives in its node's shared memory (an `Arena.shared_empty`, mapped by every process of the node):
trainers on the same node read and update it in place, zero-copy, as if it were their own;
trainers on other nodes go through the lookup exchange (exchange.py: rounds of one gloo all_to_all between the
trainers of every node, the default) or through torch.distributed.rpc (one message per server and batch, the former
path, kept as the baseline `--lookup-transport rpc`); with the exchange, the hottest rows are replicated on every
node instead (hot_rows.py: read and updated in place like a local shard, synchronized in the background). Updates
are row-wise Adagrad or SGD, Hogwild, through the same `rowwise_update` as the local tables. Each row carries a
version (its update count): a push reports how many updates its rows received between their fetch and its gradient
(the staleness of asynchronous lookups).

`ShardedEmbeddings.fetch` issues a lookup and returns at once; `prefetching(batches)` requests the next batches' rows
while the current batch trains (ShadowSync's idea on the sparse side). `push` queues row gradients for remote servers:
they ride on the next lookup to the same server (one message per server and batch: a server's CPU goes mostly to
per-message overhead, measured by bench/server_costs.py), or go alone once `max_inflight` batches are waiting.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import torch
import torch.distributed.rpc as rpc

from cocosync.shadowsync.model.batch_rows import distinct_rows, split_rows
from cocosync.shadowsync.model.exchange import LookupExchange
from cocosync.shadowsync.model.served import Served
from cocosync.shadowsync.model.shard import RowHash, Shard

if TYPE_CHECKING:
    from cocosync.shadowsync.model.hot_rows import HotRows, HotSync

__all__ = ["ShardedEmbeddings", "Lookup", "LookupStats", "ServerLost", "serve_shard", "gather_rows"]

class _GatherRows(torch.autograd.Function):
    """rows[index] with the backward as one index_add_ of the gradient rows (autograd's advanced-indexing backward
    runs index_put_ with accumulate, an element-wise loop: 1.7x the time of both directions here, same bits)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.rows = rows.shape[0]
        return rows.index_select(0, index.reshape(-1)).view(*index.shape, rows.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (index,) = ctx.saved_tensors
        dim = grad.shape[-1]
        return grad.new_zeros(ctx.rows, dim).index_add_(0, index.reshape(-1), grad.reshape(-1, dim)), None


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`rows[index]` ([U, dim] rows, an integer index of any shape -> [*index.shape, dim]) for training: the batch's
    embedding vectors from its distinct rows, whose gradient sums every use of a row."""
    return _GatherRows.apply(rows, index)


class ServerLost(RuntimeError):
    """A parameter server did not answer (it died, or its machine is unreachable); the message names it."""


# ---------------------------------------------------------------------------------------------- server side
_SERVED: Served[Shard] = Served("embedding server", "a lookup")  # the shards this process serves


def _push_bytes(pushes: list) -> int:
    return sum(ids.numel() * 16 + g.numel() * g.element_size() for ids, g, _ in pushes)


def serve_shard(server: int, shard: Shard) -> None:
    """Make `shard` answer the RPCs addressed to `server` in this process."""
    _SERVED.serve(server, shard)


def _rpc_push_lookup(server: int, pushes: list, ids: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Apply the pushes [(ids, grads, fetched versions)] that rode along, then look `ids` up: one message per
    remote server and batch (its summed staleness, rows, versions)."""
    shard = _SERVED[server]
    stale = sum(shard.apply(*push) for push in pushes)
    rows, versions = shard.lookup(ids)
    return stale, rows, versions


def _rpc_rows(server: int) -> torch.Tensor:
    return _SERVED[server].weight.clone()


def _rpc_push(server: int, pushes: list) -> int:
    shard = _SERVED[server]
    return sum(shard.apply(*push) for push in pushes)


# ---------------------------------------------------------------------------------------------- client side
@dataclass
class LookupStats:
    """What the client measured (summed over its worker threads)."""

    lookups: int = 0
    wait_s: float = 0.0  # time blocked waiting for remote rows (the lookups' share of the critical path)
    rows: int = 0  # distinct rows fetched
    remote_rows: int = 0  # ... of which through RPC
    bytes_sent: int = 0  # RPC payload bytes (ids, gradients, versions), both directions counted where they go
    bytes_received: int = 0
    rpc_s: float = 0.0  # summed round trips of remote lookups (issue -> answer arrived)
    rpc_calls: int = 0  # remote lookups (RPC: one message each, pushes ride on them)
    push_calls: int = 0  # messages of pushes alone (RPC: queue full, or the final flush)
    rounds: int = 0  # lookup exchange: rounds run (one message to every other node each)
    messages: int = 0  # messages this client's transport sent to other nodes (exchange: rounds x peers)
    wire_bytes: int = 0  # exchange: bytes of those messages (requests, answers served to peers, headers)
    exchange_cpu_s: float = 0.0  # exchange: its thread's CPU in rounds (packing, all_to_all, serving peers)
    hot_rows: int = 0  # distinct rows read from the node's replica of the hot rows (hot_rows.py)
    hot_syncs: int = 0  # the replica's syncs with the other nodes (on the node's first trainer)
    hot_sync_cpu_s: float = 0.0
    hot_sync_bytes: int = 0
    hot_sync_interval_s: float = 0.0  # the intervals its syncs set, summed (their mean: / hot_syncs)
    hot_sync_longest_gap_s: float = 0.0  # the longest time between two of its syncs
    pushes: int = 0
    stale_sum: int = 0  # updates the pushed rows received between their fetch and their gradient
    stale_rows: int = 0
    stale_remote: int = 0  # of stale_sum: other nodes' rows (the exchange's or the servers' answers)
    stale_hot_sync: int = 0  # of stale_sum: the hot rows' updates on other nodes not yet synced (estimated)
    start_lookups: int = 0  # the first lookups, the start window: they wait for the first rounds whatever follows
    start_wait_s: float = 0.0  # ... their blocked time (wait_s - this: the steady wait)
    start_window: int = 0  # lookups counted in the start window (set by the client: its workers x (prefetch + 1))

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def count(self, blocked: float, rows: int, remote: int, stale: int, received: int) -> None:
        """One lookup waited for (the caller holds the client's lock)."""
        self.wait_s += blocked
        if self.lookups < self.start_window:
            self.start_lookups += 1
            self.start_wait_s += blocked
        self.lookups += 1
        self.rows += rows
        self.remote_rows += remote
        self.stale_sum += stale
        self.bytes_received += received


@dataclass
class Lookup:
    """One batch's lookup in flight: distinct global rows, where each batch entry points, and the servers' parts."""

    uniq: torch.Tensor  # distinct global rows, sorted
    inverse: torch.Tensor  # [B, F]: index into uniq
    order: torch.Tensor  # permutation of uniq grouping it by server
    bounds: list[tuple[int, int, int]]  # (server, lo, hi) into order
    parts: list[Any]  # per bound: a local shard's ids (read at wait) or a Future of a remote (stale, rows, versions)
    issued: float
    rows: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    answered: list[float] = field(default_factory=list)  # when each remote part arrived (an RPC thread notes it)
    within: tuple[Lookup, torch.Tensor] | None = None  # (the lookup of a group of batches, uniq's positions in it)
    # lookup exchange: (server, positions in uniq, local rows) per local shard; the remote rows' positions, and
    # the Future of their (rows, versions) from the exchange (None: every row is local); the hot rows' (positions
    # in uniq, slots in the node's replica)
    local: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None
    hot: tuple[torch.Tensor, torch.Tensor] | None = None
    remote_idx: torch.Tensor | None = None
    remote: Any = None


class ShardedEmbeddings:
    """The tables of a run, sharded by `RowHash` over `servers`: each entry a local `Shard` (same node, shared
    memory) or the RPC worker name of the server that holds it."""

    def __init__(self, table_rows: Sequence[int], dim: int, servers: Sequence[Shard | str], *, max_inflight: int = 4,
                 labels: Sequence[str] | None = None, group: int = 1, exchange: LookupExchange | None = None,
                 hot: HotRows | None = None, hot_sync: HotSync | None = None, start_window: int = 0):
        """`labels`: how errors name each server (default: its RPC name); `group`: batches whose lookups go in one
        message per server when prefetching (fewer messages, staler rows); `exchange`: the remote servers are
        reached through it (their entries in `servers` are then labels only), else by RPC; `hot`: with the
        exchange, the node's replica of the hot rows, read and updated in place (hot_rows.py); `hot_sync`: its
        sync, on the node's first trainer (its staleness and costs are reported here); `start_window`: the first
        lookups whose wait is also counted apart (the first rounds' wait, `LookupStats.start_wait_s`)."""
        self.table_rows, self.dim = [int(r) for r in table_rows], int(dim)
        self.servers = list(servers)
        self.labels = list(labels) if labels is not None else [
            s if isinstance(s, str) else f"local shard {i}" for i, s in enumerate(self.servers)]
        self.hash = RowHash(sum(self.table_rows), len(self.servers))
        offsets = [0]
        for r in self.table_rows[:-1]:
            offsets.append(offsets[-1] + r)
        self.offsets = torch.tensor(offsets, dtype=torch.int64)
        if max_inflight < 1:
            raise ValueError(f"max_inflight={max_inflight!r} must be >= 1")
        if group < 1:
            raise ValueError(f"group={group!r} must be >= 1 batch per message")
        self.max_inflight, self.group, self.exchange = max_inflight, group, exchange
        if hot is not None and exchange is None:
            raise ValueError("replicated hot rows need the lookup exchange")
        self.hot = hot if hot is not None and len(hot) else None
        self.hot_sync = hot_sync
        self._local_servers = [s for s, server in enumerate(self.servers) if isinstance(server, Shard)]
        self._is_local = torch.tensor([isinstance(server, Shard) for server in self.servers])
        self.stats = LookupStats(start_window=start_window)
        self._lock = threading.Lock()
        self._inflight: collections.deque = collections.deque()
        self._pending: dict[int, list] = {}  # server -> pushes waiting for the next message to it

    # -- lookups ----------------------------------------------------------------------------------------
    def fetch(self, sparse: torch.Tensor) -> Lookup:
        """Start the lookup of a batch's ids [B, num_tables]: its remote rows as one request to the exchange, or one
        RPC message per remote server; local shards are read at `wait`."""
        uniq, inverse = self._distinct(sparse)
        if self.exchange is not None:
            return self._fetch_exchange(uniq, inverse.view(sparse.shape))
        order, bounds = self._by_server(uniq)
        local_ids = (uniq // self.hash.servers)[order]
        parts = []
        now = time.perf_counter()
        for s, lo, hi in bounds:
            ids = local_ids[lo:hi]
            server = self.servers[s]
            if isinstance(server, Shard):  # read when the batch is due (wait), not when prefetched: fresher rows
                parts.append(ids)
            else:
                with self._lock:
                    pushes = self._pending.pop(s, [])
                    self.stats.bytes_sent += _push_bytes(pushes) + ids.numel() * 8
                    self.stats.messages += 1
                parts.append(rpc.rpc_async(server, _rpc_push_lookup, args=(s, pushes, ids)))
        lk = Lookup(uniq, inverse.view(sparse.shape), order, bounds, parts, now)
        for part in parts:
            if not isinstance(part, torch.Tensor):  # the round trip proper, not the time until the trainer looks
                part.add_done_callback(lambda _f, lk=lk: lk.answered.append(time.perf_counter()))
        return lk

    def _split(self, uniq: torch.Tensor) -> dict:
        """Lookup fields of the exchange path: where each distinct row lives (batch_rows.split_rows)."""
        return split_rows(uniq, self.hot, self._is_local, self._local_servers)

    def _fetch_exchange(self, uniq: torch.Tensor, inverse: torch.Tensor) -> Lookup:
        """The batch's remote rows as one request to the exchange (it splits them by node); local shards at wait."""
        lk = Lookup(uniq, inverse, uniq, [], [], time.perf_counter(), **self._split(uniq))
        remote_idx = lk.remote_idx
        if remote_idx.numel():
            with self._lock:
                self.stats.bytes_sent += remote_idx.numel() * 8
            lk.remote = self.exchange.lookup(uniq[remote_idx])
            lk.remote.add_done_callback(lambda _f: lk.answered.append(time.perf_counter()))
        return lk

    def _wait_exchange(self, lk: Lookup) -> torch.Tensor:
        rows = torch.empty(lk.uniq.numel(), self.dim)
        versions = torch.empty(lk.uniq.numel(), dtype=torch.int64)
        for s, idx, ids in lk.local:
            rows[idx], versions[idx] = self.servers[s].lookup(ids)
        if lk.hot is not None:
            rows[lk.hot[0]], versions[lk.hot[0]] = self.hot.shard.lookup(lk.hot[1])
        blocked = 0.0
        remote = lk.remote_idx.numel()
        if lk.remote is not None:
            t0 = time.perf_counter()
            got_rows, got_versions = self._wait(lk.remote, self._first_remote(lk), "a lookup")
            blocked = time.perf_counter() - t0
            rows[lk.remote_idx], versions[lk.remote_idx] = got_rows, got_versions
        lk.rows, lk.versions, lk.remote = rows, versions, None
        stale = self.exchange.take_stale()
        with self._lock:
            st = self.stats
            st.count(blocked, lk.uniq.numel(), remote, stale, remote * (self.dim * 4 + 8))
            st.stale_remote += stale
            st.hot_rows += lk.hot[0].numel() if lk.hot is not None else 0
            if remote:
                st.rpc_s += (lk.answered[0] if lk.answered else time.perf_counter()) - lk.issued
                st.rpc_calls += 1
        return rows

    def _first_remote(self, lk: Lookup) -> int:
        """A remote server of the lookup (errors name it: with two nodes, the only other one)."""
        return int(lk.uniq[lk.remote_idx[0]] % self.hash.servers)

    def _push_exchange(self, lk: Lookup, grads: torch.Tensor) -> None:
        stale = 0
        for s, idx, ids in lk.local:
            stale += self.servers[s].apply(ids, grads.index_select(0, idx), lk.versions[idx])
        if lk.hot is not None and lk.hot[0].numel():
            idx, slots = lk.hot
            stale += self.hot.shard.apply(slots, grads.index_select(0, idx), lk.versions[idx])
        r = lk.remote_idx
        if r.numel():
            self.exchange.push(lk.uniq[r], grads.index_select(0, r), lk.versions[r])
        with self._lock:
            st = self.stats
            st.bytes_sent += r.numel() * (16 + self.dim * 4)
            st.pushes += 1
            st.stale_sum += stale
            st.stale_rows += lk.uniq.numel()

    def _distinct(self, sparse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return distinct_rows(sparse, self.offsets)

    def _by_server(self, uniq: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """A permutation of `uniq` grouping it by server, and each server's (server, lo, hi) range in it."""
        owner = uniq % self.hash.servers
        order = torch.argsort(owner, stable=True)
        bounds, lo = [], 0
        for s, n in enumerate(torch.bincount(owner, minlength=self.hash.servers).tolist()):
            if n:
                bounds.append((s, lo, lo + n))
                lo += n
        return order, bounds

    def fetch_group(self, sparses: list[torch.Tensor]) -> list[Lookup]:
        """One lookup for several batches (one message per server for all of them), and a Lookup per batch that
        takes its rows from it."""
        if len(sparses) == 1:
            return [self.fetch(sparses[0])]
        union = self.fetch(torch.cat(sparses))
        out = []
        for sparse in sparses:
            uniq, inverse = self._distinct(sparse)
            within = (union, torch.searchsorted(union.uniq, uniq))
            if self.exchange is not None:  # the batch's own local/remote split, for its push
                out.append(Lookup(uniq, inverse, uniq, [], [], union.issued, within=within, **self._split(uniq)))
                continue
            order, bounds = self._by_server(uniq)
            out.append(Lookup(uniq, inverse, order, bounds, [], union.issued, within=within))
        return out

    def wait(self, lk: Lookup) -> torch.Tensor:
        """The batch's distinct rows [U, dim] (in `lk.uniq` order), waiting for the remote parts."""
        if lk.rows is not None:
            return lk.rows
        if lk.within is not None:
            union, pos = lk.within
            lk.rows, lk.versions = self.wait(union).index_select(0, pos), union.versions.index_select(0, pos)
            return lk.rows
        if lk.local is not None:
            return self._wait_exchange(lk)
        blocked = 0.0
        rows = torch.empty(lk.uniq.numel(), self.dim)
        versions = torch.empty(lk.uniq.numel(), dtype=torch.int64)
        remote = received = calls = stale = 0
        for (s, lo, hi), part in zip(lk.bounds, lk.parts):
            if isinstance(part, torch.Tensor):
                part = self.servers[s].lookup(part)
            else:
                t0 = time.perf_counter()
                pushed_stale, *part = self._wait(part, s, "a lookup")
                blocked += time.perf_counter() - t0
                stale += pushed_stale
                remote += hi - lo
                calls += 1
                received += part[0].numel() * part[0].element_size() + part[1].numel() * 8
            idx = lk.order[lo:hi]
            rows[idx] = part[0]
            versions[idx] = part[1]
        lk.rows, lk.versions, lk.parts = rows, versions, []
        with self._lock:
            st = self.stats
            st.count(blocked, lk.uniq.numel(), remote, stale, received)
            st.stale_remote += stale
            answered = list(lk.answered)[:calls]  # a callback may still be on its way: count it as answered now
            now = time.perf_counter()
            st.rpc_s += sum(t - lk.issued for t in answered) + (calls - len(answered)) * (now - lk.issued)
            st.rpc_calls += calls
        return rows

    def snapshot(self) -> torch.Tensor:
        """The whole tables [rows, dim] in global row order: local shards copied, remote ones fetched whole (one
        message per server)."""
        S = self.hash.servers
        out = torch.empty(self.hash.total_rows, self.dim)
        remote = [s for s, server in enumerate(self.servers) if not isinstance(server, Shard)]
        if self.exchange is not None:  # every row of the shard, as one lookup
            futures = [self.exchange.lookup(torch.arange(self.hash.shard_rows(s)) * S + s) for s in remote]
        else:
            futures = [rpc.rpc_async(self.servers[s], _rpc_rows, args=(s,)) for s in remote]
        for s, server in enumerate(self.servers):
            if isinstance(server, Shard):
                out[s::S] = server.weight
        for s, future in zip(remote, futures):
            got = self._wait(future, s, "a snapshot of its rows")
            out[s::S] = got[0] if self.exchange is not None else got
        if self.hot is not None:  # the owners' copies of the hot rows are not trained: the node's replica is
            out[self.hot.ids] = self.hot.shard.weight
        return out

    def lookup(self, sparse: torch.Tensor) -> torch.Tensor:
        """Embedding vectors [B, num_tables, dim] of a batch, synchronously (evaluation)."""
        lk = self.fetch(sparse)
        return self.wait(lk)[lk.inverse]

    def prefetching(self, batches: Iterable[Any], depth: int = 1) -> Iterator[tuple[Any, Lookup]]:
        """(batch, its lookup) pairs, the lookups of the next `depth` batches issued before the current one is
        handed out (deeper hides longer round trips; each batch of depth makes the rows one batch staler), `group`
        batches per message."""
        if depth < 1:
            raise ValueError(f"prefetch depth={depth!r} must be >= 1")
        it = iter(batches)
        ahead: collections.deque = collections.deque()
        done = False
        while True:
            while not done and len(ahead) <= depth:  # keep `depth` batches fetched beyond the one handed out
                group = list(itertools.islice(it, self.group))
                done = len(group) < self.group
                if group:
                    ahead.extend(zip(group, self.fetch_group([b.sparse for b in group])))
            if not ahead:
                return
            yield ahead.popleft()

    # -- updates ----------------------------------------------------------------------------------------
    def push(self, lk: Lookup, grads: torch.Tensor) -> None:
        """Apply the gradient of each distinct row of `lk` ([U, dim]): local shards now; remote rows queued on the
        exchange (its next round), or with RPC to ride on the next lookup sent to their server (sent alone once
        `max_inflight` batches of pushes are queued)."""
        if self.exchange is not None:
            return self._push_exchange(lk, grads)
        stale = 0
        alone: list = []
        with self._lock:
            for s, lo, hi in lk.bounds:
                idx = lk.order[lo:hi]
                ids = lk.uniq[idx] // self.hash.servers
                g, v = grads.index_select(0, idx), lk.versions[idx]
                if isinstance(self.servers[s], Shard):
                    stale += self.servers[s].apply(ids, g, v)
                    continue
                queue = self._pending.setdefault(s, [])
                queue.append((ids, g, v))
                if len(queue) >= max(self.max_inflight, 2 * self.group):
                    alone.append((s, self._pending.pop(s)))
            st = self.stats
            st.pushes += 1
            st.stale_sum += stale
            st.stale_rows += lk.uniq.numel()
        self._send_alone(alone)

    def _send_alone(self, batches: list) -> None:
        """Send queued pushes without a lookup; at most `max_inflight` such messages stay unanswered."""
        if not batches:
            return
        futures = [(s, rpc.rpc_async(self.servers[s], _rpc_push, args=(s, pushes))) for s, pushes in batches]
        with self._lock:
            self.stats.bytes_sent += sum(_push_bytes(p) for _, p in batches)
            self.stats.push_calls += len(futures)
            self.stats.messages += len(futures)
            self._inflight.extend(futures)
            excess = [self._inflight.popleft() for _ in range(max(0, len(self._inflight) - self.max_inflight))]
        self._retire(excess)

    def _wait(self, future: Any, server: int, what: str) -> Any:
        try:
            return future.wait()
        except RuntimeError as e:
            raise ServerLost(f"embedding server {self.labels[server]} did not answer {what}: {e}") from None

    def _retire(self, futures: list) -> None:
        stale = sum(int(self._wait(f, s, "a gradient push")) for s, f in futures)
        with self._lock:
            self.stats.stale_sum += stale
            self.stats.stale_remote += stale

    def flush(self) -> None:
        """Send every queued push and wait for all of them (before reading the tables or reporting)."""
        if self.exchange is not None:
            ex = self.exchange
            ex.flush()
            with self._lock:
                st = self.stats
                stale = ex.take_stale()
                st.stale_sum += stale
                st.stale_remote += stale
                st.rounds, st.messages, st.wire_bytes = ex.rounds, ex.rounds * (ex.n - 1), ex.bytes_sent
                st.exchange_cpu_s = ex.cpu_s
                if self.hot_sync is not None:
                    hs = self.hot_sync
                    stale = hs.take_stale()
                    st.stale_sum += stale
                    st.stale_hot_sync += stale
                    st.hot_syncs, st.hot_sync_cpu_s, st.hot_sync_bytes = hs.syncs, hs.cpu_s, hs.bytes_sent
                    st.hot_sync_interval_s, st.hot_sync_longest_gap_s = hs.interval_sum, hs.longest_gap
            return
        with self._lock:
            queued = list(self._pending.items())
            self._pending.clear()
        self._send_alone(queued)
        with self._lock:
            futures = list(self._inflight)
            self._inflight.clear()
        self._retire(futures)

    def close(self) -> None:
        """This client is done: the lookup exchange (if any) serves the other nodes until they are done too."""
        if self.exchange is not None:
            self.exchange.close()
