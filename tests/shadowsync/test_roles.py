"""Roles: every rank's role from torchrun's numbering, and where each trainer sits (machine, local index)."""

import pytest

from cocosync.runtime.comm.topology import Topology
from cocosync.shadowsync.errors import ConfigError
from cocosync.shadowsync.job.roles import Roles


def _roles(nnodes: int, nproc: int, embedding: int, sync: int) -> Roles:
    return Roles(Topology(rank=0, world_size=nnodes * nproc, local_rank=0, local_world_size=nproc, node=0),
                 embedding, sync)


@pytest.mark.parametrize("nnodes,nproc,embedding,sync", [(1, 3, 1, 0), (2, 3, 1, 0), (3, 5, 1, 1), (4, 4, 2, 0)])
def test_each_trainer_sits_on_the_machine_of_its_rank_at_its_local_index(nnodes, nproc, embedding, sync):
    roles = _roles(nnodes, nproc, embedding, sync)
    per_node = nproc - embedding - sync
    assert roles.trainers == nnodes * per_node
    trainers = roles.ranks("trainer")
    assert len(trainers) == roles.trainers
    for t, rank in enumerate(trainers):
        assert roles.role(rank) == ("trainer", t)
        assert roles.machine_of(t) == roles.node_of(rank)
        assert roles.trainer_at(roles.machine_of(t), roles.slot_of(t)) == t
        assert roles.is_first(t) == (t == roles.trainers_of(roles.machine_of(t))[0])
        assert roles.rank_of("trainer", t) == rank
    assert sorted(t for n in range(nnodes) for t in roles.trainers_of(n)) == list(range(roles.trainers))
    # a machine's local trainers in the order of their ranks: servers first, then trainers
    assert [roles.node_of(r) for r in trainers] == sorted(roles.node_of(r) for r in trainers)
    assert roles.ranks("embedding") == [n * nproc + i for n in range(nnodes) for i in range(embedding)]


def test_a_node_with_no_room_for_a_trainer_is_refused_naming_the_counts():
    with pytest.raises(ConfigError, match="--nproc-per-node=2 leaves no trainer.*expected nproc-per-node >= 3"):
        _roles(2, 2, 1, 1)
