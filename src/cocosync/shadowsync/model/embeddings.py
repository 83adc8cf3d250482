"""The trainer's client of the embedding tables: a batch's distinct rows from this node's shards (read and updated
in place, shared memory), the node's replica of the hot rows, and the other nodes' servers through one transport
(transport.py); the row-level autograd gather.

`ShardedEmbeddings.fetch` issues a lookup and returns at once; `prefetching(batches)` requests the next batches' rows
while the current batch trains (ShadowSync's idea on the sparse side); `push` applies row gradients, the remote ones
through the transport. Each row carries a version: a push reports how many updates its rows received between their
fetch and its gradient (the staleness of asynchronous lookups).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import torch

from cocosync.shadowsync.model.batch_rows import distinct_rows, split_rows
from cocosync.shadowsync.model.lookup_thread import ExchangeLost, TransportClosed
from cocosync.shadowsync.model.shard import RowHash, Shard
from cocosync.shadowsync.model.transport import RemoteRows, ServerLost, TransportCounters

if TYPE_CHECKING:
    from cocosync.shadowsync.model.hot_rows import HotRows, HotSync

__all__ = ["ShardedEmbeddings", "Lookup", "LookupStats", "ServerLost", "gather_rows"]

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
    """One batch's lookup in flight: distinct global rows, where each batch entry points, and where each row lives."""

    uniq: torch.Tensor  # distinct global rows, sorted
    inverse: torch.Tensor  # [B, F]: index into uniq
    issued: float
    # (server, positions in uniq, local rows) per local shard; the hot rows' (positions in uniq, slots in the node's
    # replica); the remote rows' positions in uniq
    local: list[tuple[int, torch.Tensor, torch.Tensor]]
    hot: tuple[torch.Tensor, torch.Tensor] | None
    remote_idx: torch.Tensor
    remote: Any = None  # the transport's Future of the remote rows' (rows, versions); None: none, or arrived
    rows: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    answered: list[float] = field(default_factory=list)  # when the remote rows arrived (the transport's thread)
    within: tuple[Lookup, torch.Tensor] | None = None  # (the lookup of a group of batches, uniq's positions in it)


