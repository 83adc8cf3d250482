"""`torchrun ... -m cocosync.shadowsync [train options]`: the command of one rank of a ShadowSync job.

    torchrun --nnodes 2 --nproc-per-node 3 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m cocosync.shadowsync --sync shadow-bmuf --embedding-servers 1 --out runs/two-nodes

`cocosync train --nnodes 2 --node-rank R --rdzv-endpoint HOST:29400 ...` runs the same job for one machine, its
ranks forked warm in its session (job/node_launch.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import click
from rich.console import Console

from cocosync.shadowsync.cli.options import SectionedCommand, config_options, job_from_options, show_defaults
from cocosync.shadowsync.config import ClusterConfig, TrainConfig
from cocosync.shadowsync.errors import ConfigError, debug_mode
from cocosync.shadowsync.job.rank import run_cluster
from cocosync.shadowsync.job.rank_start import die_with_parent, leave, report, run_job

__all__ = ["main", "rank_job", "CONFIG_OPTION"]


CONFIG_OPTION = click.option("--config", "config_path", type=click.Path(dir_okay=False),
                             help="TOML/JSON/YAML file of the settings below (the TrainConfig fields, and a [cluster] "
                                  "table of ClusterConfig's); the options given win over it.")


@show_defaults
@click.command(cls=SectionedCommand)
@CONFIG_OPTION
@click.option("--resume", type=click.Path(), help="a checkpoint directory, or a run directory (its latest checkpoint).")
@click.option("--json", "json_out", is_flag=True, help="trainer 0 prints the summary as JSON on stdout.")
@click.option("--job", "job_file", type=click.Path(dir_okay=False), hidden=True,
              help="the job.json `cocosync train` wrote (config and cluster options; the other options are ignored).")
@config_options
def main(json_out: bool, job_file: str | None, config_path: str | None, resume: str | None, **params: Any) -> None:
    """One rank of a multi-machine ShadowSync job (launch with torchrun; roles from its environment)."""
    if "LOCAL_WORLD_SIZE" not in os.environ:
        raise click.UsageError("python -m cocosync.shadowsync is one rank of a torchrun job: launch it with "
                               "`torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
                               "-m cocosync.shadowsync ...`, or use `cocosync train --nnodes N ...` (`cocosync train` "
                               "alone trains on this machine)")
    if job_file is not None:  # (what `cocosync train` wrote: the job of every rank on this machine)
        run_job(job_file, json_out)
        leave()
    die_with_parent()
    console = Console(stderr=True)
    try:
        cfg, cluster = rank_job(config_path, resume, params)
        summary = run_cluster(cfg, cluster, console=console)
    except ConfigError as e:
        if debug_mode():
            raise
        raise click.UsageError(str(e)) from None
    if summary is not None:
        report(summary, cfg.out_dir, json_out, console)
    leave()


def rank_job(config_path: str | None, resume: str | None, params: dict[str, Any]) -> tuple[TrainConfig, ClusterConfig]:
    """The job a rank's parsed config options describe (no progress bar: the launcher shows the job's). A rank
    resuming takes the run's config, as one machine does (the command line wins over it), and writes into the
    resumed run's directory unless --out says otherwise. ConfigError or UsageError if bad."""
    cfg, cluster = job_from_options(config_path, resume, params, {"resume": resume})
    return dataclasses.replace(cfg, progress=False), cluster
