"""`torchrun ... -m cocosync.shadowsync [train options]`: one rank of a ShadowSync job across machines (cluster.py).

    torchrun --nnodes 2 --nproc-per-node 3 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m cocosync.shadowsync --sync shadow-bmuf --embedding-servers 1 --out runs/two-nodes

`cocosync train --nnodes 2 --node-rank R --rdzv-endpoint HOST:29400 ...` runs the same job for one machine, its
ranks forked warm in its session (job/node_launch.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from cocosync.runtime.comm.shm import unlink_pending
from cocosync.shadowsync.cli.train import (
    cluster_options,
    config_from_options,
    debug_mode,
    show_defaults,
    train_options,
)
from cocosync.shadowsync.job.roles import ClusterConfig
from cocosync.shadowsync.train_config import ConfigError, TrainConfig, config_from_dict, config_to_dict


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank when the process that started it (torchrun, `cocosync train`) dies, so no rank
    outlives a killed launcher."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the prctl
        os._exit(1)


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
    from rich.console import Console

    from cocosync.shadowsync.job.rank import run_cluster

    if "LOCAL_WORLD_SIZE" not in os.environ:
        raise click.UsageError("python -m cocosync.shadowsync is one rank of a torchrun job: launch it with "
                               "`torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
                               "-m cocosync.shadowsync ...`, or use `cocosync train --nnodes N ...` (`cocosync train` "
                               "alone trains on this machine)")
    if job_file is not None:  # (what `cocosync train` ran before its ranks were forked warm: rank_start.py)
        run_job(job_file, json_out)
        _leave()
    _die_with_parent()
    console = Console(stderr=True)
    try:
        cfg, cluster = _job(params)
        summary = run_cluster(cfg, cluster, console=console)
    except ConfigError as e:
        if debug_mode():
            raise
        raise click.UsageError(str(e)) from None
    if summary is not None:
        _report(summary, cfg.out_dir, json_out, console)
    _leave()


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


def run_job(job_file: str, json_out: bool = False) -> None:
    """One rank of the job `cocosync train` wrote to `job_file` (config and cluster options), on this machine."""
    run_job_dict(json.loads(Path(job_file).read_text()), json_out)


def run_job_dict(job: dict, json_out: bool = False) -> None:
    """One rank of a job given as {"config": config_to_dict(cfg), "cluster": asdict(cluster)}."""
    from rich.console import Console

    from cocosync.shadowsync.job.rank import run_cluster

    _die_with_parent()
    console = Console(stderr=True)
    cfg, cluster = config_from_dict(job["config"]), ClusterConfig(**job["cluster"])
    try:
        summary = run_cluster(cfg, cluster, console=console)
    except ConfigError as e:  # (the launcher checked everything it could before a rank started)
        if debug_mode():
            raise
        console.print(f"Error: {escape(str(e))}", soft_wrap=True)
        sys.exit(2)
    if summary is not None:
        _report(summary, cfg.out_dir, json_out, console)
    sys.stdout.flush()
    sys.stderr.flush()
    unlink_pending()


def _leave() -> None:
    """The job's work is done and its groups destroyed: leave without running C++ destructors at interpreter exit
    (a torch thread object destroyed while joinable aborts the process: seen as SIGABRT after a complete job). A
    rank forked warm ends the same way: multiprocessing's children leave through os._exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    unlink_pending()
    os._exit(0)


def _report(summary: dict, out_dir: str, json_out: bool, console) -> None:
    from cocosync.shadowsync.job.trainer import json_safe

    console.print(f"[bold]{escape(summary['name'])}[/]: {summary['examples']:,} examples, "
                  f"{summary['eps']:,.0f} examples/s, eval NE {summary['eval_ne']:.4f}, "
                  f"lookup wait {summary['lookup_wait_fraction']:.1%} of step time, "
                  f"staleness {summary['staleness']:.2f} updates -> {escape(str(out_dir))}/summary.json")
    if summary.get("checkpoint"):
        console.print(f"checkpoint: {escape(str(summary['checkpoint']))}"
                      + (f"  (stopped: continue with --resume {escape(str(out_dir))})" if summary["stopped"] else ""))
    if json_out:
        click.echo(json.dumps(json_safe(summary), default=str))


if __name__ == "__main__":
    sys.exit(main())
