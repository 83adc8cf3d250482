"""The command-line options of a ShadowSync job, generated from the config classes (config.py): every field with
`opt(...)` metadata becomes one option, its help text the field's docstring, its shown default the field's default.
`cocosync train` and `python -m cocosync.shadowsync` (one rank under torchrun) share them; `--help` lists them by
section. What the options describe: command line over `--config FILE` over a resumed run's config."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable

import click
from rich.console import Console

from cocosync.shadowsync import config as config_module
from cocosync.shadowsync.checkpoint import read_meta, resolve, resumed_run_dir
from cocosync.shadowsync.config import (
    ClusterConfig,
    ConfigError,
    DataConfig,
    ModelConfig,
    Opt,
    SyncConfig,
    TrainConfig,
    config_from_dict,
    load_job_config,
    load_train_config,
)
from cocosync.shadowsync.errors import debug_mode

__all__ = ["OPTIONS", "SECTIONS", "ConfigOption", "SectionedCommand", "config_options", "config_from_options",
           "job_from_options", "show_defaults", "console"]

#: the --help sections, in order; a command's own options (--config, --resume, --nnodes, ...) come first
SECTIONS = ("Data", "Model", "Trainers", "Optimizer", "Sync", "Cluster", "Checkpoints and eval", "Run")
#: TrainConfig fields that hold another config class (their fields are options too), and the cluster tree's root
_NESTED: dict[str, type] = {"sync": SyncConfig, "model": ModelConfig, "data_options": DataConfig}
_CLUSTER = "cluster"


@dataclass(frozen=True)
class ConfigOption:
    """One command-line option and the config field it sets."""

    path: str
    """the field, dotted from TrainConfig ('trainers', 'sync.algorithm', 'model.embedding_dim'), or from
    ClusterConfig under 'cluster.' ('cluster.hot_rows')."""
    spec: Opt
    annotation: str
    default: Any
    help: str

    @property
    def param(self) -> str:
        """click's parameter name (an identifier)."""
        return self.path.replace(".", "__")

    def value(self, typed: Any) -> Any:
        """The config value of what was typed (None: not given)."""
        if typed is None or self.spec.scale == 1.0:
            return typed
        return typed * self.spec.scale


_CONFIG_SOURCE = ast.parse(inspect.getsource(config_module))  # the field docstrings are the options' help


def _field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring (the string literal after its annotation), whitespace collapsed}."""
    node = next(n for n in _CONFIG_SOURCE.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs = {}
    for a, b in zip(node.body, node.body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def _options_of(cls: type, prefix: str) -> list[ConfigOption]:
    docs = _field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in _NESTED and cls is TrainConfig:
            out += _options_of(_NESTED[f.name], f"{f.name}.")
        spec = f.metadata.get("opt")
        if spec is not None:
            default = f.default if f.default is not dataclasses.MISSING else None
            out.append(ConfigOption(prefix + f.name, spec, str(f.type), default, docs.get(f.name, "")))
    return out


#: every option, in the order --help lists them within a section
OPTIONS: tuple[ConfigOption, ...] = (*_options_of(TrainConfig, ""), *_options_of(ClusterConfig, f"{_CLUSTER}."))
_BY_PARAM = {o.param: o for o in OPTIONS}


def _widths(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    """'64,16' -> [64, 16], as a config file holds it (a bad list is a usage error naming the option)."""
    if value is None:
        return None
    try:
        sizes = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"{value!r}: expected comma-separated layer widths >= 1, e.g. 64,16")
    return sizes


def _names(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    """'a,b' -> ['a', 'b'] (column names)."""
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise click.BadParameter(f"{value!r}: expected comma-separated column names")
    return names


def _shown(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _click_option(o: ConfigOption) -> Callable:
    """The click option of `o`; unset options default to None, so that a --config file or a resumed run fills them."""
    spec, kind = o.spec, o.annotation.split("|")[0].strip()
    names = [spec.flag, *([spec.short] if spec.short else [])]
    shown = spec.shown or _shown(o.default / spec.scale if spec.scale != 1.0 and o.default else o.default)
    kw: dict[str, Any] = {"default": None, "show_default": shown, "help": o.help}
    if kind == "bool":
        return click.option(f"{spec.flag}/--no-{spec.flag[2:]}", o.param, **kw)
    if kind.startswith("tuple[str"):
        return click.option(*names, o.param, callback=_names, **kw)
    if kind.startswith("tuple"):
        return click.option(*names, o.param, callback=_widths, **kw)
    if spec.choices:
        kw["type"] = click.Choice(spec.choices)
    elif spec.path:
        kw["type"] = click.Path(dir_okay=False)
    else:
        kw["type"] = {"int": int, "float": float}.get(kind, str)
    return click.option(*names, o.param, **kw)


def config_options(f: Callable) -> Callable:
    """Add every config option (OPTIONS) to a click command."""
    for o in reversed(OPTIONS):
        f = _click_option(o)(f)
    return f


class SectionedCommand(click.Command):
    """A command whose --help lists the config options under their sections (SECTIONS), after its own."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                option = _BY_PARAM.get(param.name or "")
                groups.setdefault(option.spec.section if option else "Options", []).append(record)
        for name in ("Options", *SECTIONS):
            if name in groups:
                with formatter.section(name if name == "Options" else f"{name} options"):
                    formatter.write_dl(groups[name])


