"""`cocosync bench shadowsync`: ShadowSync vs foreground sync vs independent trainers, same data and budget.

For each T (default 1 and 2) it trains, on the same synthetic data and example budget: `none` (independent
trainers, the throughput reference), `shadow-{ma,bmuf,easgd}` (background sync), `fr-{ma,bmuf,easgd}` at k=1
(foreground sync every iteration, for contrast) and at k = the mean sync gap its shadow counterpart reached
(same sync frequency: the fair NE comparison). One extra run, T=1 with W=2 Hogwild threads, measures what
worker threads buy on this machine. Reported: EPS (total), ratio to `none` at the same T, eval NE, excess
NE over the Bayes NE, NE relative to one trainer that sees every example (`none`, T=1), sync gap.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click

from cocosync.shadowsync.config import SYNC_ALGORITHMS

__all__ = ["shadowsync", "run_suite"]

SHADOW = ("shadow-ma", "shadow-bmuf", "shadow-easgd")
COLUMNS = ["run", "T", "W", "sync", "k / interval", "EPS median", "EPS best", "vs none (best)", "EPS/CPU-s",
           "vs none (CPU)", "eval NE", "excess NE", "vs 1 trainer",
           "sync gap", "syncs"]


def _run(name: str, base: dict, out: Path, console: Any, **kw: Any) -> dict:
    from cocosync.shadowsync.config import SyncConfig, TrainConfig
    from cocosync.shadowsync.job.launch import run_training

    sync = kw.pop("sync")
    cfg = TrainConfig(**{**base, **kw, "out_dir": str(out / name.replace(" ", "_").replace("=", "")),
                         "sync": SyncConfig(**sync)})
    res = run_training(cfg, name=name, console=console)
    if res.interrupted:
        raise click.Abort()  # Ctrl-C stops the whole suite, not just this run
    s = dict(res.summary)
    s["k"] = cfg.sync.iterations_per_sync if cfg.sync.mode == "foreground" else None
    s["interval"] = cfg.sync.interval if cfg.sync.mode == "shadow" else None
    s["records"] = res.records
    gap = s.get("sync_gap")  # (None without a sync: the summary holds NaN as null)
    gap_text = f"{gap:.2f}" if isinstance(gap, (int, float)) and math.isfinite(gap) else "-"
    console.print(f"  {name:28s} EPS {s['eps']:9,.0f}  eval NE {s['eval_ne']:.4f}  gap {gap_text}")
    return s


def run_suite(*, examples: int, eval_examples: int, trainers: list[int], interval: float, batch_size: int,
              out: Path, console: Any, seed: int = 0, repeats: int = 1, algorithms: tuple[str, ...] = SHADOW,
              threads_run: bool = True, matched: bool = True) -> list[dict]:
    """All runs, `repeats` rounds interleaved (every configuration once per round, so that load drift on a
    shared machine hits all of them alike); each returned run holds the medians over its repeats."""
    base = dict(examples=examples, eval_examples=eval_examples, batch_size=batch_size, seed=seed,
                progress=False, plot=False, checkpoint=False, workers=1)
    samples: dict[str, list[dict]] = {}
    matched_k: dict[str, int] = {}  # fr run name -> k matched to the shadow gap of round 1

    def go(name: str, **kw: Any) -> dict:
        s = _run(name, base, out, console, **kw)
        samples.setdefault(name, []).append(s)
        return s

    for rnd in range(repeats):
        console.print(f"[bold]round {rnd + 1}/{repeats}[/]")
        for T in trainers:
            go(f"none T={T}", trainers=T, sync={"algorithm": "none"})
            for alg in algorithms:
                shadow = go(f"{alg} T={T}", trainers=T, sync={"algorithm": alg, "interval": interval})
                fr = "fr-" + alg.split("-", 1)[1]
                go(f"{fr} k=1 T={T}", trainers=T, sync={"algorithm": fr, "every": 1})
                key = f"{fr} T={T}"
                if key not in matched_k:
                    gap = shadow["sync_gap"]
                    matched_k[key] = max(1, round(gap)) if isinstance(gap, (int, float)) and math.isfinite(gap) else 1
                k = matched_k[key]
                if k > 1 and matched:
                    go(f"{fr} k={k} T={T}", trainers=T, sync={"algorithm": fr, "every": k})
        if threads_run:
            go("none T=1 W=2 threads", trainers=1, workers=2, sync={"algorithm": "none"})
    runs = [_median(v) for v in samples.values()]
    _relate(runs)
    return runs


def _median(samples: list[dict]) -> dict:
    import statistics

    out = dict(samples[0])
    for key in ("eps", "eps_per_cpu", "eps_per_trainer", "eval_ne", "auc", "excess_ne", "sync_gap", "train_ne",
                "seconds"):
        vals = [s[key] for s in samples if isinstance(s.get(key), float) and math.isfinite(s[key])]
        out[key] = statistics.median(vals) if vals else float("nan")
    out["syncs"] = int(statistics.median(s["syncs"] for s in samples))
    out["eps_best"] = max(s["eps"] for s in samples)
    out["repeats"] = len(samples)
    out["eps_samples"] = [round(s["eps"]) for s in samples]
    out["eval_ne_samples"] = [round(s["eval_ne"], 5) for s in samples]
    return out


def _relate(runs: list[dict]) -> None:
    none = {r["T"]: r for r in runs if r["sync"] == "none" and r["W"] == 1}
    single = none.get(1)
    for r in runs:
        ref = none.get(r["T"])
        # best-of-repeats: on a shared machine the fastest repeat is the one least disturbed by other load
        r["eps_vs_none"] = r["eps_best"] / ref["eps_best"] if ref else float("nan")
        r["cpu_vs_none"] = r["eps_per_cpu"] / ref["eps_per_cpu"] if ref else float("nan")
        r["ne_vs_single"] = r["eval_ne"] / single["eval_ne"] - 1 if single else float("nan")


def _row(r: dict) -> list[str]:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)

    k = f"k={r['k']}" if r.get("k") else (f"{r['interval'] * 1000:.0f} ms" if r.get("interval") is not None else "-")
    return [r["name"], str(r["T"]), str(r["W"]), r["sync"], k, f(r["eps"], ",.0f"), f(r["eps_best"], ",.0f"),
            f(r["eps_vs_none"], ".2f") + "x", f(r.get("eps_per_cpu"), ",.0f"), f(r["cpu_vs_none"], ".2f") + "x",
            f(r["eval_ne"], ".4f"), f(r["excess_ne"], ".4f"), f(100 * r["ne_vs_single"], "+.2f") + "%",
            f(r["sync_gap"], ".2f"), str(r["syncs"])]


def verdicts(runs: list[dict]) -> list[str]:
    """The targets of the issue, checked on these runs (PASS/MISS lines with the numbers)."""
    out = []
    for r in runs:
        if not r["sync"].startswith("shadow-"):
            continue
        T, alg = r["T"], r["sync"].split("-", 1)[1]
        ok = r["eps_vs_none"] >= 0.95
        out.append(f"{'PASS' if ok else 'MISS'} throughput {r['name']}: {r['eps_vs_none']:.2f}x none, best of repeats "
                   f"({r['cpu_vs_none']:.2f}x in examples per CPU-second; target >= 0.95x)")
        fr = [x for x in runs if x["sync"] == f"fr-{alg}" and x["T"] == T and x["k"] != 1] or \
             [x for x in runs if x["sync"] == f"fr-{alg}" and x["T"] == T]
        if fr:
            f = fr[0]
            ok = r["eval_ne"] <= f["eval_ne"] * 1.002
            out.append(f"{'PASS' if ok else 'MISS'} NE {r['name']} {r['eval_ne']:.4f} "
                       f"vs {f['name']} {f['eval_ne']:.4f} "
                       f"(gap {r['sync_gap']:.2f} vs {f['sync_gap']:.2f}; target: no worse, 0.2% noise allowed)")
        if not math.isfinite(r["ne_vs_single"]):
            continue  # no single-trainer reference (T=1 not in this run)
        ok = r["ne_vs_single"] <= 0.01
        out.append(f"{'PASS' if ok else 'MISS'} NE {r['name']} vs one trainer: {100 * r['ne_vs_single']:+.2f}% "
                   f"(target within 1%)")
    return out


@click.command("shadowsync")
@click.option("--examples", type=int, default=300_000, show_default=True, help="training examples per run.")
@click.option("--eval-examples", type=int, default=20_000, show_default=True, help="held-out examples.")
@click.option("--trainers", default="1,2", show_default=True, help="comma-separated trainer counts.")
@click.option("--sync-interval", "interval", type=float, default=0.02, show_default=True,
              help="shadow-*: seconds between two syncs of the shadow thread (as `cocosync train --sync-interval`).")
@click.option("--batch-size", type=int, default=256, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True, help="interleaved rounds; medians reported.")
@click.option("--algorithms", default=",".join(SHADOW), show_default=True, help="shadow algorithms to compare.")
@click.option("--matched/--no-matched", default=True, show_default=True,
              help="also run FR-* at k = the shadow run's sync gap (the NE comparison).")
@click.option("--out", type=click.Path(file_okay=False), default="runs/bench-shadowsync", show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write all results as JSON here.")
@click.option("--markdown/--no-markdown", default=True, help="also print the table as markdown (BENCHMARKS.md).")
@click.option("--nodes", type=click.IntRange(1, 2), default=1, show_default=True,
              help="2: one node vs two torchrun nodes (loopback) with parameter servers, plus the scaling model; "
                   "uses the largest --trainers and the first --algorithms.")
def shadowsync(examples: int, eval_examples: int, trainers: str, interval: float, batch_size: int, repeats: int,
               algorithms: str, matched: bool, out: str, json_path: str | None, markdown: bool, nodes: int) -> None:
    """ShadowSync vs FR-* vs independent trainers: EPS, eval NE, excess over Bayes, sync gap."""
    from rich.console import Console

    from cocosync.shadowsync.metrics import plot_ne

    from .common import markdown_table, print_table, write_json

    console = Console()
    if not console.is_terminal:  # logs and CI: wide enough for the whole table
        console = Console(width=170)
    try:
        ts = [int(t) for t in trainers.split(",") if t.strip()]
    except ValueError:
        raise click.BadParameter(f"{trainers!r}: expected comma-separated integers, e.g. 1,2") from None
    algs = tuple(a.strip() for a in algorithms.split(",") if a.strip())
    choices = tuple(a for a in SYNC_ALGORITHMS if a.startswith("shadow-"))
    bad = [a for a in algs if a not in choices]
    if bad or not algs:
        raise click.BadParameter(f"--algorithms {algorithms!r}: expected a comma-separated subset of {choices}")
    outp = Path(out)
    if nodes == 2:
        from .shadowsync_nodes import report, run_nodes_suite

        try:
            samples = run_nodes_suite(examples=examples, eval_examples=eval_examples, trainers=max(ts), sync=algs[0],
                                      interval=interval, batch_size=batch_size, repeats=repeats, console=console)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        report(samples, batch_size=batch_size, console=console, out=outp, json_path=json_path)
        return
    runs = run_suite(examples=examples, eval_examples=eval_examples, trainers=ts, interval=interval,
                     batch_size=batch_size, out=outp, console=console, repeats=repeats, algorithms=algs,
                     matched=matched)
    rows = [_row(r) for r in runs]
    bayes = runs[0]["bayes_ne"]
    caption = (f"{examples:,} examples per run, {repeats} interleaved repeats (medians; 'best' = fastest repeat), "
               f"Bayes NE {bayes:.4f}; 'vs 1 trainer' = eval NE / eval NE(none, T=1) - 1")
    print_table("bench shadowsync", COLUMNS, rows, console=console, caption=caption)
    lines = verdicts(runs)
    for line in lines:
        console.print(("[green]" if line.startswith("PASS") else "[red]") + line)
    plot = plot_ne([{"name": r["name"], "records": r["records"]} for r in runs if r["T"] == max(ts) and r["W"] == 1
                    and (r["sync"] == "none" or r["sync"].startswith("shadow-") or r.get("k") == 1)],
                   outp / "ne.png", title=f"NE vs examples, T={max(ts)}")
    console.print(f"plot: {plot}")
    if markdown:
        console.print(markdown_table(COLUMNS, rows), markup=False, highlight=False, soft_wrap=True)
    if json_path:
        payload = {"examples": examples, "eval_examples": eval_examples, "interval": interval, "repeats": repeats,
                   "runs": [{k: v for k, v in r.items() if k != "records"} for r in runs], "verdicts": lines}
        from cocosync.shadowsync.metrics import json_safe

        console.print(f"json: {write_json(json_path, json_safe(payload))}")
