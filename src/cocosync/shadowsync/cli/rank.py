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

from cocosync.shadowsync.cli.options import cluster_options, config_from_options, show_defaults, train_options
from cocosync.shadowsync.errors import ConfigError, debug_mode
from cocosync.shadowsync.job.rank import run_cluster
from cocosync.shadowsync.job.rank_start import die_with_parent, leave, report, run_job
from cocosync.shadowsync.job.roles import ClusterConfig
from cocosync.shadowsync.train_config import TrainConfig, config_to_dict

__all__ = ["main", "job_from_args"]


@show_defaults
@click.command()
@train_options
@cluster_options
@click.option("--max-inflight", type=int, default=4, show_default=True,
              help="row-gradient pushes a trainer may have outstanding.")
@click.option("--resume", type=click.Path(), help="a checkpoint directory, or a run directory (its latest checkpoint).")
@click.option("--json", "json_out", is_flag=True, help="trainer 0 prints the summary as JSON on stdout.")
@click.option("--job", "job_file", type=click.Path(dir_okay=False), hidden=True,
              help="the job.json `cocosync train` wrote (config and cluster options; the other options are ignored).")
def main(json_out: bool, job_file: str | None, **params: Any) -> None:
    """One rank of a multi-machine ShadowSync job (launch with torchrun; roles from its environment)."""
    if "LOCAL_WORLD_SIZE" not in os.environ:
        raise click.UsageError("python -m cocosync.shadowsync is one rank of a torchrun job: launch it with "
                               "`torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
                               "-m cocosync.shadowsync ...`, or use `cocosync train --nnodes N ...` (`cocosync train` "
                               "alone trains on this machine)")
    if job_file is not None:  # (what `cocosync train` ran before its ranks were forked warm: rank_start.py)
        run_job(job_file, json_out)
        leave()
    die_with_parent()
    console = Console(stderr=True)
    try:
        cfg, cluster = _job(params)
        summary = run_cluster(cfg, cluster, console=console)
    except ConfigError as e:
        if debug_mode():
            raise
        raise click.UsageError(str(e)) from None
    if summary is not None:
        report(summary, cfg.out_dir, json_out, console)
    leave()


_CLUSTER_OPTIONS = ("embedding_servers", "sync_servers", "prefetch", "max_inflight", "resume", "stop_after",
                    "checkpoint_every", "lookup_batches", "eval_every", "lookup_transport", "exchange_interval",
                    "hot_rows", "hot_sync_interval", "hot_staleness")


def _job(params: dict) -> tuple[TrainConfig, ClusterConfig]:
    """The job a rank's parsed options describe: the training options make its TrainConfig, the cluster options
    (intervals in milliseconds, as typed) its ClusterConfig. UsageError or ConfigError if bad."""
    params = dict(params)
    cluster = {k: params.pop(k) for k in _CLUSTER_OPTIONS}
    for k in ("exchange_interval", "hot_sync_interval"):
        cluster[k] /= 1e3
    config_path = params.pop("config_path")
    cfg = config_from_options(config_path, None, {**params, "progress": False})
    return cfg, ClusterConfig(**cluster)


def job_from_args(args: list[str]) -> tuple[dict, bool]:
    """A rank's command line (`python -m cocosync.shadowsync ARGS`) parsed and checked as the rank would (click's
    UsageError or ConfigError if bad): the job as `run_job_dict` takes it, and --json."""
    params = main.make_context("cocosync.shadowsync", list(args)).params
    params.pop("job_file")
    json_out = params.pop("json_out")
    cfg, cluster = _job(params)
    return {"config": config_to_dict(cfg), "cluster": dataclasses.asdict(cluster)}, json_out


