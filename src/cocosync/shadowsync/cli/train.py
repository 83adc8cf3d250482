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

import click
from rich.markup import escape

from cocosync.shadowsync.job.roles import TRANSPORTS
from cocosync.shadowsync.train_config import (
    SYNC_ALGORITHMS,
    ConfigError,
    TrainConfig,
    config_from_dict,
    load_train_config,
)

__all__ = ["train", "eval_checkpoint", "train_options", "cluster_options", "config_from_options"]

_OPTS = {  # CLI option -> TrainConfig field
    "progress": "progress",
    "data": "data", "trainers": "trainers", "workers": "workers", "examples": "examples", "epochs": "epochs",
    "dense_weight_decay": "dense_weight_decay", "embedding_weight_decay": "embedding_weight_decay",
    "init_ctr": "model.init_ctr",
    "eval_examples": "eval_examples", "batch_size": "batch_size", "dense_lr": "dense_lr",
    "embedding_lr": "embedding_lr", "seed": "seed", "threads": "threads", "out": "out_dir",
    "timeout": "timeout", "heartbeat_timeout": "heartbeat_timeout", "sync": "sync.algorithm",
    "sync_every": "sync.every", "sync_interval": "sync.interval", "sync_groups": "sync.groups",
    "compiled_sync": "sync.compiled",
    "alpha": "sync.alpha", "block_momentum": "sync.block_momentum", "block_lr": "sync.block_lr",
    "replica_lr_scale": "sync.replica_lr_scale",
    "embedding_dim": "model.embedding_dim", "bottom_mlp": "model.bottom_mlp", "top_mlp": "model.top_mlp",
    "table_size": "data_options.table_size", "num_dense": "data_options.num_dense",
    "num_sparse": "data_options.num_sparse", "data_split": "data_options.split",
}


def _layer_sizes(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    """'64,16' -> [64, 16] (click callback: a bad list is a usage error naming the option)."""
    if value is None:
        return None
    try:
        sizes = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"{value!r}: expected comma-separated layer widths >= 1, e.g. 64,16")
    return sizes


def _console():
    """stderr; where it is not a terminal (CI, nohup, a log file) lines are not wrapped (a command to copy stays on
    one line) and tables get room for their full width."""
    import sys

    from rich.console import Console

    if sys.stderr.isatty():
        return Console(stderr=True)
    return Console(stderr=True, width=160, soft_wrap=True)


