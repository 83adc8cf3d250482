"""A rank of `cocosync train`, forked warm by torch's elastic agent from the fork server (runtime/warm_start.py): the
function entrypoint the launcher hands the agent where torchrun runs `python -m cocosync.shadowsync` (the same job:
on one machine from the job.json launch.py wrote, across machines from the options node_launch.py checked)."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import click
from rich.console import Console
from rich.markup import escape
from setproctitle import setproctitle

from cocosync.runtime.comm.shm import unlink_pending
from cocosync.runtime.warm_start import adopt_environment, die_with
from cocosync.shadowsync.config import ClusterConfig, TrainConfig, config_from_dict, config_to_dict
from cocosync.shadowsync.errors import ConfigError, debug_mode
from cocosync.shadowsync.job.link import MONITOR_PORT_ENV, env_store_client
from cocosync.shadowsync.job.membership import (
    keep_server,
    keep_trainer,
)
from cocosync.shadowsync.job.rank import run_cluster, run_joined, run_restarted
from cocosync.shadowsync.job.same_job import JOB_NODES_ENV
from cocosync.shadowsync.job.summary import checkpoints_note
from cocosync.shadowsync.job.survival import Survival
from cocosync.shadowsync.metrics import json_safe

__all__ = ["RANK_KEYS_ENV", "mark_agent_keys", "run_rank", "run_node_rank", "run_joined_rank", "job_dict", "run_job",
           "run_job_dict", "report", "leave", "die_with_parent", "title", "parse_title"]

#: put in each rank's environment by the launcher: the keys the elastic agent set for that rank (RANK, LOCAL_RANK,
#: MASTER_PORT, ...), which win over the launcher's environment handed along
RANK_KEYS_ENV = "COCOSYNC_RANK_ENV_KEYS"


def mark_agent_keys(env: dict[str, str]) -> None:
    """Record in a rank's environment (as the agent built it, in a LogsSpecs' reify) which keys the agent set."""
    env[RANK_KEYS_ENV] = ",".join(sorted(env))


def run_rank(job_file: str, launcher_env: dict[str, str], launcher_pid: int) -> None:
    """One rank of `cocosync train` on one machine: `become_rank`, then the job in `job_file`."""
    become_rank(f"--job {job_file}", launcher_env, launcher_pid)
    run_job(job_file)


def run_node_rank(job: dict, json_out: bool, launcher_env: dict[str, str], launcher_pid: int) -> None:
    """One rank of `cocosync train --nnodes` on this machine: `become_rank`, then `job` (run_job_dict's form)."""
    become_rank(f"--out {job['config']['out_dir']}", launcher_env, launcher_pid)
    run_job_dict(job, json_out)


def run_joined_rank(job: dict, launcher_env: dict[str, str], rank_env: dict[str, str], launcher_pid: int) -> None:
    """A trainer of a machine that joins a running job in a lost one's place (node_launch.py), forked warm:
    `become_rank` with `rank_env` (the lost machine's numbering of its ranks, as the agent had set it), then
    `rank.run_joined`. It leaves through os._exit (a child of the fork server): 0 once done, 1 if it failed."""
    os.environ.update(rank_env)
    os.environ[RANK_KEYS_ENV] = ",".join(sorted(rank_env))
    become_rank(f"--out {job['config']['out_dir']}", launcher_env, launcher_pid)
    console = Console(stderr=True)
    _leave_after(lambda: run_joined(config_from_dict(job["config"]), ClusterConfig(**job["cluster"]),
                                    console=console))


def become_rank(what: str, launcher_env: dict[str, str], launcher_pid: int) -> None:
    """Set a forked process up as the agent would start a rank's command: killed when its launcher dies, its own
    process group (a terminal's Ctrl-C reaches the launcher, which stops the job, not every rank), its launcher's
    environment (not the fork server's, which may be an earlier job's) with the agent's keys for this rank, output
    line by line, and a process title that says what it is (`title`).

    A process group, not a session as torchrun's agent gives a command (`start_new_session`): Linux's scheduler
    autogroup groups processes by session, and with one session per rank it shares the CPU among the ranks as groups
    and balanced them across cores so badly on an oversubscribed machine that one trainer of 16 on 2 cores ran its
    whole share on a core of its own in ~1 s, unsynchronized, while the other 15 shared the other core; across
    loopback nodes the ranks' background threads (the lookup exchange, the hot rows' sync) ran late (BENCHMARKS.md,
    "one session per rank"). In the launcher's session the job's threads are balanced as threads."""
    die_with(launcher_pid)
    os.setpgid(0, 0)
    # (before the environment changes: setproctitle finds the memory it rewrites next to the original environment)
    setproctitle(title(what, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])))
    adopt_environment(launcher_env, os.environ.get(RANK_KEYS_ENV, "").split(","))
    sys.stdout.reconfigure(line_buffering=True)


