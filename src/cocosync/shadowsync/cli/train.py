"""`cocosync train` and `cocosync eval`: ShadowSync training runs and scoring of their checkpoints.

`cocosync train` with no arguments is the demo: 2 trainers with Shadow-BMUF on synthetic data (~30-60 s).
Options given on the command line win over `--config FILE` (TOML/JSON/YAML with TrainConfig fields).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any

import click
from rich.markup import escape

from cocosync.runtime import warm_start
from cocosync.shadowsync.cli.options import SectionedCommand, config_options, job_from_options, show_defaults
from cocosync.shadowsync.cli.options import console as make_console
from cocosync.shadowsync.cli.rank import CONFIG_OPTION, rank_job
from cocosync.shadowsync.config import NodeRange, TrainConfig
from cocosync.shadowsync.errors import ConfigError, debug_mode
from cocosync.shadowsync.job.summary import checkpoints_note

__all__ = ["train", "eval_checkpoint"]



def _split_note(cfg: TrainConfig) -> str:
    """How the workers share a data file (said up front: 'lines' means every reader scans all of it)."""
    if cfg.data == "synthetic":
        return ""
    from cocosync.shadowsync.data.sources import build_configs
    from cocosync.shadowsync.data.tabular import data_format

    if data_format(cfg.data) != "criteo":
        return f" ({data_format(cfg.data)}: workers read interleaved rows)"
    try:
        split = build_configs(cfg)[0].reader_split
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    return " (workers read their byte ranges)" if split == "bytes" else " (workers read interleaved lines)"


#: options of the lookups between machines: a one-machine run has none (its trainers read the shards in place)
_MULTI_MACHINE_ONLY = ("cluster__lookup_transport", "cluster__exchange_interval", "cluster__hot_rows",
                       "cluster__hot_sync_interval", "cluster__hot_staleness", "cluster__max_inflight",
                       "cluster__shard_mirror_interval")


def _machines(value: str | None) -> NodeRange | None:
    """--nnodes: N machines, or torchrun's MIN:MAX (the job starts with MIN to MAX of them; the others join it)."""
    if value is None:
        return None
    try:
        return NodeRange.parse(value)
    except ConfigError as e:
        raise click.BadParameter(str(e).removeprefix(f"--nnodes {value!r}: "), param_hint="'--nnodes'") from None


@show_defaults
@click.command(cls=SectionedCommand)
@CONFIG_OPTION
@click.option("--progress/--no-progress", default=None,
              help="progress bar while training (with --nnodes: a line on the whole job every 5 s).")
@click.option("--resume", type=click.Path(),
              help="continue a run (e.g. one stopped by Ctrl-C) from a checkpoint directory, or a run directory (its "
                   "latest checkpoint), with its config.")
@click.option("--json", "json_out", is_flag=True, help="also print the summary as JSON on stdout.")
@click.option("--nnodes", metavar="N|MIN:MAX", callback=lambda ctx, param, value: _machines(value),
              help="multi-node: machines in the job (runs torchrun's agent for this one; see --rdzv-endpoint). "
                   "MIN:MAX: the job starts once MIN have met and is laid out for MAX; a machine started later with "
                   "the same command joins it, as does a lost machine's command started again (docs/multinode.md).")
@click.option("--node-rank", type=int, default=0, show_default=True,
              help="multi-node: this machine's index (0 hosts the rendezvous store).")
@click.option("--nproc-per-node", type=int, default=2, show_default=True,
              help="multi-node: processes per machine (servers first, then trainers).")
@click.option("--rdzv-endpoint", default="127.0.0.1:29400", show_default=True,
              help="multi-node: HOST:PORT of the rendezvous (torchrun's c10d store; node 0 hosts it).")
@click.option("--local-addr", default=None,
              help="multi-node: the address the other machines reach this one's ranks at (default: 127.0.0.1 with a "
                   "loopback --rdzv-endpoint, else this machine's hostname).")
