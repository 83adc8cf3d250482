"""Every machine of a multi-machine job trains the same job: checked by every rank once the job's ranks have met.

Each machine builds its job from its own command line (`cocosync train --nnodes`, or `torchrun ... -m
cocosync.shadowsync`). A typo on one machine (another --examples, --sync, table size or seed, a resume on one
machine only, another --nproc-per-node) used to train on silently: a mix of two jobs, reported as node 0's, or a
hang where the machines' schedules of collectives differ. Now every rank compares its job with every other rank's
and the job stops before anything trains, naming each option that differs and its value on each machine.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch.distributed as dist

from cocosync.runtime.comm.topology import Topology, topology_from_env
from cocosync.shadowsync.job.roles import ClusterConfig
from cocosync.shadowsync.train_config import ConfigError, TrainConfig, config_to_dict

__all__ = ["PER_MACHINE", "job_topology", "job_options", "differences", "check_same_job"]

#: what each machine may set for itself: where it writes and reads (a data file's path; its contents are compared
#: through the click rate read from its first rows, model.init_ctr), its threads, its own limits, what it shows
PER_MACHINE = frozenset({"out_dir", "data", "threads", "timeout", "heartbeat_timeout", "progress", "log_every",
                         "window", "plot"})


def job_topology() -> Topology:
    """This rank's place in the job as torchrun set it; machines started with different --nproc-per-node make a
    world the per-machine count does not divide: a ConfigError saying so (it was a traceback from every rank)."""
    try:
        return topology_from_env()
    except ValueError as e:
        raise ConfigError(f"{e}: every machine of the job must run the same number of processes (--nproc-per-node "
                          f"{os.environ.get('LOCAL_WORLD_SIZE')} on this one)") from None


def job_options(cfg: TrainConfig, cluster: ClusterConfig, nproc_per_node: int) -> dict[str, Any]:
    """What must be equal on every machine, by the job config's names (`sync.algorithm`, `model.table_size`)."""
    out: dict[str, Any] = {}
    for key, value in config_to_dict(cfg).items():
        if key in PER_MACHINE:
            continue
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    out.update({k: v for k, v in dataclasses.asdict(cluster).items() if k != "resume"})
    out["resume"] = "a checkpoint" if cluster.resume is not None else None  # its path may differ by machine
    out["nproc_per_node"] = nproc_per_node
    return out


def differences(per_node: dict[int, dict[str, Any]]) -> list[str]:
    """Each option whose value differs between nodes, as 'name: value on node 0, other on node 1'."""
    lines = []
    for key in sorted(set().union(*per_node.values())):
        nodes_of: dict[str, list[int]] = {}
        for node in sorted(per_node):
            nodes_of.setdefault(repr(per_node[node].get(key)), []).append(node)
        if len(nodes_of) > 1:
            lines.append(f"{key}: " + ", ".join(f"{value} on node{'s' if len(n) > 1 else ''} "
                                                + ", ".join(map(str, n)) for value, n in nodes_of.items()))
    return lines


def check_same_job(cfg: TrainConfig, cluster: ClusterConfig, topo: Topology) -> None:
    """Collective over the job's default group: a ConfigError on every rank where the machines' jobs differ."""
    mine = job_options(cfg, cluster, topo.local_world_size)
    every: list[Any] = [None] * topo.world_size
    dist.all_gather_object(every, (topo.node, mine))
    per_node = dict(every)  # (a node's ranks parsed one command line: the same options)
    diff = differences(per_node)
    if diff:
        raise ConfigError("the machines of this job were started with different options; start every machine with "
                          "the same ones (only " + ", ".join(sorted(PER_MACHINE)) + " may differ):\n  "
                          + "\n  ".join(diff))
