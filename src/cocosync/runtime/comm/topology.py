"""Node topology from the torchrun environment, and the intra-/inter-node process groups built from it.

torchrun numbers ranks node by node: global rank = node * local_world_size + local_rank. The *intra* group holds
the ranks of this node (they share memory); the *inter* group holds the ranks with this rank's local rank on
every node (one per node): a hierarchical collective goes intra (shared memory), then inter (torch.distributed),
then intra again.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["Topology", "NodeGroups", "topology_from_env", "topology_from_group", "machine_id", "node_groups",
           "subgroup_node_groups"]


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise RuntimeError(f"environment variable {name} is not set: launch with torchrun or RankPool")
        return default
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """Where this process sits: global rank, node, local rank (torchrun numbering)."""

    rank: int
    """Global rank, 0 <= rank < world_size."""
    world_size: int
    """Number of ranks in the job."""
    local_rank: int
    """Rank within this node."""
    local_world_size: int
    """Ranks per node (the same on every node)."""
    node: int
    """Index of this node (GROUP_RANK), 0 <= node < nnodes."""

    def __post_init__(self) -> None:
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ValueError(f"local_world_size={self.local_world_size} must divide world_size={self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"local_rank={self.local_rank} is outside [0, {self.local_world_size})")
        if self.rank != self.node * self.local_world_size + self.local_rank:
            raise ValueError(f"rank={self.rank} is not node*local_world_size+local_rank = "
                             f"{self.node}*{self.local_world_size}+{self.local_rank}: ranks must be numbered node "
                             "by node")

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size

    def global_rank(self, local_rank: int, node: int | None = None) -> int:
        """Global rank of `local_rank` on `node` (this node by default)."""
        return (self.node if node is None else node) * self.local_world_size + local_rank

    @property
    def local_ranks_global(self) -> list[int]:
        """Global ranks of this node's ranks, in local-rank order."""
        return [self.global_rank(lr) for lr in range(self.local_world_size)]


