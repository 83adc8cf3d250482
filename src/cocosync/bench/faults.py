"""``cocosync bench faults``: what a lost trainer or embedding server costs a one-machine job. For each seed, the same
job (`cocosync train`, T trainers, shadow-bmuf by default) runs uninterrupted, and once per kind of rank in `--kill`
with one such rank killed (kill -9: trainer 1, or embedding server 0) once the job has trained `--at` of its examples.
Per run: the eval NE, the examples trained (every one, or the shortfall), how long after the kill its keeper recorded
the loss and (a trainer) the trainers left had re-formed their sync, and the wall time. The target: the job finishes
with no example lost and an eval NE within 0.5% of the uninterrupted run's, over the seeds (their mean, the worst
named), for each kind."""

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
COLUMNS = ["killed", "seed", "eval NE uninterrupted", "eval NE, killed", "NE change", "examples lost",
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
    """Run `cmd`, kill -9 the rank at local rank `victim` once the job has trained `at` examples; (summary, time of
    the kill)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    killed_at = None
    try:
        metrics = out / "metrics.jsonl"
        while killed_at is None and proc.poll() is None:
            time.sleep(0.05)
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            records = [json.loads(x) for x in lines if x.strip().endswith("}")]
            if any(r.get("event") == "train" and r.get("examples", 0) >= at for r in records):
                pid = job_ranks(proc.pid).get(victim)
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


#: the rank each kind of kill hits, by its local rank (0: the embedding server, 1: trainer 0)
VICTIMS = {"trainer": 2, "server": 0}


@click.command("faults")
@click.option("--seeds", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--trainers", "-T", type=click.IntRange(min=2), default=4, show_default=True)
@click.option("--examples", type=click.IntRange(min=10_000), default=2_000_000, show_default=True,
              help="examples of every run.")
@click.option("--at", type=click.FloatRange(0.0, 0.95), default=0.3, show_default=True,
              help="the kill comes once the job has trained this fraction of its examples.")
@click.option("--kill", default="trainer,server", show_default=True,
              help="what each killed run kills, comma-separated: trainer (trainer 1), server (embedding server 0).")
@click.option("--sync", default="shadow-bmuf", show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default="runs/bench-faults", show_default=True)
def faults_cmd(seeds: int, trainers: int, examples: int, at: float, kill: str, sync: str, out: str) -> None:
    """A trainer or an embedding server killed (kill -9) during a one-machine job against the same job
    uninterrupted, over seeds: eval NE, examples lost, how soon the job recovered."""
    kinds = [k.strip() for k in kill.split(",") if k.strip()]
    for k in kinds:
        if k not in VICTIMS:
            raise click.BadParameter(f"{k!r}: expected a comma-separated list of {', '.join(VICTIMS)}",
                                     param_hint="--kill")
    console = Console(width=180)
    root = Path(out)
    rows: list[list] = []
    found: dict[str, dict[str, list[float]]] = {k: {"changes": [], "lost": [], "recorded": [], "reformed": []}
                                                for k in kinds}
    for seed in range(seeds):
        base_out = root / f"seed{seed}-uninterrupted"
        base = _run(_command(base_out, seed, examples, trainers, sync), base_out)
        for kind in kinds:
            kill_out = root / f"seed{seed}-{kind}-killed"
            hit, killed_at = _run_killing(_command(kill_out, seed, examples, trainers, sync), kill_out,
                                          VICTIMS[kind], int(at * examples))
            change = hit["eval_ne"] / base["eval_ne"] - 1
            losses = hit.get("lost") if kind == "trainer" else hit.get("lost_servers")
            loss = losses[0] if losses else None
            rec = loss["time"] - killed_at if loss else float("nan")
            ref = (hit.get("regrouped_at") or float("nan")) - killed_at
            f = found[kind]
            f["changes"].append(change)
            f["lost"].append(examples - hit["examples"])
            f["recorded"].append(rec)
            f["reformed"].append(ref)
            rows.append([kind, seed, f"{base['eval_ne']:.4f}", f"{hit['eval_ne']:.4f}", f"{change:+.2%}",
                         f"{examples - hit['examples']:,}", f"{rec:.2f}", "-" if kind == "server" else f"{ref:.2f}",
                         f"{base['seconds']:.1f} / {hit['seconds']:.1f}"])
            console.print(f"  seed {seed}: eval NE {base['eval_ne']:.4f} uninterrupted, {hit['eval_ne']:.4f} with a "
                          f"{kind} killed ({change:+.2%}); recorded as lost: {'yes' if loss else 'no'}")
    verdicts = []
    for kind in kinds:
        f = found[kind]
        mean, worst = statistics.fmean(f["changes"]), max(f["changes"], key=abs)
        rows.append([kind, "mean", "", "", f"{mean:+.2%} (worst {worst:+.2%})", f"{max(f['lost']):,.0f} (most)",
                     f"{statistics.median(f['recorded']):.2f} (median)",
                     "-" if kind == "server" else f"{statistics.median(f['reformed']):.2f} (median)", ""])
        ok = abs(mean) <= NE_TARGET and max(f["lost"]) == 0
        verdicts.append(f"{'PASS' if ok else 'FAIL'} ({kind} killed): every run finished, {max(f['lost']):,.0f} "
                        f"examples lost at most, eval NE {mean:+.2%} on average against the uninterrupted runs "
                        f"(target: 0 lost, within {NE_TARGET:.1%})")
    title = (f"a rank killed at {at:.0%} of {examples:,} examples, T={trainers}, {sync}, {seeds} seeds "
             f"(os.cpu_count()={os.cpu_count()})")
    print_table(title, COLUMNS, rows, console)
    console.print(markdown_table(COLUMNS, rows), markup=False)
    for line in verdicts:
        console.print(line)
    write_json(root / "faults.json", {"by_kill": {k: {"ne_change": f["changes"], "examples_lost": f["lost"],
                                                      "loss_recorded_s": f["recorded"],
                                                      "sync_reformed_s": f["reformed"]} for k, f in found.items()},
                                      "trainers": trainers, "examples": examples, "at": at, "sync": sync})
