"""``cocosync bench job-start``: what a small ShadowSync job on one machine costs beyond its training, with its ranks
forked from the warm fork server (runtime/warm_start.py) against started cold (`COCOSYNC_WARM_START=0`: a fresh
`python -m cocosync.shadowsync` per rank, each importing torch).

Two ways a user starts a job: `cocosync train` (a new launcher process each time, which imports torch too) and
`run_training` called again in a process that already ran one (a script, a sweep, the tests). The four cases run
round-robin after one warm-up round (which starts the fork server of the in-process case). Per case: the median wall
seconds of a job, the median CPU seconds of the whole machine during it (/proc/stat: the launcher, the fork server and
every rank), and the job's own training seconds (its summary), the part no start-up change can remove."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import click
from rich.console import Console

from cocosync.bench.common import fmt_ratio, markdown_table, print_table, time_interleaved, write_json
from cocosync.shadowsync.config import TrainConfig
from cocosync.shadowsync.job.launch import run_training

COLUMNS = ["how", "ranks", "wall s (median)", "machine CPU s (median)", "training s", "cold / warm wall",
           "cold / warm CPU"]
STARTS = ("warm", "cold")
HOWS = ("in-process", "command")


def machine_cpu_seconds() -> float | None:
    """CPU seconds every core has spent busy since boot (user, nice, system, irq, softirq), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:8]]
    except OSError:
        return None
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def _job(how: str, start: str, args: dict[str, Any], out: Path, record: Callable[[dict], None]) -> Callable[[], None]:
    def run() -> None:
        shutil.rmtree(out, ignore_errors=True)
        warm = "1" if start == "warm" else "0"
        if how == "in-process":
            os.environ["COCOSYNC_WARM_START"] = warm
            with open(os.devnull, "w") as quiet:
                cfg = TrainConfig(out_dir=str(out), progress=False, **args)
                result = run_training(cfg, console=Console(file=quiet))
            record(result.summary)
        else:
            cmd = [sys.executable, "-m", "cocosync_start", "train", "--no-progress", "--out", str(out),
                   *[x for k, v in args.items() for x in (f"--{k.replace('_', '-')}", str(v))]]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "COCOSYNC_WARM_START": warm})
            if proc.returncode:
                raise click.ClickException(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
            record(json.loads((out / "summary.json").read_text()))
    return run


def run(examples: int, trainers: int, repeats: int, hows: tuple[str, ...] = HOWS, warmup: int = 1) -> dict[str, Any]:
    args = {"examples": examples, "eval_examples": max(1000, examples // 2), "trainers": trainers}
    cpu: dict[tuple[str, str], list[float]] = {}
    training: dict[tuple[str, str], list[float]] = {}
    saved = os.environ.get("COCOSYNC_WARM_START")
    with tempfile.TemporaryDirectory(prefix="cocosync-bench-start-") as tmp:
        cases = {}
        for how in hows:
            for start in STARTS:
                key = (how, start)
                cpu[key], training[key] = [], []
                job = _job(how, start, args, Path(tmp) / f"{how}-{start}",
                           lambda s, key=key: training[key].append(float(s["seconds"])))
                cases[key] = _with_cpu(job, cpu[key])
        try:
            walls = time_interleaved(cases, repeats, warmup=warmup)
        finally:
            if saved is None:
                os.environ.pop("COCOSYNC_WARM_START", None)
            else:
                os.environ["COCOSYNC_WARM_START"] = saved
    rows = []
    for how in hows:
        med = {s: _medians(walls[(how, s)], cpu[(how, s)][warmup:], training[(how, s)][warmup:]) for s in STARTS}
        for s in STARTS:
            rows.append({"how": how, "start": s, **med[s],
                         "wall_ratio": med["cold"]["wall_s"] / med[s]["wall_s"],
                         "cpu_ratio": (med["cold"]["cpu_s"] / med[s]["cpu_s"]) if med[s]["cpu_s"] else None})
    return {"examples": examples, "trainers": trainers, "repeats": repeats, "warmup": warmup, "rows": rows,
            "samples": {f"{h}/{s}": walls[(h, s)] for h in hows for s in STARTS}}


def _with_cpu(fn: Callable[[], None], into: list[float]) -> Callable[[], None]:
    def timed() -> None:
        c0 = machine_cpu_seconds()
        fn()
        c1 = machine_cpu_seconds()
        if c0 is not None and c1 is not None:
            into.append(c1 - c0)
    return timed


def _medians(wall: list[float], cpu: list[float], training: list[float]) -> dict[str, float | None]:
    return {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu) if cpu else None,
            "training_s": statistics.median(training)}


def table_rows(result: dict) -> list[list[str]]:
    return [[r["how"], r["start"], f"{r['wall_s']:.2f}", "-" if r["cpu_s"] is None else f"{r['cpu_s']:.2f}",
             f"{r['training_s']:.2f}", fmt_ratio(r["wall_ratio"]), fmt_ratio(r["cpu_ratio"])]
            for r in result["rows"]]


@click.command("job-start")
@click.option("--examples", default=4000, show_default=True, type=click.IntRange(1000), help="examples per job.")
@click.option("--trainers", default=2, show_default=True, type=click.IntRange(1, 64), help="trainers per job.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1), help="timed jobs per case.")
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(0),
              help="untimed rounds first (the first warm job in this process also starts the fork server).")
@click.option("--how", "hows", type=click.Choice(HOWS), multiple=True, default=HOWS, show_default=True,
              help="how jobs are started: `cocosync train` each (command), or run_training in this process.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write results as JSON.")
@click.option("--markdown", is_flag=True, help="also print the table as markdown (for BENCHMARKS.md).")
def job_start_cmd(examples: int, trainers: int, repeats: int, warmup: int, hows: tuple[str, ...],
                  json_path: str | None, markdown: bool) -> None:
    """A small job's cost beyond its training: ranks forked warm vs started cold."""
    t0 = time.perf_counter()
    result = run(examples, trainers, repeats, hows, warmup)
    caption = "cold / warm wall time: " + ", ".join(f"{r['how']} {fmt_ratio(r['wall_ratio'])}" for r in result["rows"]
                                                    if r["start"] == "warm")
    print_table(f"a {examples:,}-example job with {trainers} trainers, {repeats} rounds "
                f"({time.perf_counter() - t0:.0f} s)", COLUMNS, table_rows(result), caption=caption)
    if markdown:
        click.echo(markdown_table(COLUMNS, table_rows(result)))
    if json_path:
        write_json(json_path, {"suite": "job-start", **result})
        click.echo(f"wrote {json_path}")