@config_options
def train(config_path: str | None, progress: bool | None, resume: str | None, json_out: bool, nnodes: NodeRange | None,
          node_rank: int, nproc_per_node: int, rdzv_endpoint: str, local_addr: str | None, **params: Any) -> None:
    """Train a model (the DLRM, or --model) with T trainers x W Hogwild workers and ShadowSync (shared embeddings,
    dense sync).

    Ctrl-C stops the trainers cleanly and keeps what was measured (metrics, summary, checkpoint);
    a second Ctrl-C aborts. With --nnodes, the job spans machines: this command runs torchrun's agent for this
    machine (the job of `torchrun ... -m cocosync.shadowsync`, its ranks forked warm), with embedding parameter
    servers and sync servers; Ctrl-C, SIGTERM or --timeout on any machine stops every machine's trainers.
    A lost machine (not node 0) does not stop the job, and its command started again joins the running job in
    its place; nor does a lone trainer lost on any machine (its machine goes on with its other trainers):
    docs/multinode.md says what survives what. With --nnodes MIN:MAX the job starts on the machines that came, and
    a machine started later with the same command joins it.
    """
    from cocosync.shadowsync.job.launch import run_training
    from cocosync.shadowsync.job.trainer import TrainerFailure

    if nnodes is not None:
        _run_node(nnodes, node_rank, nproc_per_node, rdzv_endpoint, local_addr, progress, json_out,
                  config_path, resume, params)
    try:
        cfg, cluster = job_from_options(config_path, resume, params)
    except ConfigError as e:
        if debug_mode():
            raise
        raise click.UsageError(str(e)) from None
    if progress is not None:
        cfg = dataclasses.replace(cfg, progress=progress)
    console = make_console()
    if ignored := [f"--{k.removeprefix('cluster__').replace('_', '-')}" for k in _MULTI_MACHINE_ONLY
                   if params.get(k) is not None]:
        console.print(f"[yellow]{', '.join(ignored)}: {'this option applies' if len(ignored) == 1 else 'these apply'} "
                      "across machines (--nnodes); on one machine the trainers read the tables in place, so it is "
                      "ignored", soft_wrap=True)
    console.print(f"[bold]cocosync train[/]: {cfg.sync.algorithm}, T={cfg.trainers} trainers x W={cfg.workers} "
                  f"workers, {cfg.examples:,} examples"
                  + (f" x {cfg.epochs} epochs" if cfg.epochs > 1 else "")
                  + f" of {escape(repr(cfg.data))}{_split_note(cfg)} -> {escape(str(cfg.out_dir))}/")
    try:
        result = run_training(cfg, console=console, resume=resume, cluster=cluster)
    except ConfigError as e:
        if debug_mode():
            raise
        raise click.UsageError(str(e)) from None
    except TrainerFailure as e:
        if debug_mode():
            raise
        console.print(f"[bold red]error:[/] {escape(str(e))}")  # tracebacks hold [brackets] rich would parse
        console.print(f"metrics so far: {escape(str(cfg.out_dir))}/metrics.jsonl")
        sys.exit(1)
    except KeyboardInterrupt:  # before the trainers started (data generation, model build)
        console.print("[yellow]interrupted before training started; nothing was trained")
        sys.exit(130)
    _print_result(console, result)
    if json_out:
        from cocosync.shadowsync.metrics import json_safe

        click.echo(json.dumps(json_safe(result.summary), default=str))
    if result.interrupted:  # stopped early, with a checkpoint: say by what in the exit status too
        from cocosync.shadowsync.job.monitor import exit_status

        sys.exit(exit_status(result.stop_reason))


