"""The process's shared-memory communicators, created on first use and shared by every compiled program: one over
the whole job, and one per node-local subgroup (e.g. the tensor-parallel ranks of a pipeline stage)."""

from __future__ import annotations

import torch.distributed as dist

from cocosync.runtime.comm.collectives import ShmCommunicator
from cocosync.runtime.comm.topology import NodeGroups, subgroup_node_groups

__all__ = ["shared_communicator", "group_communicator", "register_subgroup"]

_WORLD: list[ShmCommunicator] = []
_GROUPS: dict[tuple[int, ...], ShmCommunicator | None] = {}  # by the members' global ranks
_SPANNING: dict[tuple[int, ...], NodeGroups] = {}  # subgroups across nodes, their groups made by the job


def register_subgroup(groups: NodeGroups) -> None:
    """Let programs over the subgroup `groups.members` (spanning nodes) use a hierarchical shared-memory
    communicator: shared memory among each node's members, `groups.inter` between nodes. Local, before compiling."""
    _SPANNING[tuple(groups.members)] = groups


def shared_communicator() -> ShmCommunicator:
    """This process's ShmCommunicator over the whole job (created on first use: a collective call)."""
    if not _WORLD:
        _WORLD.append(ShmCommunicator())
    return _WORLD[0]


def group_communicator(members: list[int], group: dist.ProcessGroup) -> ShmCommunicator | None:
    """A ShmCommunicator over a subgroup whose members all live on this node, or span nodes as registered
    (register_subgroup); None otherwise. Created on first use (collective over the members) and shared by every
    program over the same members."""
    key = tuple(members)
    if key not in _GROUPS:
        ng = _SPANNING.get(key) or subgroup_node_groups(list(members), group)
        _GROUPS[key] = ShmCommunicator(ng) if ng is not None else None
    return _GROUPS[key]