_TRAIN_OPTIONS = [
    click.option("--config", "config_path", type=click.Path(dir_okay=False),
                 help="TOML/JSON/YAML file of TrainConfig fields."),
    click.option("--data", help="'synthetic' or a Criteo-format TSV file (.gz accepted)."),
    click.option("--trainers", "-T", type=int,
                 help="trainer processes (with --nnodes: set by --nproc-per-node on every machine)."),
    click.option("--workers", "-W", type=int, help="Hogwild worker threads per trainer (each adds staleness: at T=1, "
                                                   "400k examples, W=2 cost 1.3% NE, W=8 12%; BENCHMARKS.md)."),
    click.option("--sync", type=click.Choice(SYNC_ALGORITHMS), help="dense sync algorithm."),
    click.option("--sync-every", type=int, help="fr-*: sync every k worker iterations [default: fr-bmuf 8, fr-ma "
                                                "and fr-easgd 4, measured at T=8 (BENCHMARKS.md)]."),
    click.option("--sync-groups", type=int, help="*-dssync: groups the trainers are split into each round."),
    click.option("--compiled-sync/--no-compiled-sync", default=None,
                 help="MA/BMUF as compiled DSL programs on shared memory and DS-Sync's groups on the cocosync "
                      "backend, or the classes on gloo."),
    click.option("--sync-interval", type=float, help="shadow-*: seconds between two syncs of the shadow thread."),
    click.option("--alpha", type=float, help="EASGD elasticity [default: min(0.5, 2/T) for shadow-easgd, 0.5 for "
                                           "fr-easgd; measured, BENCHMARKS.md]."),
    click.option("--block-momentum", type=float, help="BMUF block momentum."),
    click.option("--block-lr", type=float, help="BMUF block learning rate."),
    click.option("--replica-lr-scale", type=float, help="factor on the trainers' dense lr while they sync (default 1; "
                 "1/sqrt(T) helped shadow-bmuf in short runs only: BENCHMARKS.md)."),
    click.option("--examples", type=int, help="training examples over all trainers in one pass (the data set)."),
    click.option("--epochs", type=int, help="passes over those examples."),
    click.option("--embedding-dim", type=int, help="model: width of every embedding row."),
    click.option("--bottom-mlp", callback=_layer_sizes,
                 help="model: bottom MLP widths, e.g. 64,16 (the last must equal --embedding-dim)."),
    click.option("--top-mlp", callback=_layer_sizes, help="model: top MLP hidden widths, e.g. 64,32."),
    click.option("--table-size", type=int, help="data: rows per embedding table (categoricals are hashed into it; "
                 "~32x the distinct values of the largest categorical keeps collisions rare: `cocosync data "
                 "movielens` prints one)."),
    click.option("--num-dense", type=int, help="data files: integer features per line (Criteo and the synthetic "
                                               "data: 13)."),
    click.option("--num-sparse", type=int, help="data files: categorical features per line (Criteo and the "
                                                "synthetic data: 26)."),
    click.option("--eval-examples", type=int, help="held-out examples scored at the end."),
    click.option("--eval-data", type=click.Path(dir_okay=False),
                 help="a Criteo-format file to score on (default: a synthetic draw, or PATH's rows after the budget)."),
    click.option("--data-split", type=click.Choice(["auto", "bytes", "lines"]),
                 help="how workers share data files: bytes (each reads only its line-aligned byte range; plain files "
                      "with --eval-data), lines (interleaved; every reader scans the file), auto (bytes where it "
                      "applies)."),
    click.option("--batch-size", type=int, help="examples per worker iteration."),
    click.option("--dense-lr", type=float, help="dense (MLP) learning rate."),
    click.option("--embedding-lr", type=float, help="embedding row learning rate."),
    click.option("--dense-weight-decay", type=float, help="L2 of the dense parameters."),
    click.option("--embedding-weight-decay", type=float,
                 help="row-wise L2 of the embedding rows a batch touches (FBGEMM's L2 mode)."),
    click.option("--init-ctr", type=float, show_default="estimated from the data's first 100k rows",
                 help="click rate the model starts predicting."),
    click.option("--seed", type=int, help="model and synthetic-data seed."),
    click.option("--threads", type=int, help="intra-op torch threads per trainer."),
    click.option("--timeout", type=float, show_default="no limit",
                 help="stop this session (with a checkpoint and the summary) after this many seconds from launch; "
                      "a --resume does not inherit it."),
    click.option("--heartbeat-timeout", type=float,
                 help="fail naming a trainer silent this many seconds (stopped or hung)."),
    click.option("--out", type=click.Path(file_okay=False), help="output directory."),
]

