"""What a job goes on without (job/survival.py): one rule for the launchers, the monitor and every rank."""

import pytest

from cocosync.shadowsync.config import ClusterConfig, SyncConfig, TrainConfig
from cocosync.shadowsync.job.survival import Survival


def _survival(sync: str = "bmuf", nnodes: int = 2, per_node: int = 2, min_trainers: int = 1,
              transport: str = "exchange", launched: bool = True) -> Survival:
    cfg = TrainConfig(trainers=nnodes * per_node, sync=SyncConfig(algorithm=f"shadow-{sync}"),
                      min_trainers=min_trainers)
    return Survival.of(cfg, ClusterConfig(lookup_transport=transport), nnodes, per_node, launched)


def test_one_machine_goes_on_without_a_trainer_or_server_where_the_sync_re_forms_and_enough_are_left():
    assert _survival(nnodes=1, per_node=4).losses and _survival(nnodes=1, per_node=4).restarts
    assert not _survival("dssync", nnodes=1, per_node=4).losses  # (DS-Sync needs every trainer)
    assert not _survival(nnodes=1, per_node=4, min_trainers=4).trainer_loss
    assert not _survival(nnodes=1, per_node=4, launched=False).losses  # (plain torchrun: no store records it)
    assert _survival(nnodes=1, per_node=4).servers_leave_at_end
    assert not _survival("easgd", nnodes=1, per_node=4).servers_leave_at_end  # (RPC's shutdown waits for them)


@pytest.mark.parametrize("sync,transport,machine,restarts", [
    ("bmuf", "exchange", True, True),
    ("ma", "exchange", True, True),
    ("easgd", "exchange", True, False),  # (its centre is served by RPC: a new process cannot join its world)
    ("bmuf", "rpc", False, False),
    ("bmuf", "node-exchange", False, False),
])
def test_across_machines_a_machine_or_a_lone_trainer_is_survived_with_the_lookup_exchange(sync, transport, machine,
                                                                                            restarts):
    s = _survival(sync, transport=transport)
    assert (s.machine_loss, s.trainer_loss, s.restarts) == (machine, machine, restarts)
    assert not s.losses and not s.servers_leave_at_end  # (the one-machine rules)


def test_across_machines_min_trainers_must_fit_on_one_machine():
    assert _survival(per_node=2, min_trainers=2).machine_loss
    assert not _survival(per_node=2, min_trainers=3).machine_loss
