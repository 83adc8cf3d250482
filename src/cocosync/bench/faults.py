"""``cocosync bench faults``: what a lost trainer costs a one-machine job. For each seed, the same job (`cocosync
train`, T trainers, shadow-bmuf by default) runs twice: uninterrupted, and with one trainer killed (kill -9) once the
job has trained `--at` of its examples. Per run: the eval NE, the examples trained (every one, or the shortfall), how
long after the kill its keeper recorded the loss and the trainers left had re-formed their sync, and the wall time.
The target: the job finishes with no example lost and an eval NE within 0.5% of the uninterrupted run's, over the
seeds (their mean, the worst named)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click
from rich.console import Console

from cocosync.bench.common import markdown_table, print_table, write_json
from cocosync.testing.sockets import job_ranks

__all__ = ["faults_cmd", "NE_TARGET"]

NE_TARGET = 0.005
COLUMNS = ["seed", "eval NE uninterrupted", "eval NE, trainer killed", "NE change", "examples lost",
           "loss recorded (s after kill)", "sync re-formed (s after kill)", "seconds (uninterrupted / killed)"]


def _command(out: Path, seed: int, examples: int, trainers: int, sync: str) -> list[str]:
    return [sys.executable, "-m", "cocosync.cli", "train", "--examples", str(examples), "-T", str(trainers),
            "--seed", str(seed), "--sync", sync, "--out", str(out), "--no-progress", "--timeout", "1800"]


def _run(cmd: list[str], out: Path) -> dict:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise click.ClickException(f"{' '.join(cmd)} failed: {(done.stderr or done.stdout)[-800:]}")
    return json.loads((out / "summary.json").read_text())


def _run_killing(cmd: list[str], out: Path, victim: int, at: int) -> tuple[dict, float]:
    """Run `cmd`, kill -9 trainer `victim` once the job has trained `at` examples; (summary, time of the kill)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    killed_at = None
    try:
        metrics = out / "metrics.jsonl"
        while killed_at is None and proc.poll() is None:
            time.sleep(0.05)
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            records = [json.loads(x) for x in lines if x.strip().endswith("}")]
            if any(r.get("event") == "train" and r.get("examples", 0) >= at for r in records):
                pid = job_ranks(proc.pid).get(victim + 1)  # (local rank 0: the embedding server)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.time()
        _, err = proc.communicate(timeout=3600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    if proc.returncode != 0 or killed_at is None:
        raise click.ClickException(f"{' '.join(cmd)} failed or ended before the kill: {err[-800:]}")
    return json.loads((out / "summary.json").read_text()), killed_at


@click.command("faults")
@click.option("--seeds", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--trainers", "-T", type=click.IntRange(min=2), default=4, show_default=True)
@click.option("--examples", type=click.IntRange(min=10_000), default=2_000_000, show_default=True,
              help="examples of every run.")
@click.option("--at", type=click.FloatRange(0.0, 0.95), default=0.3, show_default=True,
              help="the kill comes once the job has trained this fraction of its examples.")
@click.option("--sync", default="shadow-bmuf", show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default="runs/bench-faults", show_default=True)
def faults_cmd(seeds: int, trainers: int, examples: int, at: float, sync: str, out: str) -> None:
    """A trainer killed (kill -9) during a one-machine job against the same job uninterrupted, over seeds: eval NE,
    examples lost, how soon the job recovered."""
    console = Console(width=180)
    root = Path(out)
    rows, changes, lost, recorded, reformed = [], [], [], [], []
    victim = 1
    for seed in range(seeds):
        base_out, kill_out = root / f"seed{seed}-uninterrupted", root / f"seed{seed}-killed"
        base = _run(_command(base_out, seed, examples, trainers, sync), base_out)
        hit, killed_at = _run_killing(_command(kill_out, seed, examples, trainers, sync), kill_out, victim,
                                      int(at * examples))
        change = hit["eval_ne"] / base["eval_ne"] - 1
        loss = hit["lost"][0] if hit.get("lost") else None
        rec = loss["time"] - killed_at if loss else float("nan")
        ref = (hit.get("regrouped_at") or float("nan")) - killed_at
        changes.append(change)
        lost.append(examples - hit["examples"])
        recorded.append(rec)
        reformed.append(ref)
        rows.append([seed, f"{base['eval_ne']:.4f}", f"{hit['eval_ne']:.4f}", f"{change:+.2%}",
                     f"{examples - hit['examples']:,}", f"{rec:.2f}", f"{ref:.2f}",
                     f"{base['seconds']:.1f} / {hit['seconds']:.1f}"])
        console.print(f"  seed {seed}: eval NE {base['eval_ne']:.4f} uninterrupted, {hit['eval_ne']:.4f} with trainer "
                      f"{victim} killed ({change:+.2%}); lost {loss['trainer'] if loss else '-'}")
    mean = statistics.fmean(changes)
    worst = max(changes, key=abs)
    rows.append(["mean", "", "", f"{mean:+.2%} (worst {worst:+.2%})", f"{max(lost):,} (most)",
                 f"{statistics.median(recorded):.2f} (median)", f"{statistics.median(reformed):.2f} (median)", ""])
    title = (f"a trainer killed at {at:.0%} of {examples:,} examples, T={trainers}, {sync}, {seeds} seeds "
             f"(os.cpu_count()={os.cpu_count()})")
    print_table(title, COLUMNS, rows, console)
    console.print(markdown_table(COLUMNS, rows), markup=False)
    ok = abs(mean) <= NE_TARGET and max(lost) == 0
    console.print(f"{'PASS' if ok else 'FAIL'}: every run finished, {max(lost):,} examples lost at most, eval NE "
                  f"{mean:+.2%} on average against the uninterrupted runs (target: 0 lost, within "
                  f"{NE_TARGET:.1%})")
    write_json(root / "faults.json", {"ne_change": changes, "examples_lost": lost, "loss_recorded_s": recorded,
                                      "sync_reformed_s": reformed, "trainers": trainers, "examples": examples,
                                      "at": at, "sync": sync})