_CLUSTER_OPTIONS = [
    click.option("--embedding-servers", type=int, default=1, show_default=True,
                 help="embedding parameter servers per machine (on one machine the trainers use the shards in "
                      "place)."),
    click.option("--sync-servers", type=int, default=None,
                 show_default="1 for EASGD, else 0", help="sync servers per machine holding EASGD's centre."),
    click.option("--lookup-batches", type=int, default=1, show_default=True,
                 help="multi-node: batches whose embedding lookups share one message per server (with prefetch)."),
    click.option("--eval-every", type=int, default=None,
                 help="score the model on the held-out set every this many examples (an eval NE curve; the best "
                      "model is kept as --out/checkpoints/best)."),
    click.option("--checkpoint-every", type=int, default=None,
                 help="also checkpoint every this many examples of the run (DCP directories under "
                      "--out/checkpoints): a killed run resumes from the last one."),
    click.option("--stop-after", type=int, default=None,
                 help="stop (with a checkpoint) once the run has seen this many examples (earlier sessions "
                      "included)."),
    click.option("--prefetch", type=int, default=None, show_default="40 with the exchange, 2 with rpc",
                 help="multi-node: batches whose embedding rows are requested ahead of the one training (0: none)."),
    click.option("--lookup-transport", type=click.Choice(TRANSPORTS), default="exchange", show_default=True,
                 help="multi-node: how lookups reach other machines' shards: rounds of one gloo all_to_all between "
                      "the trainers of every node; the same rounds between the nodes' first embedding servers, "
                      "which carry their trainers' rows through shared memory (node-exchange: one exchange per "
                      "node, for nodes with many trainers); or torch.distributed.rpc (a message per server and "
                      "batch: the former path)."),
    click.option("--exchange-interval", type=float, default=40.0, show_default=True,
                 help="multi-node: milliseconds between two rounds of the lookup exchange (shorter: fresher rows, "
                      "more CPU per example)."),
    click.option("--hot-rows", type=int, default=4096, show_default=True,
                 help="multi-node: the rows seen most often in the first training rows, replicated on every machine "
                      "and synchronized in the background (with the exchange; 0: none)."),
    click.option("--hot-sync-interval", type=float, default=40.0, show_default=True,
                 help="multi-node: milliseconds between two syncs of the replicated hot rows (shorter: fresher hot "
                      "rows, more CPU and bytes); with --hot-staleness, the longest."),
    click.option("--hot-staleness", type=float, default=0.0, show_default=True,
                 help="multi-node: sync the hot rows as often as it takes (down to every 2 ms) to keep the other "
                      "nodes' updates a use misses near this many (0: every --hot-sync-interval)."),
]


def _config_default(field: str) -> object:
    """The value a TrainConfig field (dotted: sync.*, model.*, data_options.*) has when nothing sets it."""
    from cocosync.shadowsync.config import DataConfig, ModelConfig

    head, _, tail = field.partition(".")
    if head == "model":
        return getattr(ModelConfig(), tail, None)
    if head == "data_options":
        return getattr(DataConfig(), tail, None)
    value = getattr(TrainConfig(), head)
    return getattr(value, tail) if tail else value


def _shown(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:,}" if isinstance(value, int) else str(value)


def train_options(f):
    """The TrainConfig options shared by `cocosync train` and `python -m cocosync.shadowsync` (under torchrun);
    --help shows each one's TrainConfig default (the options themselves default to None: unset, so that a --config
    file or a resumed run's config fills them)."""
    for option in reversed(_TRAIN_OPTIONS):
        f = option(f)
    for param in getattr(f, "__click_params__", []):
        field = _OPTS.get(param.name)
        if field is not None and not param.show_default:  # (unset: click 8.2 has a sentinel, earlier None)
            param.show_default = _shown(_config_default(field))
    return f


def show_defaults(command: click.Command) -> click.Command:
    """--help in one style: every option with a default shows it as the TrainConfig-backed ones do."""
    for param in command.params:
        if param.show_default is True:
            param.show_default = _shown(param.default)
    return command


def cluster_options(f):
    """The multi-machine options (ClusterConfig: the roles of the torchrun ranks)."""
    for option in reversed(_CLUSTER_OPTIONS):
        f = option(f)
    return f


def _split_note(cfg: TrainConfig) -> str:
    """How the workers share a data file (said up front: 'lines' means every reader scans all of it)."""
    if cfg.data == "synthetic":
        return ""
    from cocosync.shadowsync.data.sources import build_configs

    try:
        split = build_configs(cfg)[0].reader_split
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    return " (workers read their byte ranges)" if split == "bytes" else " (workers read interleaved lines)"


