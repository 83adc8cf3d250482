"""`--nnodes MIN:MAX`: the range parsed and handed to torchrun, and the ranks' view of a job laid out for MAX machines
of which fewer met (the others awaited)."""

from __future__ import annotations

import pytest

from cocosync.runtime.comm.topology import Topology
from cocosync.shadowsync.config import ConfigError, NodeRange
from cocosync.shadowsync.job.node_launch import LAST_CALL, torchrun_args
from cocosync.shadowsync.job.roles import Roles
from cocosync.shadowsync.job.same_job import JOB_NODES_ENV, job_topology, present_nodes


@pytest.mark.parametrize("text,low,high,shown", [("2", 2, 2, "2"), ("1:2", 1, 2, "1:2"), ("3:3", 3, 3, "3")])
def test_a_number_or_a_range_of_machines_is_read_as_torchrun_reads_it(text, low, high, shown):
    machines = NodeRange.parse(text)
    assert (machines.low, machines.high, str(machines), machines.elastic) == (low, high, shown, low < high)


@pytest.mark.parametrize("text", ["0", "0:2", "3:2", "1:2:3", "x", "1:y", ""])
def test_a_bad_number_of_machines_names_the_value_and_the_form(text):
    with pytest.raises(ConfigError, match=r"--nnodes '.*'.*(MIN:MAX|expected N)"):
        NodeRange.parse(text)


def test_a_range_closes_the_rendezvous_soon_after_the_first_machines_met():
    args = torchrun_args(NodeRange(1, 3), 0, 3, "127.0.0.1:29400", None, "run")
    assert args[args.index("--nnodes") + 1] == "1:3"
    assert args[args.index("--rdzv-conf") + 1] == f"last_call_timeout={LAST_CALL:g}"
    args = torchrun_args("1:2", 1, 3, "10.0.0.1:29400", "10.0.0.2", "run")
    assert args[args.index("--rdzv-conf") + 1] == f"is_host=0,last_call_timeout={LAST_CALL:g}"
    fixed = torchrun_args(2, 1, 3, "10.0.0.1:29400", "10.0.0.2", "run")
    assert fixed[fixed.index("--nnodes") + 1] == "2" and fixed[fixed.index("--rdzv-conf") + 1] == "is_host=0"


def test_the_ranks_of_a_job_laid_out_for_more_machines_than_met_number_them_in_its_layout(monkeypatch):
    # node 0 of a --nnodes 1:3 job that started alone: 3 processes a machine, torch's world of 3
    for key, value in {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0",
                       JOB_NODES_ENV: "3"}.items():
        monkeypatch.setenv(key, value)
    topo = job_topology()
    assert (topo.nnodes, topo.world_size, topo.rank) == (3, 9, 2) and present_nodes() == 1
    roles = Roles(topo, 1, 0, present=present_nodes())
    assert roles.awaited == [1, 2] and roles.trainers == 6
    assert roles.present_ranks("trainer") == [1, 2] and roles.present_ranks("embedding") == [0]
    assert roles.ranks("embedding") == [0, 3, 6]  # (the layout's: the shards of every machine, awaited ones too)
    monkeypatch.setenv(JOB_NODES_ENV, "1")  # (never fewer than torch's world)
    assert job_topology().nnodes == 1
    every = Topology(rank=0, world_size=6, local_rank=0, local_world_size=3, node=0)
    assert Roles(every, 1, 0).awaited == [] and Roles(every, 1, 0, present=2).awaited == []  # (every machine met)
