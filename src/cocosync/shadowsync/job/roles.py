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
from cocosync.shadowsync.errors import ConfigError

__all__ = ["Roles"]


@dataclass(frozen=True)
class Roles:
    """The role of every rank of the job (`topo`: this process, in torchrun's numbering, in a world of the machines
    the job is laid out for). `present`: the machines at the job's start, nodes 0 .. present - 1 (0: all of them);
    the others (`awaited`, --nnodes MIN:MAX) have no ranks until a machine joins in the place of one."""

    topo: Topology
    embedding_per_node: int
    sync_per_node: int
    present: int = 0

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

    @property
    def awaited(self) -> list[int]:
        """The machines of the layout not there at the job's start."""
        return list(range(self.present, self.topo.nnodes)) if self.present else []

    def present_ranks(self, kind: str) -> list[int]:
        """Global ranks of one role on the machines there at the job's start (those in torch's world), in index
        order."""
        return [r for r in self.ranks(kind) if not self.present or self.node_of(r) < self.present]

    def rank_of(self, kind: str, index: int) -> int:
        return self.ranks(kind)[index]

    def node_of(self, rank: int) -> int:
        return rank // self.topo.local_world_size

    # trainers are numbered machine by machine: trainer t is local trainer t % trainers_per_node of its machine

    def machine_of(self, trainer: int) -> int:
        """The machine (node) of trainer index `trainer`."""
        return trainer // self.trainers_per_node

    def slot_of(self, trainer: int) -> int:
        """Trainer `trainer`'s local index on its machine (its lookup exchange and cross-machine sync group)."""
        return trainer % self.trainers_per_node

    def trainer_at(self, node: int, slot: int) -> int:
        """The trainer index of local trainer `slot` of machine `node`."""
        return node * self.trainers_per_node + slot

    def trainers_of(self, node: int) -> list[int]:
        """The trainer indices of machine `node`."""
        return [self.trainer_at(node, i) for i in range(self.trainers_per_node)]

    def is_first(self, trainer: int) -> bool:
        """Whether trainer `trainer` is its machine's first (it syncs the machine's hot rows)."""
        return self.slot_of(trainer) == 0
