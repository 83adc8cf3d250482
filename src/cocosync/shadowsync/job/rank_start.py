"""A rank of `cocosync train` on one machine, forked warm by torch's elastic agent from the fork server
(runtime/warm_start.py): the function entrypoint launch.py hands the agent where torchrun runs
`python -m cocosync.shadowsync` (the same job, from the job.json the launcher wrote)."""

from __future__ import annotations

import os
import re
import sys

from setproctitle import setproctitle

from cocosync.runtime.warm_start import adopt_environment, die_with
from cocosync.shadowsync.__main__ import run_job

__all__ = ["RANK_KEYS_ENV", "run_rank", "title", "parse_title"]

#: put in each rank's environment by the launcher: the keys the elastic agent set for that rank (RANK, LOCAL_RANK,
#: MASTER_PORT, ...), which win over the launcher's environment handed along
RANK_KEYS_ENV = "COCOSYNC_RANK_ENV_KEYS"


def run_rank(job_file: str, launcher_env: dict[str, str], launcher_pid: int) -> None:
    """One rank, set up as the agent would start its command: killed when its launcher dies, its own process group
    (a terminal's Ctrl-C reaches the launcher, which stops the job, not every rank), its launcher's environment (not
    the fork server's, which may be an earlier job's) with the agent's keys for this rank, output line by line (the
    agent points stdout at <out>/logs/rank<R>.out), and a process title that says what it is (`title`); then the
    job.

    A process group, not a session as torchrun's agent gives a command (`start_new_session`): Linux's scheduler
    autogroups group processes by session, and with one session per rank it shares the CPU among the ranks as groups
    and balanced them across cores so badly on an oversubscribed machine that one trainer of 16 on 2 cores ran its
    whole share on a core of its own in ~1 s, unsynchronized, while the other 15 shared the other core (BENCHMARKS.md,
    "one session per rank"). In the launcher's session the job's threads are balanced as threads."""
    die_with(launcher_pid)
    os.setpgid(0, 0)
    # (before the environment changes: setproctitle finds the memory it rewrites next to the original environment)
    setproctitle(title(job_file, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])))
    adopt_environment(launcher_env, os.environ.get(RANK_KEYS_ENV, "").split(","))
    sys.stdout.reconfigure(line_buffering=True)
    run_job(job_file)


def title(job_file: str, rank: int, local_rank: int) -> str:
    """What ps, top and /proc/<pid>/cmdline show for a rank forked warm (otherwise the fork server's command)."""
    return f"cocosync.shadowsync --job {job_file} (rank {rank}, local rank {local_rank})"


def parse_title(cmdline: str) -> int | None:
    """The local rank in a process title written by `title`, or None for any other command line."""
    m = re.fullmatch(r"cocosync\.shadowsync --job .* \(rank \d+, local rank (\d+)\)", cmdline)
    return int(m.group(1)) if m else None