def config_from_options(config_path: str | None, resume: str | None, opts: dict) -> TrainConfig:
    """The TrainConfig the options describe (command line over --config over --resume's); UsageError if bad."""
    eval_data = opts.pop("eval_data", None)
    overrides = {_OPTS[k]: v for k, v in opts.items() if v is not None}
    try:
        if config_path:
            cfg = load_train_config(config_path, **overrides)
        elif resume:  # the run's settings, less the session's own limit
            saved = {k: v for k, v in _checkpoint_config(resume).items() if k != "timeout"}
            cfg = config_from_dict(saved, **overrides)
        else:
            cfg = config_from_dict({}, **overrides)
        if eval_data is not None:
            cfg = dataclasses.replace(cfg, data_options={**cfg.data_options, "eval_path": eval_data})
        if opts.get("eval_examples") is not None and "eval_rows" in cfg.data_options:  # the command line wins
            cfg = dataclasses.replace(cfg, data_options={k: v for k, v in cfg.data_options.items() if k != "eval_rows"})
        return cfg
    except ConfigError as e:
        if debug_mode():
            raise
        raise click.UsageError(str(e)) from None


@show_defaults
@click.command()
@train_options
@click.option("--progress/--no-progress", default=None,
              help="progress bar while training (with --nnodes: a line on the whole job every 5 s).")
@click.option("--resume", type=click.Path(),
              help="continue a run (e.g. one stopped by Ctrl-C) from a checkpoint directory, or a run directory (its "
                   "latest checkpoint), with its config.")
@click.option("--json", "json_out", is_flag=True, help="also print the summary as JSON on stdout.")
@click.option("--nnodes", type=int,
              help="multi-node: machines in the job (runs torchrun's agent for this one; see --rdzv-endpoint).")
@click.option("--node-rank", type=int, default=0, show_default=True,
              help="multi-node: this machine's index (0 hosts the rendezvous store).")
@click.option("--nproc-per-node", type=int, default=2, show_default=True,
              help="multi-node: processes per machine (servers first, then trainers).")
@click.option("--rdzv-endpoint", default="127.0.0.1:29400", show_default=True,
              help="multi-node: HOST:PORT of the rendezvous (torchrun's c10d store; node 0 hosts it).")
@click.option("--local-addr", default=None,
              help="multi-node: the address the other machines reach this one's ranks at (default: 127.0.0.1 with a "
                   "loopback --rdzv-endpoint, else this machine's hostname).")
@cluster_options
def train(config_path: str | None, progress: bool | None, resume: str | None, json_out: bool, nnodes: int | None,
          node_rank: int, nproc_per_node: int, rdzv_endpoint: str, local_addr: str | None, embedding_servers: int,
          sync_servers: int | None, prefetch: int, stop_after: int | None, checkpoint_every: int | None,
          lookup_batches: int, lookup_transport: str, exchange_interval: float, hot_rows: int, hot_sync_interval: float,
          hot_staleness: float, eval_every: int | None, **opts) -> None:
    """Train a DLRM with T trainers x W Hogwild workers and ShadowSync (shared embeddings, dense sync).

    Ctrl-C stops the trainers cleanly and keeps what was measured (metrics, summary, checkpoint);
    a second Ctrl-C aborts. With --nnodes, the job spans machines: this command runs torchrun's agent for this
    machine (the job of `torchrun ... -m cocosync.shadowsync`, its ranks forked warm), with embedding parameter
    servers and sync servers; Ctrl-C, SIGTERM or --timeout on any machine stops every machine's trainers.
    """
    from cocosync.shadowsync.job.launch import run_training
    from cocosync.shadowsync.job.roles import ClusterConfig
    from cocosync.shadowsync.job.trainer import TrainerFailure

    if nnodes is not None:
        _run_node(nnodes, node_rank, nproc_per_node, rdzv_endpoint, local_addr, progress)
    if progress is not None:
        opts["progress"] = progress
    cfg = config_from_options(config_path, resume, opts)
    console = _console()
    console.print(f"[bold]cocosync train[/]: {cfg.sync.algorithm}, T={cfg.trainers} trainers x W={cfg.workers} "
                  f"workers, {cfg.examples:,} examples"
                  + (f" x {cfg.epochs} epochs" if cfg.epochs > 1 else "")
                  + f" of {escape(repr(cfg.data))}{_split_note(cfg)} -> {escape(str(cfg.out_dir))}/")
    try:
        cluster = ClusterConfig(embedding_servers=embedding_servers, sync_servers=sync_servers, prefetch=prefetch,
                                lookup_batches=lookup_batches, lookup_transport=lookup_transport,
                                exchange_interval=exchange_interval / 1e3, hot_rows=hot_rows,
                                hot_sync_interval=hot_sync_interval / 1e3, hot_staleness=hot_staleness)
        result = run_training(cfg, console=console, resume=resume, checkpoint_every=checkpoint_every,
                              stop_after=stop_after, eval_every=eval_every, cluster=cluster)
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
        from cocosync.shadowsync.job.trainer import json_safe

        click.echo(json.dumps(json_safe(result.summary), default=str))
    if result.interrupted:  # stopped early, with a checkpoint: say by what in the exit status too
        from cocosync.shadowsync.job.monitor import exit_status

        sys.exit(exit_status(result.stop_reason))


