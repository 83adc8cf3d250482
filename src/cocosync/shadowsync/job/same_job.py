"""Every machine of a multi-machine job trains the same job: checked by every rank once the job's ranks have met.

Each machine builds its job from its own command line (`cocosync train --nnodes`, or `torchrun ... -m
cocosync.shadowsync`). A typo on one machine (another --examples, --sync, table size or seed, a resume on one
machine only or from another checkpoint, another --nproc-per-node) would train a mix of two jobs, reported as
node 0's, or hang where the machines' schedules of collectives differ. So every rank compares its job with every
other rank's and the job stops before anything trains, naming each option that differs and its value on each
machine. A job that checkpoints also checks that its --out is one directory every machine shares: otherwise each
machine would save its ranks' parts to its own, and node 0's checkpoint would name files it does not have.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from cocosync.runtime.comm.topology import Topology, topology_from_env
from cocosync.shadowsync.checkpoint import read_meta, resolve
from cocosync.shadowsync.config import ClusterConfig, ConfigError, TrainConfig, config_to_dict

__all__ = ["PER_MACHINE", "SHARED_WAIT", "JOB_NODES_ENV", "job_topology", "present_nodes", "job_options",
           "checkpoint_identity", "data_fingerprint", "differences", "check_same_job"]

#: what each machine may set for itself: where it writes and reads (a data file's path; its contents are compared
#: by `data_fingerprint`), its threads, its own limits, what it shows
PER_MACHINE = frozenset({"out_dir", "data", "threads", "timeout", "heartbeat_timeout", "progress", "log_every",
                         "window", "plot"})

#: the environment variable that gives a job's ranks the machines it is laid out for (--nnodes MIN:MAX: MAX), where
#: torchrun's world holds those that met at its start
JOB_NODES_ENV = "COCOSYNC_JOB_NODES"

#: seconds a rank waits to see the file rank 0 wrote in its --out before it says the directory is not shared
SHARED_WAIT = 3.0


def job_topology() -> Topology:
    """This rank's place in the job as torchrun set it, in a world of the machines the job is laid out for
    (JOB_NODES_ENV, else torchrun's); machines started with different --nproc-per-node make a world the per-machine
    count does not divide: a ConfigError saying so (it was a traceback from every rank)."""
    try:
        topo = topology_from_env()
    except ValueError as e:
        raise ConfigError(f"{e}: every machine of the job must run the same number of processes (--nproc-per-node "
                          f"{os.environ.get('LOCAL_WORLD_SIZE')} on this one)") from None
    nodes = int(os.environ.get(JOB_NODES_ENV, "0"))
    if nodes <= topo.nnodes:
        return topo
    return Topology(rank=topo.rank, world_size=nodes * topo.local_world_size, local_rank=topo.local_rank,
                    local_world_size=topo.local_world_size, node=topo.node)


def present_nodes() -> int:
    """The machines in torchrun's world: those that met at the job's start (node 0 up to this count, in the job's
    numbering)."""
    return int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get(
        "WORLD_SIZE", "1")))


def job_options(cfg: TrainConfig, cluster: ClusterConfig, nproc_per_node: int) -> dict[str, Any]:
    """What must be equal on every machine, by the job config's names (`sync.algorithm`, `model.table_size`)."""
    out: dict[str, Any] = {}
    for key, value in config_to_dict(cfg).items():
        if key in PER_MACHINE:
            continue
        if isinstance(value, dict):  # (a file's range_lines follow from its contents, compared below)
            out.update({f"{key}.{k}": v for k, v in value.items() if k != "range_lines"})
        else:
            out[key] = value
    if cfg.data != "synthetic":  # each machine names its own copy: its contents must agree
        out["data (its contents)"] = data_fingerprint(cfg.data)
    eval_path = cfg.data_options.get("eval_path")
    if isinstance(eval_path, str):
        out["data_options.eval_path"] = data_fingerprint(eval_path)
    out.update({k: v for k, v in dataclasses.asdict(cluster).items() if k != "resume"})
    out["resume"] = checkpoint_identity(cluster.resume) if cluster.resume is not None else None
    out["nproc_per_node"] = nproc_per_node
    return out


#: blocks of a data file hashed into its fingerprint, and their size
FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK = 64, 1 << 16


def data_fingerprint(path: str) -> str:
    """What identifies a data file wherever a machine keeps it: its size and a digest of FINGERPRINT_BLOCKS blocks
    spread over it (first and last included), so two copies that differ past their first rows are told apart
    without reading either whole."""
    try:
        size = os.path.getsize(path)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            blocks = min(FINGERPRINT_BLOCKS, max(1, -(-size // FINGERPRINT_BLOCK)))
            for i in range(blocks):
                f.seek((size - FINGERPRINT_BLOCK) * i // max(1, blocks - 1) if size > FINGERPRINT_BLOCK else 0)
                h.update(f.read(FINGERPRINT_BLOCK))
    except OSError as e:
        return f"unreadable ({e.strerror})"
    return f"{size:,} bytes, sampled sha256 {h.hexdigest()[:12]}"


def checkpoint_identity(path: str) -> str:
    """What names a checkpoint wherever a machine mounts it (its path may differ by machine): the examples it had
    seen and a digest of its tensors' CRC-32s (crc-*.json, one file per saving rank)."""
    ckpt = resolve(path)
    crcs = b"".join(f.name.encode() + f.read_bytes() for f in sorted(ckpt.glob("crc-*.json")))
    return f"the checkpoint at {read_meta(ckpt).get('examples_seen', 0):,} examples, tensors " \
           f"{hashlib.sha256(crcs).hexdigest()[:12]}"


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
    """Collective over the job's default group: a ConfigError on every rank where the machines' jobs differ, or where
    the job checkpoints and its --out is not one directory every machine shares."""
    mine = job_options(cfg, cluster, topo.local_world_size)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (topo.node, mine, secrets.token_hex(8)))
    per_node = {node: options for node, options, _ in every}  # (a node's ranks parsed one command line)
    diff = differences(per_node)
    if diff:
        raise ConfigError("the machines of this job were started with different options; start every machine with "
                          "the same ones (only " + ", ".join(sorted(PER_MACHINE)) + " may differ):\n  "
                          + "\n  ".join(diff))
    if cfg.checkpoint or cluster.checkpoint_every:
        _check_shared(Path(cfg.out_dir), every[0][2], topo)


def _check_shared(out: Path, token: str, topo: Topology) -> None:
    """Rank 0 writes a file in its --out; every rank must see it in its own. A checkpoint across machines is every
    rank's part in one directory: on a directory each machine has to itself, every machine kept its own parts and
    node 0's checkpoint named files it did not have (found at the next eval or resume, if ever)."""
    marker = out / f".cocosync-shared-{token}"
    if topo.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        marker.write_text(token)
    dist.barrier()
    deadline = time.monotonic() + SHARED_WAIT
    while not (seen := marker.is_file()) and time.monotonic() < deadline:  # (a network file system's caches)
        time.sleep(0.1)
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, (topo.node, socket.gethostname(), str(out), seen))
    if topo.rank == 0:
        marker.unlink(missing_ok=True)
    blind = sorted({(node, host, path) for node, host, path, ok in views if not ok})
    if blind:
        who = ", ".join(f"node {n} ({h}) does not see in {p!r}" for n, h, p in blind)
        raise ConfigError(f"--out is not a directory the machines share: {who} the file node 0 wrote in "
                          f"{views[0][2]!r}; a checkpoint across machines is every rank's part in one directory: "
                          "give every machine a --out on storage they share, or train without checkpoints "
                          "(checkpoint = false in --config)")