def title(what: str, rank: int, local_rank: int) -> str:
    """What ps, top and /proc/<pid>/cmdline show for a rank forked warm (otherwise the fork server's command);
    `what`: `--job FILE` or `--out DIR`."""
    return f"cocosync.shadowsync {what} (rank {rank}, local rank {local_rank})"


def parse_title(cmdline: str) -> tuple[int, int] | None:
    """(rank, local rank) in a process title written by `title`, or None for any other command line."""
    m = re.fullmatch(r"cocosync\.shadowsync --(?:job|out) .* \(rank (\d+), local rank (\d+)\)", cmdline)
    return (int(m.group(1)), int(m.group(2))) if m else None


def die_with_parent() -> None:
    """Linux: SIGKILL this rank when the process that started it (torchrun, `cocosync train`) dies, so no rank
    outlives a killed launcher."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the prctl
        os._exit(1)


def job_dict(cfg: TrainConfig, cluster: ClusterConfig) -> dict[str, Any]:
    """A job as `run_job_dict` takes it and job.json holds it."""
    return {"config": config_to_dict(cfg), "cluster": dataclasses.asdict(cluster)}


def run_job(job_file: str, json_out: bool = False) -> None:
    """One rank of the job `cocosync train` wrote to `job_file` (config and cluster options), on this machine."""
    run_job_dict(json.loads(Path(job_file).read_text()), json_out)


def run_job_dict(job: dict, json_out: bool = False) -> None:
    """One rank of a job given as {"config": config_to_dict(cfg), "cluster": asdict(cluster)}."""
    die_with_parent()
    console = Console(stderr=True)
    cfg, cluster = config_from_dict(job["config"]), ClusterConfig(**job["cluster"])
    if _may_be_lost(cfg, cluster):
        trainer, server = _trainer_index(cluster, cfg), _embedding_index(cluster)
        nnodes, per_node = _machines(cfg, cluster)
        restart = (keep_trainer(trainer, per_node * nnodes, cfg.min_trainers, env_store_client, cfg.max_restarts,
                                per_node=per_node if nnodes > 1 else None)
                   if trainer is not None else 0 if keep_server(server, env_store_client,
                                                                _survival(cfg, cluster).servers_leave_at_end) else None)
        if restart is None:
            return  # the keeper: its rank's work finished or was lost
        def work() -> None:  # the rank's work, forked by its keeper (the agent started the keeper)
            die_with_parent()  # (a fork clears the parent-death signal)
            os.setpgid(0, 0)  # a process group of its own, as every rank's (become_rank)
            if restart:
                run_restarted(cfg, cluster, restart, console=console)
            else:
                _run(cfg, cluster, console, json_out)

        _leave_after(work)
    _run(cfg, cluster, console, json_out)


def _machines(cfg: TrainConfig, cluster: ClusterConfig) -> tuple[int, int]:
    """(the job's machines, trainers on each), from this rank's environment (roles.py: servers first; the machines
    the job is laid out for: same_job.JOB_NODES_ENV)."""
    nnodes = max(int(os.environ.get("GROUP_WORLD_SIZE", "1")), int(os.environ.get(JOB_NODES_ENV, "0")))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) - cluster.embedding_servers - \
        cluster.sync_servers_for(cfg.sync.method, nodes=nnodes)
    return nnodes, per_node if nnodes > 1 else cfg.trainers


def _may_be_lost(cfg: TrainConfig, cluster: ClusterConfig) -> bool:
    """Whether this rank is a trainer or an embedding server the job can go on without (`Survival.losses`; across
    machines, a trainer alone: `Survival.trainer_loss`)."""
    survival = _survival(cfg, cluster)
    if survival.nnodes == 1:
        if not survival.losses:
            return False
        return _trainer_index(cluster, cfg) is not None or _embedding_index(cluster) is not None
    return survival.trainer_loss and _trainer_index(cluster, cfg) is not None


def _survival(cfg: TrainConfig, cluster: ClusterConfig) -> Survival:
    """What this rank's job goes on without (launched by `cocosync train`: its monitor's port is in the
    environment)."""
    nnodes, per_node = _machines(cfg, cluster)
    return Survival.of(cfg, cluster, nnodes, per_node, os.environ.get(MONITOR_PORT_ENV) is not None)


def _trainer_index(cluster: ClusterConfig, cfg: TrainConfig) -> int | None:
    """This rank's trainer index in the job (None: another role): its machine's trainers are numbered after the
    machines before it (roles.py)."""
    nnodes, per_node = _machines(cfg, cluster)
    local = int(os.environ["LOCAL_RANK"]) - cluster.embedding_servers - \
        cluster.sync_servers_for(cfg.sync.method, nodes=nnodes)
    if local < 0:
        return None
    return int(os.environ["RANK"]) // int(os.environ["LOCAL_WORLD_SIZE"]) * per_node + local if nnodes > 1 else local


def _embedding_index(cluster: ClusterConfig) -> int | None:
    """This rank's embedding server index on one machine (None: another role)."""
    local = int(os.environ["LOCAL_RANK"])
    return local if local < cluster.embedding_servers else None


