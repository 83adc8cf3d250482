"""`cocosync train --nnodes N`: this machine's ranks of a job across machines.

torchrun itself runs here: its own argument parser and launch configuration (c10d rendezvous at --rdzv-endpoint,
node 0 hosting the store), and torch's elastic agent, in this process. What differs from exec'ing torchrun is the
entrypoint the agent is handed: a function (rank_start.run_node_rank) instead of `python -m cocosync.shadowsync`, so
the ranks fork warm from the fork server (runtime/warm_start.py; no import of torch per rank) and stay in this
process's session, where torchrun would exec each in a session of its own (rank_start.py says why that matters).
The options are checked here, once, before the rendezvous: a bad one is one line naming it, not a failure per rank.
Ctrl-C or SIGTERM on any machine stops every trainer of the job with a checkpoint (through the rendezvous store,
link.py), where torchrun's agent would stop its ranks with SIGTERM and fail the job. `COCOSYNC_WARM_START=0` execs
torchrun instead (each rank cold, a session each: the plain torchrun job).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import launch_agent
from torch.distributed.run import config_from_args, get_args_parser

from cocosync.runtime import warm_start
from cocosync.shadowsync.__main__ import job_from_args
from cocosync.shadowsync.job.link import MONITOR_HOST_ENV, MONITOR_PORT_ENV, request_stop
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
    `python -m cocosync.shadowsync`. Returns the exit status: 0; 1 with torchrun's account of the failed ranks on
    stderr; 130 / 143 after a Ctrl-C / SIGTERM stopped the job with a checkpoint. With `warm` False this process
    becomes torchrun and does not return.

    The agent runs in a thread (a thread cannot take signals), so that Ctrl-C and SIGTERM reach this one: the first
    asks every trainer of every machine to stop with a checkpoint, through the job's rendezvous store (link.py), as
    the one-machine launcher does through its own; the second aborts (the ranks die with their launcher)."""
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
    host, port = config.rdzv_endpoint.rsplit(":", 1)
    os.environ.update({MONITOR_HOST_ENV: host, MONITOR_PORT_ENV: port})  # the ranks' link: the rendezvous store
    outcome: dict[str, BaseException] = {}

    def agent(launcher_env: dict[str, str]) -> None:
        try:
            with warm_start.main_not_rerun():
                launch_agent(config, run_node_rank, [job, json_out, launcher_env, os.getpid()])
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    signals: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _: signals.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=agent, args=(dict(os.environ),), name="cocosync-elastic-agent", daemon=True)
    try:
        thread.start()
        asked = False
        while thread.is_alive():
            thread.join(0.2)
            if len(signals) >= 2:
                print("aborting: this machine's ranks die with this process", file=sys.stderr, flush=True)
                os._exit(128 + signals[-1])
            if signals and not asked:
                asked = True
                _stop(signal.Signals(signals[0]).name, host, int(port))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    error = outcome.get("error")
    if isinstance(error, ChildFailedError):
        print(error.format_msg(), file=sys.stderr, flush=True)
        return 1
    if error is not None:
        raise error
    if signals:
        return 143 if signals[0] == signal.SIGTERM else 130
    return 0


def _stop(why: str, host: str, port: int) -> None:
    name = "Ctrl-C" if why == "SIGINT" else why
    try:
        request_stop(host, port)
    except Exception as e:  # noqa: BLE001 - no store to ask through: abort
        print(f"{name}: the job's store at {host}:{port} cannot be reached ({e}); aborting", file=sys.stderr,
              flush=True)
        os._exit(130 if why == "SIGINT" else 143)
    print(f"{name}: stopping the trainers of every machine (they keep what they trained: a checkpoint and the "
          "summary); again to abort", file=sys.stderr, flush=True)