def _run_node(nnodes: int, node_rank: int, nproc_per_node: int, rdzv_endpoint: str, local_addr: str | None,
              progress: bool | None) -> None:
    """This machine's ranks of the multi-machine job (job/node_launch.py), with the remaining arguments; exits."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from cocosync.shadowsync.job.launch import WARM_START_ENV
    from cocosync.shadowsync.job.node_launch import run_node, torchrun_args

    if nnodes < 1 or nproc_per_node < 2:
        raise click.UsageError(f"--nnodes={nnodes}, --nproc-per-node={nproc_per_node}: expected nnodes >= 1 and "
                               "nproc-per-node >= 2 (a server and a trainer per node)")
    if not 0 <= node_rank < nnodes:
        raise click.UsageError(f"--node-rank {node_rank} is invalid with --nnodes {nnodes}: expected 0 .. {nnodes - 1} "
                               "(node 0 hosts the rendezvous store)")
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
    args, skip = [], False
    argv = sys.argv[sys.argv.index("train") + 1:] if "train" in sys.argv else sys.argv[1:]
    for a in argv:  # drop the launcher's own options, keep the training options
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in _NODE_OPTIONS:
            skip = "=" not in a
            continue
        if name in ("--progress", "--no-progress"):  # (the launcher's: a line on the job every 5 s)
            continue
        args.append(a)
    launch = torchrun_args(nnodes, node_rank, nproc_per_node, rdzv_endpoint, local_addr,
                           os.environ.get("COCOSYNC_RUN_ID", "cocosync-shadowsync"))
    try:
        code = run_node(launch, args, warm=os.environ.get(WARM_START_ENV, "1") != "0", progress=progress is not False)
    except ConfigError as e:
        if debug_mode():
            raise
        raise click.UsageError(str(e)) from None
    sys.exit(code)


_NODE_OPTIONS = ("--nnodes", "--node-rank", "--nproc-per-node", "--rdzv-endpoint", "--local-addr")


def debug_mode() -> bool:
    """`cocosync --debug ...`: errors show their traceback."""
    return os.environ.get("COCOSYNC_DEBUG") == "1"


def _checkpoint_config(path: str) -> dict:
    from cocosync.shadowsync.checkpoint import read_meta, resolve

    return dict(read_meta(resolve(path))["config"])


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
        console.print(f"resumed after {s['resumed_from']:,} examples of an earlier session"
                      + ("; nothing was left to train" if s["examples"] == 0 else ""))
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
    _console().print(summary_table([ev], title=escape(f"eval {path}")))
    if json_out:
        from cocosync.shadowsync.job.trainer import json_safe

        click.echo(json.dumps(json_safe(ev), default=str))