def _leave_after(work: Callable[[], None]) -> None:
    """Run `work` in a process that is not the one its starter waits for as a rank (a keeper's child, a fork of the
    launcher) and leave through os._exit: 0 once done, the code of a SystemExit, 1 after an exception (printed)."""
    try:
        work()
    except SystemExit as e:
        _exit(e.code if isinstance(e.code, int) else 1)
    except BaseException:  # noqa: BLE001 - as an uncaught exception would end it
        traceback.print_exc()
        _exit(1)
    _exit(0)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    unlink_pending()
    os._exit(code)


def _run(cfg: TrainConfig, cluster: ClusterConfig, console: Console, json_out: bool) -> None:
    try:
        summary = run_cluster(cfg, cluster, console=console)
    except ConfigError as e:  # (the launcher checked everything it could before a rank started)
        if debug_mode():
            raise
        console.print(f"Error: {escape(str(e))}", soft_wrap=True)
        sys.exit(2)
    if summary is not None:
        report(summary, cfg.out_dir, json_out, console)
    sys.stdout.flush()
    sys.stderr.flush()
    unlink_pending()


def leave() -> None:
    """The job's work is done and its groups destroyed: leave without running C++ destructors at interpreter exit
    (a torch thread object destroyed while joinable aborts the process: seen as SIGABRT after a complete job). A
    rank forked warm ends the same way: multiprocessing's children leave through os._exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    unlink_pending()
    os._exit(0)


def report(summary: dict, out_dir: str, json_out: bool, console) -> None:
    console.print(f"[bold]{escape(summary['name'])}[/]: {summary['examples']:,} examples, "
                  f"{summary['eps']:,.0f} examples/s, eval NE {summary['eval_ne']:.4f}, "
                  f"lookup wait {summary['lookup_wait_fraction']:.1%} of step time, "
                  f"staleness {summary['staleness']:.2f} updates -> {escape(str(out_dir))}/summary.json")
    if summary.get("checkpoint"):
        console.print(f"checkpoint: {escape(str(summary['checkpoint']))}"
                      + (f"  (stopped: continue with --resume {escape(str(out_dir))})" if summary["stopped"] else ""))
    if (note := checkpoints_note(summary)) is not None:
        console.print(note, soft_wrap=True)
    if json_out:
        click.echo(json.dumps(json_safe(summary), default=str))
