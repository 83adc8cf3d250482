"""Who does what in a ShadowSync job launched by torchrun: roles from the torchrun environment.

On every node the local ranks are, in order: `embedding_servers` embedding parameter servers, `sync_servers` sync
parameter servers (EASGD's centre), and trainers for the rest. Counts are **per node**, so every node has the same
shape (torchrun gives every node the same --nproc-per-node): with N nodes and K processes per node there are
N * embedding_servers embedding servers and N * (K - embedding_servers - sync_servers) trainers. Servers come first
so a node's shards are created by the processes that own them.
"""

from __future__ import annotations

from dataclasses import dataclass

from cocosync.runtime.comm.topology import Topology
from cocosync.shadowsync.train_config import ConfigError

__all__ = ["ClusterConfig", "Roles", "TRANSPORTS", "EXCHANGES"]

EXCHANGES = ("exchange", "node-exchange")  # the lookup exchange per trainer, per node
TRANSPORTS = (*EXCHANGES, "rpc")


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """The multi-machine options of a ShadowSync job (on top of its TrainConfig)."""

    embedding_servers: int = 1
    """embedding parameter servers per node (their shards live in the node's shared memory)."""
    sync_servers: int | None = None
    """sync parameter servers per node holding EASGD's centre; None: 1 for EASGD, 0 otherwise."""
    prefetch: int | None = None
    """batches whose embedding rows are requested ahead of the one training (0: none); None: 40 with the lookup
    exchange (its answers come 1-2 rounds later), 2 with RPC."""
    lookup_batches: int = 1
    """batches whose embedding lookups go in one message per server (fewer messages, staler rows)."""
    max_inflight: int = 4
    """row-gradient pushes a trainer may have outstanding before it waits for the oldest."""
    lookup_transport: str = "exchange"
    """how lookups reach other machines' shards: 'exchange' (rounds of one gloo all_to_all between the trainers of
    every node, exchange.py), 'node-exchange' (the same rounds between the first embedding servers of every node,
    which carry their node's trainers' lookups through shared memory: node_relay.py) or 'rpc' (torch.distributed.rpc,
    a message per server and batch: the measured baseline)."""
    exchange_interval: float = 0.040
    """seconds between two rounds of the lookup exchange (shorter: fresher rows, more CPU per example). 40 ms with
    the replicated hot rows: the rows left to the exchange are cold, so a longer round costs them little staleness."""
    hot_rows: int = 4096
    """with the exchange: the rows seen most often in the first training rows, replicated on every node and
    synchronized in the background (hot_rows.py); 0: none."""
    hot_sync_interval: float = 0.040
    """seconds between two syncs of the replicated hot rows (shorter: fresher hot rows, more CPU and bytes); with
    `hot_staleness`, the longest."""
    hot_staleness: float = 0.0
    """> 0: the hot rows' missed updates per use the syncs aim at (hot_rows.py): the interval shrinks from
    `hot_sync_interval` (down to 2 ms) while the other nodes' updates between two syncs exceed it; 0: a fixed
    interval."""
    resume: str | None = None
    """a checkpoint directory (or a run directory: its checkpoints/latest) to continue from."""
    eval_every: int | None = None
    """score trainer 0's replica on the held-out set every this many examples of the job (an eval NE curve)."""
    checkpoint_every: int | None = None
    """also checkpoint every this many examples of the job (each trainer pauses at its share of the mark)."""
    stop_after: int | None = None
    """stop once the job has seen this many examples (earlier sessions included): a checkpoint to resume from."""

    def __post_init__(self) -> None:
        for name in ("embedding_servers", "max_inflight", "lookup_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}={v!r} is invalid: expected an integer >= 1")
        if self.prefetch is None:
            self.prefetch = 40 if self.lookup_transport in EXCHANGES else 2
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or not 0 <= self.prefetch <= 64:
            raise ConfigError(f"prefetch={self.prefetch!r} is invalid: expected an integer in [0, 64]")
        if not isinstance(self.hot_rows, int) or isinstance(self.hot_rows, bool) or self.hot_rows < 0:
            raise ConfigError(f"hot_rows={self.hot_rows!r} is invalid: expected an integer >= 0 (0: no replicated "
                              "rows)")
        for name in ("stop_after", "checkpoint_every", "eval_every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{name}={v!r} is invalid: expected a number of examples >= 1")
        if self.lookup_transport not in TRANSPORTS:
            raise ConfigError(f"lookup_transport={self.lookup_transport!r} is invalid: expected one of {TRANSPORTS}")
        for flag in ("exchange_interval", "hot_sync_interval"):
            v = getattr(self, flag)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                shown = f"{v * 1e3:g} ms" if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)
                raise ConfigError(f"--{flag.replace('_', '-')} {shown} is invalid: expected milliseconds in (0, 1000]")
        v = self.hot_staleness
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1000:
            raise ConfigError(f"--hot-staleness {v!r} is invalid: expected updates per use in [0, 1000] (0: sync "
                              "every --hot-sync-interval)")
        if self.sync_servers is not None and (not isinstance(self.sync_servers, int) or self.sync_servers < 0):
            raise ConfigError(f"sync_servers={self.sync_servers!r} is invalid: expected an integer >= 0")

    def sync_servers_for(self, method: str, nodes: int = 1) -> int:
        """EASGD's sync servers per node for a job of `nodes` machines (ConfigError when the setting cannot run)."""
        if method == "dssync" and nodes > 1:
            raise ConfigError("sync 'dssync' runs on one machine for now (its groups are flat groups; across "
                              "machines use ma, bmuf or easgd)")
        if self.sync_servers is None:
            return 1 if method == "easgd" else 0
        if method == "easgd" and self.sync_servers < 1:
            raise ConfigError("sync_servers=0 is invalid for EASGD: its centre lives on the sync servers "
                              "(--sync-servers >= 1 per node)")
        if method != "easgd" and self.sync_servers > 0:
            raise ConfigError(f"sync_servers={self.sync_servers} is invalid for sync method {method!r}: only EASGD "
                              "has sync servers (MA and BMUF all-reduce among the trainers)")
        return self.sync_servers


