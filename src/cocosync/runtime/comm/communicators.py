"""The process's shared-memory communicators, created on first use and shared by every compiled program: one over
the whole job, and one per node-local subgroup (e.g. the tensor-parallel ranks of a pipeline stage)."""

from __future__ import annotations

import torch.distributed as dist

from cocosync.runtime.comm.collectives import ShmCommunicator
from cocosync.runtime.comm.topology import subgroup_node_groups

__all__ = ["shared_communicator", "group_communicator"]

_WORLD: list[ShmCommunicator] = []
_GROUPS: dict[tuple[int, ...], ShmCommunicator | None] = {}  # by the members' global ranks


def shared_communicator() -> ShmCommunicator:
    """This process's ShmCommunicator over the whole job (created on first use: a collective call)."""
    if not _WORLD:
        _WORLD.append(ShmCommunicator())
    return _WORLD[0]


def group_communicator(members: list[int], group: dist.ProcessGroup) -> ShmCommunicator | None:
    """A ShmCommunicator over a subgroup whose members all live on this node (None if they span nodes), created
    on first use (collective over the members) and shared by every program over the same members."""
    key = tuple(members)
    if key not in _GROUPS:
        ng = subgroup_node_groups(list(members), group)
        _GROUPS[key] = ShmCommunicator(ng) if ng is not None else None
    return _GROUPS[key]
