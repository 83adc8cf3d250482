"""A rank of `cocosync train`, forked warm by torch's elastic agent from the fork server (runtime/warm_start.py): the
function entrypoint the launcher hands the agent where torchrun runs `python -m cocosync.shadowsync` (the same job:
on one machine from the job.json launch.py wrote, across machines from the options node_launch.py checked)."""

from __future__ import annotations

import os
import re
import sys

from setproctitle import setproctitle

from cocosync.runtime.warm_start import adopt_environment, die_with
from cocosync.shadowsync.__main__ import run_job, run_job_dict

__all__ = ["RANK_KEYS_ENV", "mark_agent_keys", "run_rank", "run_node_rank", "title", "parse_title"]

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
