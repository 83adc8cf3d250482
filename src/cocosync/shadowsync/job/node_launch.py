"""`cocosync train --nnodes N`: this machine's ranks of a job across machines.

torchrun itself runs here: its own argument parser and launch configuration (c10d rendezvous at --rdzv-endpoint,
node 0 hosting the store), and torch's elastic agent, in this process. What differs from exec'ing torchrun is the
entrypoint the agent is handed: a function (rank_start.run_node_rank) instead of `python -m cocosync.shadowsync`, so
the ranks fork warm from the fork server (runtime/warm_start.py; no import of torch per rank) and stay in this
process's session, where torchrun would exec each in a session of its own (rank_start.py says why that matters).
The options are checked here, once, before the rendezvous: a bad one is one line naming it, not a failure per rank.
`COCOSYNC_WARM_START=0` execs torchrun instead (each rank cold, a session each: the plain torchrun job).
"""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import launch_agent
from torch.distributed.run import config_from_args, get_args_parser

from cocosync.runtime import warm_start
from cocosync.shadowsync.__main__ import job_from_args
from cocosync.shadowsync.job.rank_start import RANK_KEYS_ENV, run_node_rank

__all__ = ["torchrun_args", "run_node"]

_MODULE = "cocosync.shadowsync"


class _RankKeys(DefaultLogsSpecs):
    """torchrun's logs (the ranks' output on this process's terminal) that also tell each forked rank which keys of
    its environment the agent set (rank_start.become_rank keeps those over its launcher's environment)."""

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = super().reify(envs)
        for env in envs.values():
            env[RANK_KEYS_ENV] = ",".join(sorted(env))
        return dest


def torchrun_args(nnodes: int, node_rank: int, nproc_per_node: int, rdzv_endpoint: str,
                  local_addr: str | None, run_id: str) -> list[str]:
    """torchrun's arguments for this machine (before the module and its arguments). c10d numbers the nodes itself;
    `node_rank` says which machine hosts the rendezvous store (`is_host`). `local_addr`: the address the other
    machines reach this one's ranks at; default 127.0.0.1 on a loopback rendezvous, else what torchrun resolves
    (the hostname)."""
    host = rdzv_endpoint.rsplit(":", 1)[0]
    loopback = host in ("127.0.0.1", "localhost")
    conf = [] if loopback else ["--rdzv-conf", f"is_host={1 if node_rank == 0 else 0}"]
    addr = local_addr or ("127.0.0.1" if loopback else None)
    return ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", run_id, "--max-restarts", "0", *conf,
            *(["--local-addr", addr] if addr else [])]


def run_node(launch: list[str], rank_args: list[str], *, warm: bool = True) -> int:
    """Run this machine's ranks of the job: `launch` is torchrun's arguments (`torchrun_args`), `rank_args` those of
    `python -m cocosync.shadowsync`. Returns the exit status (1, with torchrun's account of the failed ranks on
    stderr, if a rank failed); with `warm` False this process becomes torchrun and does not return."""
    job, json_out = job_from_args(rank_args)  # (UsageError / ConfigError before any process starts)
    argv = [*launch, "-m", _MODULE, *rank_args]
    sys.stdout.flush()
    sys.stderr.flush()
    if not warm:
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *argv])
    warm_start.start()  # (imports while the rendezvous waits for the other machines)
    config, _, _ = config_from_args(get_args_parser().parse_args(argv))  # (sets OMP_NUM_THREADS=1 as torchrun does)
    config.start_method = "forkserver"
    config.logs_specs = _RankKeys()
    try:
        with warm_start.main_not_rerun():
            launch_agent(config, run_node_rank, [job, json_out, dict(os.environ), os.getpid()])
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr, flush=True)
        return 1
    return 0