def show_defaults(command: click.Command) -> click.Command:
    """--help in one style: a command's own options with a default show it as the config options do."""
    for param in command.params:
        if param.show_default is True:
            param.show_default = _shown(param.default)
    return command


def console() -> Console:
    """stderr; where it is not a terminal (CI, nohup, a log file) lines are not wrapped (a command to copy stays on
    one line) and tables get room for their full width."""
    if sys.stderr.isatty():
        return Console(stderr=True)
    return Console(stderr=True, width=160, soft_wrap=True)


def config_from_options(config_path: str | None, resume: str | None, opts: dict[str, Any]) -> TrainConfig:
    """The TrainConfig the (non-cluster) options describe: command line over --config over --resume's; UsageError
    if bad. `opts`: click's parameters, by `ConfigOption.param`."""
    overrides = {_BY_PARAM[k].path: _BY_PARAM[k].value(v) for k, v in opts.items() if v is not None}
    try:
        if config_path:
            cfg = load_train_config(config_path, **overrides)
        elif resume:  # the run's settings, less the session's own limit; written where the user points
            path = resolve(resume)
            saved = {k: v for k, v in read_meta(path)["config"].items() if k != "timeout"}
            if "out_dir" not in overrides:
                saved["out_dir"] = str(resumed_run_dir(path, resume))
            cfg = config_from_dict(saved, **overrides)
        else:
            cfg = config_from_dict({}, **overrides)
        if opts.get("eval_examples") is not None and "eval_rows" in cfg.data_options:  # the command line wins
            cfg = dataclasses.replace(cfg, data_options={k: v for k, v in cfg.data_options.items() if k != "eval_rows"})
        return cfg
    except ConfigError as e:
        if debug_mode():
            raise
        raise click.UsageError(str(e)) from None


def job_from_options(config_path: str | None, resume: str | None, params: dict[str, Any],
                     cluster_fields: dict[str, Any] | None = None) -> tuple[TrainConfig, ClusterConfig]:
    """The TrainConfig and ClusterConfig a command's parsed config options describe (`params`, by param name), over
    `--config FILE` (its [cluster] table too), over `resume`'s run; `cluster_fields`: ClusterConfig fields the
    command sets itself. ConfigError if bad."""
    prefix = f"{_CLUSTER}__"
    cluster = dict(cluster_fields or {})
    train = {k: v for k, v in params.items() if not k.startswith(prefix)}
    for k, v in params.items():
        if k.startswith(prefix) and v is not None:
            cluster[k.removeprefix(prefix)] = _BY_PARAM[k].value(v)
    cfg = config_from_options(config_path, resume, train)
    if config_path:
        return cfg, load_job_config(config_path, cluster)[1]
    return cfg, ClusterConfig(**cluster)