def _run_node(nnodes: NodeRange, node_rank: int, nproc_per_node: int, rdzv_endpoint: str, local_addr: str | None,
              progress: bool | None, json_out: bool, config_path: str | None, resume: str | None,
              params: dict[str, Any]) -> None:
    """This machine's ranks of the multi-machine job (job/node_launch.py) the config options describe; exits."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from cocosync.shadowsync.job.node_launch import run_node, torchrun_args

    if nproc_per_node < 2:
        raise click.UsageError(f"--nproc-per-node={nproc_per_node}: expected nproc-per-node >= 2 (a server and a "
                               "trainer per node)")
    if not 0 <= node_rank < nnodes.high:
        raise click.UsageError(f"--node-rank {node_rank} is invalid with --nnodes {nnodes}: expected 0 .. "
                               f"{nnodes.high - 1} (node 0 hosts the rendezvous store)")
    try:
        host, port = parse_rendezvous_endpoint(rdzv_endpoint, default_port=29400)
    except ValueError as e:
        raise click.UsageError(f"--rdzv-endpoint {rdzv_endpoint!r} is invalid: {e} (expected HOST:PORT, e.g. "
                               "10.0.0.1:29400)") from None
    rdzv_endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # (torchrun's own default port: 29400)
    if local_addr is not None:
        import socket

        try:
            socket.getaddrinfo(local_addr, None)
        except OSError as e:
            why = f"--local-addr {local_addr!r} does not resolve to an address ({e})"
            raise click.UsageError(f"{why}: expected this machine's address the others reach it at") from None
    launch = torchrun_args(nnodes, node_rank, nproc_per_node, rdzv_endpoint, local_addr,
                           os.environ.get("COCOSYNC_RUN_ID", "cocosync-shadowsync"))
    try:
        cfg, cluster = rank_job(config_path, resume, params)
        code = run_node(launch, cfg, cluster, json_out, node_rank=node_rank, warm=warm_start.warm(),
                        progress=progress is not False)
    except ConfigError as e:
        if debug_mode():
            raise
        raise click.UsageError(str(e)) from None
    sys.exit(code)


def _fmt(v, spec: str) -> str:
    """A summary value formatted, '-' where it is missing (JSON's null for NaN)."""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _print_result(console, result) -> None:
    from rich.table import Table

    s = result.summary
    rows = [("examples", s["examples"], ","), ("examples/s (total)", s["eps"], ",.0f"),
            ("examples/s per trainer (total / T)", s["eps_per_trainer"], ",.0f"),
            ("train NE (window)", s["train_ne"], ".4f"), ("eval NE", s["eval_ne"], ".4f"),
            ("eval AUC", s["auc"], ".4f"), ("calibration (predicted / actual CTR)", s["calibration"], ".3f"),
            ("Bayes NE", s["bayes_ne"], ".4f"), ("excess NE over Bayes", s["excess_ne"], ".4f"),
            ("best eval NE (checkpoints/best)", s.get("best_eval_ne"), ".4f"),
            ("sync gap (iterations)", s["sync_gap"], ".2f"), ("syncs", s["syncs"], ","),
            ("training seconds", s["seconds"], ".1f")]
    table = Table(title=escape(f"ShadowSync run: {s['name']} (W={s['W']})"))
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v, spec in rows:
        if v is not None or "best" not in k:
            table.add_row(k, _fmt(v, spec))
    console.print(table)
    if s.get("resumed_from"):
        console.print(f"resumed after {s['resumed_from']:,} examples of the run it resumed"
                      + ("; nothing was left to train" if s["examples"] == 0 else ""))
    lost = s.get("lost") or []
    for x in lost:
        served = (f"; trainer {x['served_by']} served its part of the lookup exchange"
                  if x.get("served_by") is not None else "")
        console.print(f"[yellow]trainer {x['trainer']} was lost ({x['signal']}) after {x['examples']:,} examples"
                      f"{served}", soft_wrap=True)
    for x in s.get("restarts") or []:
        console.print(f"[green]trainer {x['trainer']} was started again (restart {x['restart']}): it trained "
                      f"{x['trains_after_s']:.1f} s after its start, from trainer {x['state_from']}'s model, and read "
                      f"{x['examples']:,} examples" + (" of its own rows" if x["read_own_rows"] else ""),
                      soft_wrap=True)
    if lost:
        left = s["trainers_left"]
        console.print(f"[yellow]{left} trainer{'s' if left > 1 else ''} finished the run"
                      + (f", reading the {s['takeover_rows']:,} rows {'it' if len(lost) == 1 else 'they'} had left"
                         if s.get("takeover_rows") else ""), soft_wrap=True)
    for x in s.get("lost_servers") or []:
        console.print(f"[yellow]embedding server {x['server']} was lost ({x['signal']}); the trainers used its shard "
                      "in shared memory to the end" + (", and the checkpoint holds it" if s.get("checkpoint") else ""),
                      soft_wrap=True)
    if (note := checkpoints_note(s)) is not None:
        console.print(f"[yellow]{note}", soft_wrap=True)
    if s.get("short_by") and s.get("lost"):
        console.print(f"finished, {s['short_by']:,} examples short of the budget: a trainer lost after the others' "
                      "last share-out left rows no one read", soft_wrap=True)
    elif s.get("short_by"):
        console.print(f"finished, {s['short_by']:,} examples short of the budget: a reader ran out of rows before its "
                      "share (bad lines skipped, or byte ranges not counted before the run: plain torchrun)",
                      soft_wrap=True)
    if result.interrupted or s.get("stopped"):
        console.print((f"[yellow]stopped by {result.stop_reason or 'a signal'}: the numbers cover the examples "
                       "trained before the stop" if result.interrupted else "stopped at --stop-after")
                      + (f"; continue with: cocosync train --resume {escape(str(result.out_dir))}"
                         if result.checkpoint else ""), soft_wrap=True)
    out = escape(str(result.out_dir))  # paths are the user's: '[red]' in one is text, not markup
    console.print(f"metrics: {out}/metrics.jsonl   summary: {out}/summary.json", soft_wrap=True)
    if result.plot:
        console.print(f"plot: {escape(str(result.plot))}", soft_wrap=True)
    if result.checkpoint:
        ck = escape(str(result.checkpoint))
        console.print(f"checkpoint: {ck}  (score it with: cocosync eval {ck})", soft_wrap=True)


@click.command("eval")
@click.argument("checkpoint", type=click.Path())
@click.option("--data", help="score on this Criteo-format file instead of the run's held-out set.")
@click.option("--examples", type=int, help="held-out examples to score (default: the run's eval_examples).")
@click.option("--json", "json_out", is_flag=True, help="print the metrics as JSON on stdout.")
def eval_checkpoint(checkpoint: str, data: str | None, examples: int | None, json_out: bool) -> None:
    """Score a checkpoint of `cocosync train` (NE, AUC, Bayes NE on synthetic data): a checkpoint directory
    (<out>/checkpoints/seen-N, <out>/checkpoints/best) or a run directory (its latest checkpoint)."""
    from cocosync.shadowsync.job.eval_curve import score_checkpoint
    from cocosync.shadowsync.metrics import summary_table

    try:
        ev = score_checkpoint(checkpoint, data, examples)
    except ConfigError as e:  # CheckpointError: the message names the checkpoint and what is wrong with it
        if debug_mode():
            raise
        raise click.UsageError(str(e)) from None
    path = ev.pop("path")
    make_console().print(summary_table([ev], title=escape(f"eval {path}")))
    if json_out:
        from cocosync.shadowsync.metrics import json_safe

        click.echo(json.dumps(json_safe(ev), default=str))