def topology_from_env() -> Topology:
    """Read RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (and GROUP_RANK) as torchrun sets them.

    Without them (a plain single process) the topology is one rank on one node.
    """
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    local_rank = _env_int("LOCAL_RANK", rank % local_world)
    node = _env_int("GROUP_RANK", rank // local_world)
    return Topology(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world, node=node)


def machine_id() -> str:
    """What two processes must share to share memory: the kernel (boot id), the /dev/shm mount and the network
    namespace (simulated machines on one host differ in the last two)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    st = os.stat("/dev/shm") if os.path.isdir("/dev/shm") else None
    shm = f"{st.st_dev}:{st.st_ino}" if st else ""
    try:
        net = os.readlink("/proc/self/ns/net")
    except OSError:
        net = ""
    return f"{boot}|{shm}|{net}"


def topology_from_group() -> Topology:
    """Rank, world and node layout from the initialized default process group, for processes not started by torchrun
    (mp.spawn + init_process_group(init_method="tcp://...")): the ranks exchange `machine_id()`s; a node is the
    ranks sharing one. Collective over the default group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ids: list[Any] = [None] * world
    dist.all_gather_object(ids, machine_id())
    machines = list(dict.fromkeys(ids))  # in order of their lowest rank
    local = [r for r in range(world) if ids[r] == ids[rank]]
    sizes = {ids.count(m) for m in machines}
    numbered = all(ids[r] == machines[r // len(local)] for r in range(world)) if len(sizes) == 1 else False
    if not numbered:
        raise RuntimeError(f"ranks are not numbered machine by machine with the same count on each (machines of ranks "
                           f"0..{world - 1}: {[machines.index(i) for i in ids]}): launch with torchrun, or give "
                           "consecutive ranks to the processes of one machine")
    return Topology(rank=rank, world_size=world, local_rank=local.index(rank), local_world_size=len(local),
                    node=machines.index(ids[rank]))


@dataclass(eq=False)
class NodeGroups:
    """Topology plus the torch.distributed groups a hierarchical collective needs, and a job id agreed by all ranks."""

    topo: Topology
    job_id: str
    """Short id shared by every rank of the job: names shared-memory segments uniquely per job."""
    intra: Any = None
    """Process group of this node's ranks (None when torch.distributed is not initialized)."""
    inter: Any = None
    """Process group of the ranks with this local rank, one per node (None when there is a single node)."""
    members: list[int] | None = None
    """Global ranks of a subgroup's members in `topo` order (None: `topo` numbers the job's own ranks)."""
    _cache_key: Any = field(default=None, repr=False)

    @property
    def local_ranks_global(self) -> list[int]:
        """Global ranks (in the job) of the ranks sharing this node's memory, in local-rank order (for messages)."""
        return list(self.members) if self.members is not None else self.topo.local_ranks_global


_groups: dict[Any, NodeGroups] = {}


def _sanitize(s: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_" else "-" for c in s)
    return keep[:40] or "job"


def node_groups(topo: Topology | None = None) -> NodeGroups:
    """The NodeGroups of this process (cached per default process group).

    A collective call on every rank (new_group and the job-id broadcast are collectives) the first time.
    """
    topo = topo or topology_from_env()
    initialized = dist.is_available() and dist.is_initialized()
    key = (id(dist.group.WORLD) if initialized else None, topo)
    cached = _groups.get(key)
    if cached is not None:
        return cached
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if not initialized:
        if topo.world_size != 1:
            raise RuntimeError(f"torch.distributed is not initialized but WORLD_SIZE={topo.world_size}: "
                               "call torch.distributed.init_process_group first")
        ng = NodeGroups(topo=topo, job_id=f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
        _groups[key] = ng
        return ng
    if dist.get_world_size() != topo.world_size or dist.get_rank() != topo.rank:
        # not started by torchrun (or its variables describe another job): ask the process group itself
        topo = topology_from_group()
        key = (key[0], topo)
        if key in _groups:
            return _groups[key]
    # A uuid from rank 0 makes the id unique even when TORCHELASTIC_RUN_ID is absent or reused ("none").
    obj = [f"{_sanitize(run_id)}-{uuid.uuid4().hex[:8]}" if run_id and run_id != "none" else uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(obj, src=0)
    L, n = topo.local_world_size, topo.nnodes
    intra = inter = None
    # new_group is collective over the whole job and must be called in the same order everywhere.
    for node in range(n):
        g = dist.new_group([node * L + lr for lr in range(L)]) if n > 1 else dist.group.WORLD
        if node == topo.node:
            intra = g
    if n > 1:
        for lr in range(L):
            g = dist.new_group([node * L + lr for node in range(n)])
            if lr == topo.local_rank:
                inter = g
    ng = NodeGroups(topo=topo, job_id=obj[0], intra=intra, inter=inter, _cache_key=key)
    _groups[key] = ng
    return ng


def subgroup_node_groups(members: list[int], group: Any) -> NodeGroups | None:
    """NodeGroups of a torch.distributed subgroup whose `members` (global ranks, in group order) all live on this
    node, numbered 0..len-1 as one single-node job; None when they span nodes, or when the torchrun environment
    does not describe this job (use torch.distributed then).

    Collective over the members only (a job-id broadcast within `group`), so a tensor-parallel group can build it
    without the rest of the job.
    """
    topo = topology_from_env()
    if (topo.world_size, topo.rank) != (dist.get_world_size(), dist.get_rank()):
        return None  # no torchrun environment (or another one): the node of each rank is unknown
    if topo.rank not in members:
        raise ValueError(f"rank {topo.rank} is not a member of the subgroup {members}")
    if any(r // topo.local_world_size != topo.node for r in members):
        return None
    obj = [f"g{members[0]}-{uuid.uuid4().hex[:12]}"]
    if len(members) > 1:
        dist.broadcast_object_list(obj, src=members[0], group=group)
    i, size = members.index(topo.rank), len(members)
    sub = Topology(rank=i, world_size=size, local_rank=i, local_world_size=size, node=0)
    return NodeGroups(topo=sub, job_id=obj[0], intra=group, members=list(members))


def spanning_node_groups(members: list[int], group: Any, intra: Any, inter: Any, local_size: int) -> NodeGroups:
    """NodeGroups of a subgroup spanning nodes, `local_size` members on each, numbered node by node (`members` in
    that order): `intra` holds this node's members, `inter` the members with this member's node-local index (both
    made by the caller, which every rank of the job must do alike). Collective over the members (a job id)."""
    me = members.index(dist.get_rank())
    obj = [f"s{members[0]}-{uuid.uuid4().hex[:12]}"]
    dist.broadcast_object_list(obj, src=members[0], group=group)
    sub = Topology(rank=me, world_size=len(members), local_rank=me % local_size, local_world_size=local_size,
                   node=me // local_size)
    return NodeGroups(topo=sub, job_id=obj[0], intra=intra, inter=inter, members=list(members))