class ShardedEmbeddings:
    """The tables of a run, sharded by `RowHash` over `servers`: each entry a local `Shard` (same node, shared
    memory, read and updated in place) or a label of a server on another node, whose rows go through `remote`."""

    def __init__(self, table_rows: Sequence[int], dim: int, servers: Sequence[Shard | str], *,
                 remote: RemoteRows | None = None, labels: Sequence[str] | None = None, group: int = 1,
                 hot: HotRows | None = None, hot_sync: HotSync | None = None, start_window: int = 0,
                 awaiting: bool = False):
        """`remote`: the transport to the other nodes' servers (transport.py; None: every server is local);
        `labels`: how errors name each server (default: its entry); `group`: batches whose lookups go in one request
        when prefetching (fewer messages, staler rows); `hot`: the node's replica of the hot rows, read and updated
        in place (hot_rows.py); `hot_sync`: its sync, on the node's first trainer (its staleness and costs are
        reported here); `start_window`: the first lookups whose wait is also counted apart (the first rounds' wait,
        `LookupStats.start_wait_s`). `awaiting`: servers on other nodes and no transport yet (machines that have not
        joined the job: `adopt` takes their shards, and the transport to the machines here, before the first lookup;
        a lookup before that fails with ExchangeLost)."""
        self.table_rows, self.dim = [int(r) for r in table_rows], int(dim)
        self.servers = list(servers)
        self.labels = list(labels) if labels is not None else [
            s if isinstance(s, str) else f"local shard {i}" for i, s in enumerate(self.servers)]
        self.hash = RowHash(sum(self.table_rows), len(self.servers))
        offsets = [0]
        for r in self.table_rows[:-1]:
            offsets.append(offsets[-1] + r)
        self.offsets = torch.tensor(offsets, dtype=torch.int64)
        if group < 1:
            raise ValueError(f"group={group!r} must be >= 1 batch per message")
        self._place()
        if remote is None and len(self._local_servers) < len(self.servers) and not awaiting:
            raise ValueError("servers on other nodes need a transport (remote=)")
        if hot is not None and remote is None and not awaiting:
            raise ValueError("replicated hot rows need the lookup exchange (a transport to the other nodes)")
        self.group, self.remote = group, remote
        self.hot = hot if hot is not None and len(hot) else None
        self.hot_sync = hot_sync
        self.stats = LookupStats(start_window=start_window)
        self._no_offsets: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.on_lost: Callable[[BaseException], bool] | None = None
        self._ended: TransportCounters | None = None  # a transport given up (adopt): its last counters

    # -- servers lost with their machine ----------------------------------------------------------------------
    def adopt(self, shards: dict[int, Shard], remote: RemoteRows | None = None) -> None:
        """Take `shards` (restored copies of other machines' servers, in this machine's shared memory) as local: their
        rows are read and updated in place from now on. `remote`: the transport to the other machines, which replaces
        the one that broke (or, a machine joined, the one before, or none); without it, once every server is local
        the transport is given up (a transport given up keeps its counters). Lookups issued before keep their remote
        part: `wait` reads it here, or asks the new transport, when the old one fails them (`on_lost`)."""
        with self._lock:
            for s, shard in shards.items():
                self.servers[s] = shard
            self._place()
            if remote is not None or len(self._local_servers) == len(self.servers):
                if self.remote is not None:
                    c = self.remote.counters()
                    self._ended = c if self._ended is None else self._ended + c
                self.remote = remote

    def _place(self) -> None:
        """Which servers are local: one attribute, replaced whole (workers place rows while `adopt` runs)."""
        local = [s for s, server in enumerate(self.servers) if isinstance(server, Shard)]
        self._placement = (torch.tensor([isinstance(server, Shard) for server in self.servers]), local)

    @property
    def _local_servers(self) -> list[int]:
        return self._placement[1]

    def _recovered(self, err: BaseException) -> bool:
        """Whether the servers that `err` says are out of reach are local now (`on_lost(err)`: the job's handler,
        which restores them; None: no handler, the error stands)."""
        return self.on_lost is not None and self.on_lost(err)

    def _resplit(self, lk: Lookup) -> None:
        """Place `lk`'s rows again (some servers were adopted since it was issued) and ask the transport that replaced
        the broken one for the rows still remote."""
        split = self._split(lk.uniq)
        lk.local, lk.hot, lk.remote_idx, lk.remote = split["local"], split["hot"], split["remote_idx"], None
        if lk.remote_idx.numel():
            if self.remote is None:
                raise ExchangeLost("rows of another machine's servers are left with no transport to reach them")
            lk.remote = self.remote.lookup(lk.uniq[lk.remote_idx])

    # -- lookups ----------------------------------------------------------------------------------------
    def fetch(self, ids: torch.Tensor) -> Lookup:
        """Start the lookup of a batch's global rows (any 2-d shape: [B, features], or [ids, 1]): its remote rows as
        one request to the transport; local shards and hot rows are read at `wait` (fresher rows than at the
        prefetch)."""
        uniq, inverse = distinct_rows(ids, self._zeros(ids))
        lk = Lookup(uniq, inverse.view(ids.shape), time.perf_counter(), **self._split(uniq))
        remote_idx = lk.remote_idx
        if remote_idx.numel():
            remote = self.remote
            if remote is None:  # (adopted while this lookup was placed)
                self._resplit(lk)
                return lk
            with self._lock:
                self.stats.bytes_sent += remote_idx.numel() * 8
            try:
                lk.remote = self._replaced(remote, lambda t: t.lookup(uniq[remote_idx]))
            except ExchangeLost as e:
                if not self._recovered(e):
                    raise
                self._resplit(lk)
                return lk
            lk.remote.add_done_callback(lambda _f: lk.answered.append(time.perf_counter()))
        return lk

    def _zeros(self, ids: torch.Tensor) -> torch.Tensor:
        """No per-column offsets (the ids are global rows already), one per column of `ids`."""
        cols = ids.shape[1]
        zeros = self._no_offsets.get(cols)
        if zeros is None:
            zeros = self._no_offsets[cols] = torch.zeros(cols, dtype=torch.int64)
        return zeros

    def _split(self, uniq: torch.Tensor) -> dict:
        """Where each distinct row lives (batch_rows.split_rows): local shards, hot rows, remote."""
        is_local, local = self._placement
        return split_rows(uniq, self.hot, is_local, local)

    def fetch_group(self, sparses: list[torch.Tensor]) -> list[Lookup]:
        """One lookup for several batches' global rows (one request for all of them), and a Lookup per batch that
        takes its rows from it."""
        if len(sparses) == 1:
            return [self.fetch(sparses[0])]
        union = self.fetch(torch.cat(sparses))
        out = []
        for ids in sparses:
            uniq, inverse = distinct_rows(ids, self._zeros(ids))
            within = (union, torch.searchsorted(union.uniq, uniq))
            out.append(Lookup(uniq, inverse.view(ids.shape), union.issued, within=within, **self._split(uniq)))
        return out

    def wait(self, lk: Lookup) -> torch.Tensor:
        """The batch's distinct rows [U, dim] (in `lk.uniq` order), waiting for the remote ones."""
        if lk.rows is not None:
            return lk.rows
        if lk.within is not None:
            union, pos = lk.within
            lk.rows, lk.versions = self.wait(union).index_select(0, pos), union.versions.index_select(0, pos)
            return lk.rows
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
            try:
                got_rows, got_versions = self._wait(lk.remote, self._first_remote(lk), "a lookup")
            except ServerLost as e:
                if not self._recovered(e):
                    raise
                self._resplit(lk)
                return self.wait(lk)
            blocked = time.perf_counter() - t0
            rows[lk.remote_idx], versions[lk.remote_idx] = got_rows, got_versions
        lk.rows, lk.versions, lk.remote = rows, versions, None
        stale = self.remote.take_stale() if self.remote is not None else 0
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

    def _wait(self, future: Any, server: int, what: str) -> Any:
        try:
            return future.wait()
        except ServerLost:
            raise
        except RuntimeError as e:
            raise ServerLost(f"embedding server {self.labels[server]} did not answer {what}: {e}") from None

    def snapshot(self) -> torch.Tensor:
        """The whole tables [rows, dim] in global row order: local shards copied, remote ones fetched whole (one
        request per server)."""
        S = self.hash.servers
        out = torch.empty(self.hash.total_rows, self.dim)
        remote = [s for s, server in enumerate(self.servers) if not isinstance(server, Shard)]
        futures = [self.remote.lookup(torch.arange(self.hash.shard_rows(s)) * S + s) for s in remote]
        for s in self._local_servers:
            out[s::S] = self.servers[s].weight
        for s, future in zip(remote, futures):
            out[s::S] = self._wait(future, s, "a snapshot of its rows")[0]
        if self.hot is not None:  # the owners' copies of the hot rows are not trained: the node's replica is
            out[self.hot.ids] = self.hot.shard.weight
        return out

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows [*ids.shape, dim] of global rows `ids`, synchronously (evaluation)."""
        lk = self.fetch(ids)
        return self.wait(lk)[lk.inverse]

    def prefetching(self, batches: Iterable[Any], ids_of: Callable[[Any], torch.Tensor],
                    depth: int = 1) -> Iterator[tuple[Any, Lookup]]:
        """(batch, its lookup) pairs, the lookups of the next `depth` batches issued before the current one is
        handed out (deeper hides longer round trips; each batch of depth makes the rows one batch staler), `group`
        batches per request; `ids_of(batch)`: its global rows."""
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
                    ahead.extend(zip(group, self.fetch_group([ids_of(b) for b in group])))
            if not ahead:
                return
            yield ahead.popleft()

    # -- updates ----------------------------------------------------------------------------------------
    def push(self, lk: Lookup, grads: torch.Tensor) -> None:
        """Apply the gradient of each distinct row of `lk` ([U, dim]): local shards and hot rows now, remote rows
        through the transport."""
        stale = 0
        for s, idx, ids in lk.local:
            stale += self.servers[s].apply(ids, grads.index_select(0, idx), lk.versions[idx])
        if lk.hot is not None and lk.hot[0].numel():
            idx, slots = lk.hot
            stale += self.hot.shard.apply(slots, grads.index_select(0, idx), lk.versions[idx])
        r = lk.remote_idx
        if r.numel():
            rows, g, v = lk.uniq[r], grads.index_select(0, r), lk.versions[r]
            try:
                remote = self.remote
                if remote is None:  # (adopted since the lookup: its servers are local now)
                    raise ExchangeLost("the transport was given up")
                self._replaced(remote, lambda t: t.push(rows, g, v))
            except ExchangeLost as e:
                if self.remote is not None and not self._recovered(e):
                    raise
                stale += self._apply_after_loss(rows, g, v)
        with self._lock:
            st = self.stats
            st.bytes_sent += r.numel() * (16 + self.dim * 4)
            st.pushes += 1
            st.stale_sum += stale
            st.stale_rows += lk.uniq.numel()

    def _replaced(self, remote: RemoteRows, call: Callable[[RemoteRows], Any]) -> Any:
        """`call(remote)`, or, where `remote` was replaced while this worker held it (a machine joined: the old
        transport closes), `call` on the transport that replaced it."""
        while True:
            try:
                return call(remote)
            except TransportClosed:
                now = self.remote
                if now is remote:  # (not replaced: the job's end)
                    raise
                if now is None:  # (given up: every server is local now)
                    raise ExchangeLost("the transport was given up") from None
                remote = now

    def _apply_after_loss(self, rows: torch.Tensor, grads: torch.Tensor, versions: torch.Tensor) -> int:
        """Apply gradients of global rows after a machine's loss: those of servers local now here (their summed
        staleness), the rest through the transport that replaced the broken one."""
        stale = 0
        split = self._split(rows)
        for s, idx, ids in split["local"]:
            stale += self.servers[s].apply(ids, grads.index_select(0, idx), versions[idx])
        r = split["remote_idx"]
        if r.numel() and self.remote is not None:
            self.remote.push(rows[r], grads.index_select(0, r), versions[r])
        return stale

    def flush(self) -> None:
        """Every queued push applied on its server (before reading the tables or reporting), and the transport's
        counters in `stats`. Pushes queued to a transport that broke are lost when `on_lost` restored its
        servers."""
        remote = self.remote
        if remote is None and self._ended is None:
            return
        if remote is not None:
            try:
                remote.flush()
            except ExchangeLost as e:
                if not self._recovered(e):
                    raise
        remote = self.remote
        c = self._ended if remote is None else remote.counters() if self._ended is None else \
            self._ended + remote.counters()
        with self._lock:
            st = self.stats
            stale = remote.take_stale() if remote is not None else 0
            st.stale_sum += stale
            st.stale_remote += stale
            st.rounds, st.messages, st.wire_bytes, st.exchange_cpu_s = c.rounds, c.messages, c.wire_bytes, c.cpu_s
            st.push_calls = c.push_calls
            if self.hot_sync is not None:
                hs = self.hot_sync
                stale = hs.take_stale()
                st.stale_sum += stale
                st.stale_hot_sync += stale
                st.hot_syncs, st.hot_sync_cpu_s, st.hot_sync_bytes = hs.syncs, hs.cpu_s, hs.bytes_sent
                st.hot_sync_interval_s, st.hot_sync_longest_gap_s = hs.interval_sum, hs.longest_gap

    def close(self) -> None:
        """This client is done: its transport (an exchange serves the other nodes until they are done too)."""
        remote = self.remote
        if remote is not None:
            try:
                remote.close()
            except ExchangeLost as e:  # (a machine lost while this trainer was done with its lookups)
                if not self._recovered(e):
                    raise