@dataclass(frozen=True)
class Roles:
    """The role of every rank of the job (`topo`: this process, in torchrun's numbering)."""

    topo: Topology
    embedding_per_node: int
    sync_per_node: int

    def __post_init__(self) -> None:
        L = self.topo.local_world_size
        if self.trainers_per_node < 1:
            raise ConfigError(f"--nproc-per-node={L} leaves no trainer on a node with embedding_servers="
                              f"{self.embedding_per_node} and sync_servers={self.sync_per_node}: expected "
                              f"nproc-per-node >= {self.embedding_per_node + self.sync_per_node + 1}")

    @property
    def trainers_per_node(self) -> int:
        return self.topo.local_world_size - self.embedding_per_node - self.sync_per_node

    @property
    def trainers(self) -> int:
        return self.trainers_per_node * self.topo.nnodes

    def role(self, rank: int | None = None) -> tuple[str, int]:
        """('embedding' | 'sync' | 'trainer', index among that role, numbered node by node)."""
        rank = self.topo.rank if rank is None else rank
        node, lr = divmod(rank, self.topo.local_world_size)
        E, S = self.embedding_per_node, self.sync_per_node
        if lr < E:
            return "embedding", node * E + lr
        if lr < E + S:
            return "sync", node * S + lr - E
        return "trainer", node * self.trainers_per_node + lr - E - S

    def rpc_name(self, rank: int | None = None) -> str:
        kind, index = self.role(rank)
        return f"{kind}{index}"

    def ranks(self, kind: str) -> list[int]:
        """Global ranks of one role, in index order."""
        return [r for r in range(self.topo.world_size) if self.role(r)[0] == kind]

    def rank_of(self, kind: str, index: int) -> int:
        return self.ranks(kind)[index]

    def node_of(self, rank: int) -> int:
        return rank // self.topo.local_world_size
