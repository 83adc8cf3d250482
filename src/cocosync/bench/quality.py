"""`cocosync bench quality`: eval NE against the trainer count, every sync algorithm at its defaults, equal examples.

It trains T=1 `none` per seed (one trainer that sees every example: the reference; deterministic, so
`--reference-jobs N` runs N of them side by side, the same bits as one at a time), then per seed (the outer loop:
every configuration once per seed, so load drift hits all alike) each algorithm at each T on the same data and total
examples, one run at a time (a T >= 2 run's timing shapes its result).
Reported per (algorithm, T): mean eval NE over the seeds, the spread, and the change against T=1 of the same seed
(paired, then averaged) with its 90% confidence interval over the seeds (Student's t). A T >= 2 run is not
reproducible (its shadow thread's timing differs run to run) and a final model's eval NE moves ~1% between nearby
stopping points, so the verdict is three-way: PASS when the interval's upper end is within the target (0.5% up to
T=8, 1% beyond), FAIL when its lower end is above it, else UNRESOLVED, with the seeds that would resolve it
at the measured spread. Also per row: the median sync gap (iterations) and the embedding rows' staleness (updates a
pushed row received since its fetch: how many other trainers' updates a row's gradient lands on, which grows with
the trainers that truly run at once, not with T alone). Written: the table (and its markdown), quality.json and
quality.png (NE change vs T, one line per algorithm, the intervals as bars).

`--examples` takes several run lengths (e.g. 1600000,3200000): every configuration and its T=1 reference at each,
seed-major, one row per (algorithm, T, length) and one plot panel per length. At equal total examples a T-trainer
run gives each replica 1/T of them, and the loss against one trainer shrinks as that share grows (BENCHMARKS.md),
so the rows also name the examples per trainer.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import click

from cocosync.bench.common import TimeBudget
from cocosync.shadowsync.config import SYNC_ALGORITHMS

__all__ = ["quality_cmd", "run_quality", "tolerance", "change_interval", "verdict"]

DEFAULT_ALGORITHMS = tuple(a for a in SYNC_ALGORITHMS if a != "none" and not a.endswith("dssync")) + (
    "shadow-dssync",)


def tolerance(trainers: int) -> float:
    """The NE change against one trainer that counts as holding quality: 0.5% up to T=8, 1% beyond."""
    return 0.005 if trainers <= 8 else 0.01


def change_interval(changes: list[float], level: float = 0.90) -> tuple[float, float]:
    """The two-sided `level` confidence interval of the mean of `changes` (paired per seed), Student's t; (nan, nan)
    from fewer than two."""
    n = len(changes)
    if n < 2:
        return float("nan"), float("nan")
    mean, half = statistics.fmean(changes), change_interval_width(statistics.stdev(changes), n, level)
    return mean - half, mean + half


def verdict(changes: list[float], target: float) -> tuple[str, int | None]:
    """PASS, FAIL or UNRESOLVED (see the module doc), and for UNRESOLVED the seeds whose interval, at this spread and
    mean, would clear the target (None where the mean sits on it)."""
    lo, hi = change_interval(changes)
    if math.isfinite(hi) and hi <= target:
        return "PASS", None
    if math.isfinite(lo) and lo > target:
        return "FAIL", None
    if len(changes) < 2:
        return "UNRESOLVED", None
    mean, sd = statistics.fmean(changes), statistics.stdev(changes)
    if abs(mean - target) < 1e-12:
        return "UNRESOLVED", None
    n = len(changes)
    while n < 1_000 and change_interval_width(sd, n) >= abs(mean - target):
        n += 1
    return "UNRESOLVED", n if n < 1_000 else None


def change_interval_width(sd: float, n: int, level: float = 0.90) -> float:
    """Half-width of the interval of a mean of `n` changes with spread `sd`."""
    from scipy import stats

    return stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)


def _train(alg: str, T: int, seed: int, base: dict, out: Path, console: Any) -> dict:
    from cocosync.shadowsync.config import SyncConfig, TrainConfig
    from cocosync.shadowsync.job.launch import run_training

    name = f"{alg} T={T} seed={seed}"
    cfg = TrainConfig(**base, trainers=T, seed=seed, sync=SyncConfig(algorithm=alg),
                      out_dir=str(out / f"{alg}-T{T}-s{seed}"))
    res = run_training(cfg, name=name, console=console)
    if res.interrupted:
        raise click.Abort()
    s = res.summary
    full = cfg.window * cfg.batch_size  # a trainer's first windows score the initial model: not a jump in its NE
    curve = [r["train_ne"] for r in res.records if r.get("event") == "train" and r.get("train_ne") is not None
             and r.get("trainer_examples", full) >= full]
    return {"algorithm": alg, "T": T, "seed": seed, "examples": base["examples"], "eval_ne": s["eval_ne"],
            "eps": s["eps"], "sync_gap": s["sync_gap"], "max_train_ne": max(curve, default=float("nan")),
            "row_staleness": s.get("staleness", float("nan"))}


def _reference(seed: int, base: dict, out: Path) -> dict:
    """T=1 `none` of `seed` (a process pool's task: its own quiet console)."""
    return _train("none", 1, seed, base, out, _quiet())


def _references(tasks: list[tuple[int, dict, Path]], jobs: int, done: Any) -> None:
    """The T=1 reference of every (seed, settings, out), `jobs` at a time (fresh processes: each run starts its own
    launcher)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    if jobs <= 1:
        for task in tasks:
            done(_reference(*task))
        return
    with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as pool:
        for f in as_completed([pool.submit(_reference, *task) for task in tasks]):
            done(f.result())


def _length_dir(out: Path, examples: int, lengths: list[int]) -> Path:
    """A run's directory: `out` itself for one length (as before), else one folder per length."""
    return out if len(lengths) == 1 else out / f"examples-{examples}"


def run_quality(*, trainers: list[int], algorithms: list[str], seeds: list[int], examples: int | list[int],
                eval_examples: int, out: Path, console: Any, log: Path | None = None, reference_jobs: int = 1,
                time_limit: float | None = None) -> dict:
    """Every run (a list of dicts) and the per-(algorithm, T, length) rows (`examples`: one run length or several);
    `log`: each run appended there as a JSON line as it ends (a long bench stopped early keeps what it measured);
    `reference_jobs`: T=1 runs side by side;
    `time_limit` (seconds): start no T >= 2 run that would end after it (by the slowest so far), and report the
    runs that finished."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    lengths = [examples] if isinstance(examples, int) else list(examples)
    base = {n: dict(examples=n, eval_examples=eval_examples, progress=False, plot=False, checkpoint=False)
            for n in lengths}
    plan = [(seed, n, alg, T) for seed in seeds for n in lengths for T in trainers for alg in algorithms if T > 1]
    runs: list[dict] = []

    def done(r: dict) -> None:
        runs.append(r)
        if log is not None:
            with open(log, "a") as f:
                f.write(json.dumps(r) + "\n")

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("left"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("quality runs", total=len(plan) + len(seeds) * len(lengths))

        def ended(r: dict) -> None:
            done(r)
            bar.advance(task)
            bar.console.print(f"  {r['algorithm']:14s} T={r['T']:<3d} {r['examples']:>10,d} examples, seed "
                              f"{r['seed']}: eval NE {r['eval_ne']:.4f}")

        budget = TimeBudget(time_limit)
        _references([(seed, base[n], _length_dir(out, n, lengths)) for seed in seeds for n in lengths],
                    reference_jobs, ended)
        for i, (seed, n, alg, T) in enumerate(plan):  # seed-major
            if not budget.allows():
                bar.console.print(f"[yellow]--time-limit {time_limit:g} s: stopped after {i} of {len(plan)} runs "
                                  "(and the T=1 references); the rows below are of those that finished")
                break
            with budget.step():
                ended(_train(alg, T, seed, base[n], _length_dir(out, n, lengths), _quiet()))
    ref = {(r["seed"], r["examples"]): r["eval_ne"] for r in runs if r["algorithm"] == "none"}
    rows = [row for n in lengths for alg in algorithms for T in trainers if T > 1
            if (row := _row(alg, T, n, [r for r in runs if (r["algorithm"], r["T"], r["examples"]) == (alg, T, n)],
                            ref))]
    return {"reference_eval_ne": {n: statistics.fmean(v for (_, m), v in ref.items() if m == n) for n in lengths},
            "rows": rows, "runs": runs,
            "settings": {"examples": lengths, "eval_examples": eval_examples, "seeds": seeds}}


def _row(alg: str, T: int, examples: int, mine: list[dict], ref: dict) -> dict | None:
    """The row of (alg, T, examples) over its runs `mine`, each against T=1 of its seed and length in `ref`; None
    without runs (stopped by the time limit before its first seed)."""
    if not mine:
        return None
    change = [r["eval_ne"] / ref[r["seed"], examples] - 1 for r in mine]
    ne = [r["eval_ne"] for r in mine]
    lo, hi = change_interval(change)
    word, need = verdict(change, tolerance(T))
    return {"algorithm": alg, "T": T, "examples": examples, "examples_per_trainer": examples // T, "seeds": len(mine),
            "eval_ne": statistics.fmean(ne), "eval_ne_sd": statistics.stdev(ne) if len(ne) > 1 else float("nan"),
            "change": statistics.fmean(change), "change_worst": max(change), "change_low": lo, "change_high": hi,
            "verdict": word, "seeds_to_resolve": need,
            "max_train_ne": max((r["max_train_ne"] for r in mine if math.isfinite(r["max_train_ne"])),
                                default=float("nan")),
            "sync_gap": statistics.median(r["sync_gap"] for r in mine),
            "row_staleness": statistics.median(r.get("row_staleness", float("nan")) for r in mine),
            "pass": word == "PASS"}


def _check_runs(trainers: list[int], lengths: list[int]) -> None:
    """Every (T, length) a valid job, before the first run: not a usage error an hour into the bench."""
    from cocosync.shadowsync.config import ConfigError, TrainConfig

    for n in lengths:
        for T in trainers:
            try:
                TrainConfig(examples=n, trainers=T)
            except ConfigError as e:
                raise click.BadParameter(f"{n} with --trainers {T}: {e}", param_hint="--examples") from None


def _quiet():
    """A console for the runs themselves: the bench prints one line per run, not every run's output."""
    import io

    from rich.console import Console

    return Console(file=io.StringIO())


def _table(result: dict):
    from rich.table import Table

    refs = ", ".join(f"{_count(n)}: {ne:.4f}" for n, ne in result["reference_eval_ne"].items())
    table = Table(title=f"eval NE vs trainers at equal examples; T=1 none at {refs}")
    for col in ("algorithm", "T", "examples", "per trainer", "seeds", "eval NE (mean)", "sd", "vs T=1 (mean)",
                "90% interval", "worst seed", "max train NE", "sync gap", "row staleness", "target"):
        table.add_column(col, justify="left" if col == "algorithm" else "right")
    for r in result["rows"]:
        table.add_row(r["algorithm"], str(r["T"]), _count(r["examples"]), _count(r["examples_per_trainer"]),
                      str(r["seeds"]), f"{r['eval_ne']:.4f}", f"{r['eval_ne_sd']:.4f}", f"{r['change']:+.2%}",
                      _interval(r), f"{r['change_worst']:+.2%}", f"{r['max_train_ne']:.3f}", f"{r['sync_gap']:.1f}",
                      f"{r.get('row_staleness', float('nan')):.2f}", _target(r))
    return table


def _count(n: int) -> str:
    """1600000 -> 1.6M, 200000 -> 200k: examples as BENCHMARKS.md writes them."""
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return str(n)


def _interval(r: dict) -> str:
    return f"{r['change_low']:+.2%} .. {r['change_high']:+.2%}" if math.isfinite(r["change_low"]) else "-"


def _target(r: dict) -> str:
    if r.get("seeds_to_resolve"):
        need = f", ~{r['seeds_to_resolve']} seeds to tell"
    elif r["verdict"] == "UNRESOLVED" and r["seeds"] >= 2:
        need = ", mean on the line: > 1,000 seeds to tell"
    else:
        need = ""
    return f"{r['verdict']} ({tolerance(r['T']):.1%}{need})"


def _markdown(result: dict) -> str:
    lines = ["| algorithm | T | examples (per trainer) | eval NE (mean of seeds) | vs T=1 | 90% interval | worst seed "
             "| max train NE | row staleness | target |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['algorithm']} | {r['T']} | {_count(r['examples'])} ({_count(r['examples_per_trainer'])}) "
                     f"| {r['eval_ne']:.4f} | {r['change']:+.2%} | {_interval(r)} | "
                     f"{r['change_worst']:+.2%} | {r['max_train_ne']:.3f} | "
                     f"{r.get('row_staleness', float('nan')):.2f} | {_target(r)} |")
    return "\n".join(lines)


def plot_quality(result: dict, path: Path) -> None:
    """NE change vs T, one line per algorithm; one panel per run length."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    lengths = result["settings"]["examples"]
    fig, axes = plt.subplots(1, len(lengths), figsize=(8 * len(lengths) ** 0.5, 5), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], lengths):
        _plot_length(ax, [r for r in result["rows"] if r["examples"] == n])
        ax.set_title(f"{_count(n)} examples (mean of {len(result['settings']['seeds'])} seeds, 90% intervals)",
                     fontsize=10)
    axes[0][0].set_ylabel("eval NE vs one trainer (%, lower is better)")
    fig.suptitle("quality as trainers grow, at equal total examples")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_length(ax: Any, rows: list[dict]) -> None:
    for i, alg in enumerate(dict.fromkeys(r["algorithm"] for r in rows)):
        mine = sorted((r for r in rows if r["algorithm"] == alg), key=lambda r: r["T"])
        ts, mid = [r["T"] for r in mine], [100 * r["change"] for r in mine]
        bars = [[_reach(m, r["change_low"]) for m, r in zip(mid, mine)],
                [_reach(m, r["change_high"]) for m, r in zip(mid, mine)]]
        ts = [t * 1.03 ** (i - 2) for t in ts]  # side by side, so the intervals do not hide each other
        ax.errorbar(ts, mid, yerr=bars, marker="o", capsize=3, color=f"C{i % 10}",
                    ls="-" if alg.startswith("shadow") else "--", label=alg)
    ts = sorted({r["T"] for r in rows})
    ax.plot(ts, [100 * tolerance(t) for t in ts], color="gray", ls=":", drawstyle="steps-post", label="target")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ts, [str(t) for t in ts])
    ax.set_xlabel("trainers T (equal total examples)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _reach(mid: float, end: float) -> float:
    """Length of an interval's bar from its mean `mid` (%) to its end `end` (a fraction; none if not finite)."""
    return abs(100 * end - mid) if math.isfinite(end) else 0.0


@click.command("quality")
@click.option("--trainers", default="2,4,8", show_default=True, help="comma-separated trainer counts (T=1 is the "
              "reference, always run).")
@click.option("--algorithms", default=",".join(DEFAULT_ALGORITHMS), show_default=True,
              help="sync algorithms, each at its defaults.")
@click.option("--seeds", type=int, default=5, show_default=True, help="seeds 0..N-1 (model and data).")
@click.option("--examples", default="800000", show_default=True,
              help="total training examples per run; comma-separated for several run lengths (e.g. 1600000,3200000: "
                   "the loss against one trainer shrinks as each trainer's share grows).")
@click.option("--eval-examples", type=int, default=50_000, show_default=True, help="held-out examples.")
@click.option("--reference-jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="T=1 reference runs side by side (deterministic: the same NE as one at a time); e.g. the seeds "
                   "count on a machine with 2 cores per seed.")
@click.option("--time-limit", type=click.FloatRange(min=0, min_open=True), default=None,
              help="seconds: start no run that would end after it (judged by the slowest so far) and report the runs "
                   "that finished (a machine lent for minutes).")
@click.option("--out", type=click.Path(file_okay=False), default="runs/bench-quality", show_default=True)
def quality_cmd(trainers: str, algorithms: str, seeds: int, examples: str, eval_examples: int, reference_jobs: int,
                time_limit: float | None, out: str) -> None:
    """Eval NE vs trainer count for every sync algorithm at equal total examples, against the quality targets."""
    from rich.console import Console

    try:
        ts = sorted({int(t) for t in trainers.split(",") if t.strip()})
    except ValueError:
        raise click.BadParameter(f"{trainers!r}: expected comma-separated integers, e.g. 2,4,8",
                                 param_hint="--trainers") from None
    try:
        lengths = list(dict.fromkeys(int(n) for n in examples.split(",") if n.strip()))
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise click.BadParameter(f"{examples!r}: expected comma-separated positive integers, e.g. 1600000,3200000",
                                 param_hint="--examples")
    algs = [a.strip() for a in algorithms.split(",") if a.strip()]
    if bad := [a for a in algs if a not in SYNC_ALGORITHMS or a == "none"]:
        raise click.BadParameter(f"{bad}: expected some of {[a for a in SYNC_ALGORITHMS if a != 'none']}",
                                 param_hint="--algorithms")
    if not ts or min(ts) < 1 or seeds < 1:
        raise click.BadParameter(f"--trainers {trainers!r}, --seeds {seeds}: expected T >= 1 and seeds >= 1")
    _check_runs(ts, lengths)
    console = Console(width=160)
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    (root / "quality-runs.jsonl").unlink(missing_ok=True)
    result = run_quality(trainers=ts, algorithms=algs, seeds=list(range(seeds)), examples=lengths,
                         eval_examples=eval_examples, out=root / "runs", console=console,
                         log=root / "quality-runs.jsonl", reference_jobs=reference_jobs, time_limit=time_limit)
    console.print(_table(result))
    console.print(_markdown(result), markup=False)
    (root / "quality.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    plot_quality(result, root / "quality.png")
    console.print(f"{root}/quality.json, {root}/quality.png", markup=False)
