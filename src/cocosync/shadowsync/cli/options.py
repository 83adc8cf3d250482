"""The command-line options of a ShadowSync job, shared by `cocosync train` and `python -m cocosync.shadowsync`
(one rank under torchrun), and the TrainConfig they describe: command line over `--config FILE` over a resumed run's
config. `--help` shows each option's TrainConfig default."""

from __future__ import annotations

import dataclasses
import sys

import click
from rich.console import Console

from cocosync.shadowsync.checkpoint import read_meta, resolve
from cocosync.shadowsync.config import DataConfig, ModelConfig
from cocosync.shadowsync.errors import debug_mode
from cocosync.shadowsync.job.roles import TRANSPORTS
from cocosync.shadowsync.train_config import (
    SYNC_ALGORITHMS,
    ConfigError,
    TrainConfig,
    config_from_dict,
    load_train_config,
)

__all__ = ["train_options", "cluster_options", "config_from_options", "show_defaults", "console"]

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


def console() -> Console:
    """stderr; where it is not a terminal (CI, nohup, a log file) lines are not wrapped (a command to copy stays on
    one line) and tables get room for their full width."""
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
                      "batch: the measured baseline)."),
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


def _checkpoint_config(path: str) -> dict:
    return dict(read_meta(resolve(path))["config"])


