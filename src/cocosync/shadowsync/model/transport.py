"""How a trainer's tables reach the rows of other nodes' shards: one interface, `RemoteRows`, and its transports.

- the lookup exchange (exchange.py: rounds of one gloo all_to_all between trainer i of every node), the default;
- the relay to the node's exchange (node_relay.py: the node's first embedding server runs one exchange for the
  node, its trainers hand it their rows through shared-memory rings);
- torch.distributed.rpc (`RpcRows`, here: one message per remote server and lookup, pushes riding on the next
  lookup to their server), the measured baseline.

The tables' client (embeddings.py) reads this node's shards and the replicated hot rows in place and hands every
other row to its transport; `job/lookups.trainer_transport` chooses the transport. A transport's `lookup` returns
a future of (rows, versions), `push` queues row gradients (with the versions the rows had when fetched), and
`take_stale` gives the updates those pushes' rows received in between, once applied.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.distributed.rpc as rpc

from cocosync.shadowsync.model.served import Served
from cocosync.shadowsync.model.shard import Shard

__all__ = ["RemoteRows", "TransportCounters", "RpcRows", "ServerLost", "serve_shard"]


class ServerLost(RuntimeError):
    """A parameter server did not answer (it died, or its machine is unreachable); the message names it."""


@dataclass(frozen=True)
class TransportCounters:
    """What a transport sent to other nodes, for the job's summary."""

    rounds: int = 0  # exchange: rounds run
    messages: int = 0  # messages to other nodes
    wire_bytes: int = 0  # exchange: bytes of those messages
    cpu_s: float = 0.0  # exchange: its thread's CPU
    push_calls: int = 0  # RPC: messages of pushes alone (queue full, or the final flush)

    def __add__(self, other: TransportCounters) -> TransportCounters:
        return TransportCounters(self.rounds + other.rounds, self.messages + other.messages,
                                 self.wire_bytes + other.wire_bytes, self.cpu_s + other.cpu_s,
                                 self.push_calls + other.push_calls)


class RemoteRows(Protocol):
    """Rows of other nodes' shards, by global row (row g on server g % S)."""

    def lookup(self, rows: torch.Tensor) -> torch.futures.Future:
        """The future of (rows [len, dim], their versions)."""
        ...

    def push(self, rows: torch.Tensor, grads: torch.Tensor, versions: torch.Tensor) -> None: ...

    def take_stale(self) -> int:
        """Updates the pushed rows received between their fetch and their gradient, summed since the last call."""
        ...

    def flush(self) -> None:
        """Wait until every push queued so far is applied on its server."""
        ...

    def close(self) -> None: ...

    def counters(self) -> TransportCounters: ...


# ---------------------------------------------------------------------------------------------- RPC: server side
_SERVED: Served[Shard] = Served("embedding server", "a lookup")  # the shards this process serves


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


def _rpc_push(server: int, pushes: list) -> int:
    shard = _SERVED[server]
    return sum(shard.apply(*push) for push in pushes)


# ---------------------------------------------------------------------------------------------- RPC: client side
class RpcRows:
    """Remote rows through torch.distributed.rpc: a lookup sends one message to each server it touches, carrying
    the pushes queued for that server; pushes go alone once `max(max_inflight, 2 * group)` are queued for a server,
    with at most `max_inflight` such messages unanswered. `names[s]`: server s's RPC worker name (None: a local
    shard, never asked here); `labels[s]`: how errors name it (default: its name)."""

    def __init__(self, names: Sequence[str | None], dim: int, *, max_inflight: int = 4, group: int = 1,
                 labels: Sequence[str] | None = None):
        if max_inflight < 1:
            raise ValueError(f"max_inflight={max_inflight!r} must be >= 1")
        self.names, self.dim, self.servers = list(names), int(dim), len(names)
        self.labels = list(labels) if labels is not None else [str(n) for n in names]
        self.max_inflight, self.queue_limit = max_inflight, max(max_inflight, 2 * group)
        self._lock = threading.Lock()
        self._pending: dict[int, list] = {}  # server -> pushes waiting for the next message to it
        self._inflight: collections.deque = collections.deque()
        self._stale = self._messages = self._push_calls = 0

    def _by_server(self, rows: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(server, positions in `rows`) for each server `rows` touch."""
        owner = rows % self.servers
        order = torch.argsort(owner, stable=True)
        out, lo = [], 0
        for s, n in enumerate(torch.bincount(owner, minlength=self.servers).tolist()):
            if n:
                out.append((s, order[lo:lo + n]))
                lo += n
        return out

    def lookup(self, rows: torch.Tensor) -> torch.futures.Future:
        parts = self._by_server(rows)
        futures = []
        for s, idx in parts:
            with self._lock:
                pushes = self._pending.pop(s, [])
                self._messages += 1
            futures.append(rpc.rpc_async(self.names[s], _rpc_push_lookup, args=(s, pushes, rows[idx] // self.servers)))

        def assemble(done: torch.futures.Future) -> tuple[torch.Tensor, torch.Tensor]:
            out = torch.empty(rows.numel(), self.dim)
            versions = torch.empty(rows.numel(), dtype=torch.int64)
            stale = 0
            for (_, idx), f in zip(parts, done.value()):
                pushed_stale, got, got_versions = f.value()
                out[idx], versions[idx] = got, got_versions
                stale += pushed_stale
            with self._lock:
                self._stale += stale
            return out, versions

        return torch.futures.collect_all(futures).then(assemble)

    def push(self, rows: torch.Tensor, grads: torch.Tensor, versions: torch.Tensor) -> None:
        alone = []
        with self._lock:
            for s, idx in self._by_server(rows):
                queue = self._pending.setdefault(s, [])
                queue.append((rows[idx] // self.servers, grads.index_select(0, idx), versions[idx]))
                if len(queue) >= self.queue_limit:
                    alone.append((s, self._pending.pop(s)))
        self._send_alone(alone)

    def _send_alone(self, batches: list) -> None:
        if not batches:
            return
        futures = [(s, rpc.rpc_async(self.names[s], _rpc_push, args=(s, pushes))) for s, pushes in batches]
        with self._lock:
            self._push_calls += len(futures)
            self._messages += len(futures)
            self._inflight.extend(futures)
            excess = [self._inflight.popleft() for _ in range(max(0, len(self._inflight) - self.max_inflight))]
        self._retire(excess)

    def _retire(self, futures: list) -> None:
        stale = 0
        for s, f in futures:
            try:
                stale += int(f.wait())
            except RuntimeError as e:
                raise ServerLost(f"embedding server {self.labels[s]} did not answer a gradient push: {e}") from None
        with self._lock:
            self._stale += stale

    def take_stale(self) -> int:
        with self._lock:
            stale, self._stale = self._stale, 0
            return stale

    def flush(self) -> None:
        with self._lock:
            queued = list(self._pending.items())
            self._pending.clear()
        self._send_alone(queued)
        with self._lock:
            futures = list(self._inflight)
            self._inflight.clear()
        self._retire(futures)

    def close(self) -> None:
        self.flush()

    def counters(self) -> TransportCounters:
        with self._lock:
            return TransportCounters(messages=self._messages, push_calls=self._push_calls)
