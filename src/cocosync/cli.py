"""The `cocosync` command line. Each subcommand lives next to the code it drives and is registered here."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cocosync")
def main() -> None:
    """cocosync: take communication off the critical path of distributed PyTorch training."""


@main.group()
def bench() -> None:
    """Benchmarks: ours and the baselines side by side in one run (medians and ratios)."""


@main.command()
def demo() -> None:
    """The main job on the embedded default (synthetic data, local processes)."""
    from cocosync.demo import run_demo

    if not run_demo():
        raise SystemExit(1)


from cocosync.shadowsync.data_cli import data  # noqa: E402  (registers `cocosync data ...`)

main.add_command(data)

from cocosync.shadowsync.train_cli import eval_checkpoint, train  # noqa: E402

main.add_command(train)
main.add_command(eval_checkpoint)

from cocosync.bench.shadowsync import shadowsync as bench_shadowsync  # noqa: E402

bench.add_command(bench_shadowsync)

from cocosync.show_cli import show  # noqa: E402  (registers `cocosync show FILE.py|NAME`)

main.add_command(show)

from cocosync.bench.collectives import collectives_cmd  # noqa: E402  (`cocosync bench collectives`)

bench.add_command(collectives_cmd)
bench.add_command(__import__("cocosync.bench.dp", fromlist=["dp_cmd"]).dp_cmd)  # `cocosync bench dp`
bench.add_command(__import__("cocosync.bench.pp", fromlist=["pp_cmd"]).pp_cmd)  # `cocosync bench pp`
bench.add_command(__import__("cocosync.bench.tp", fromlist=["tp_cmd"]).tp_cmd)  # `cocosync bench tp`

if __name__ == "__main__":
    main()
