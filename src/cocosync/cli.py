"""The `cocosync` command line. Each subcommand lives next to the code it drives and is registered here."""

from __future__ import annotations

import atexit
import os
import sys
import threading

import click

from cocosync.bench.backend import backend_cmd
from cocosync.bench.collectives import collectives_cmd
from cocosync.bench.data_split import data_split_cmd
from cocosync.bench.dp import dp_cmd
from cocosync.bench.faults import faults_cmd
from cocosync.bench.features import features_cmd
from cocosync.bench.job_start import job_start_cmd
from cocosync.bench.lookup_scaling import lookups_cmd
from cocosync.bench.pp import pp_cmd
from cocosync.bench.quality import quality_cmd
from cocosync.bench.real_data import real_data_cmd
from cocosync.bench.shadowsync import shadowsync as shadowsync_cmd
from cocosync.bench.sync import sync_cmd
from cocosync.bench.tp import tp_cmd
from cocosync.shadowsync.cli.data import data
from cocosync.shadowsync.cli.export import export, predict
from cocosync.shadowsync.cli.train import eval_checkpoint, train
from cocosync.show_cli import show
from cocosync.tune.cli import tune_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cocosync")
@click.option("--debug", is_flag=True, help="Show the traceback of an error instead of its one-line message.")
def main(debug: bool) -> None:
    """cocosync: take communication off the critical path of distributed PyTorch training."""
    if debug:
        os.environ["COCOSYNC_DEBUG"] = "1"


@main.group()
def bench() -> None:
    """Benchmarks: ours and the baselines side by side in one run (medians and ratios)."""


@main.command()
def demo() -> None:
    """The main job on the embedded default (synthetic data, local processes)."""
    from cocosync.demo import run_demo

    if not run_demo():
        raise SystemExit(1)


for _cmd in (train, eval_checkpoint, export, predict, data, show, tune_cmd):
    main.add_command(_cmd)
for _cmd in (collectives_cmd, backend_cmd, dp_cmd, tp_cmd, pp_cmd, shadowsync_cmd, quality_cmd, lookups_cmd, sync_cmd,
             data_split_cmd, real_data_cmd, job_start_cmd, features_cmd, faults_cmd):
    bench.add_command(_cmd)


def run() -> None:
    """The `cocosync` command: `main`, then exit as Python would, less the interpreter's teardown of torch's modules
    (~0.5 s of CPU, and as long again on a busy machine, after every command had finished). The threads still
    running are joined and the exit hooks run (logging's, temporary directories'), as at any exit; nothing is left
    to the teardown but the release of memory the kernel takes back anyway."""
    try:
        main()  # (standalone: it always ends in SystemExit)
        code: object = 0
    except SystemExit as e:
        code = e.code
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    if code is not None and not isinstance(code, int):  # what sys.exit("message") prints
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`cocosync ... | head`): nothing more can be said on it
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    run()
