"""``cocosync bench features``: what multi-valued features cost. Two Parquet files of the same rows (the synthetic
default's shape: 13 dense columns, 26 categoricals): in one every categorical holds one value, in the other one of
them holds a list of 1 to `--max-values` values (uniform). The same DLRM trains on each (`cocosync train`, T=2,
each file read through the tabular reader), runs alternating; per file the median examples/s of the training and the
median ids per example, and the ratio. The target: a list feature of 1-50 values trains at >= 0.7x the examples/s of
single-valued features."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
from rich.console import Console

from cocosync.bench.common import fmt_ratio, markdown_table, print_table, write_json

__all__ = ["features_cmd", "write_feature_files", "TARGET"]

TARGET = 0.7
COLUMNS = ["features", "ids per example", "examples/s (median)", "runs", "vs single-valued"]


def write_feature_files(out: Path, rows: int, max_values: int, seed: int = 0) -> dict[str, Path]:
    """out/single.parquet and out/list.parquet: the same labels and dense columns; 26 categoricals of 1,000 values,
    the first a list of 1..max_values values in list.parquet. The label depends on the first categorical (its mean
    value's parity) and the first dense column, so both files carry signal."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    dense = {f"d{i}": rng.normal(0, 1, rows) for i in range(13)}
    cats = {f"c{i}": np.char.add("v", rng.integers(0, 1000, rows).astype(str)) for i in range(26)}
    lengths = rng.integers(1, max_values + 1, rows)
    values = rng.integers(0, 1000, int(lengths.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    first = np.array([values[offsets[i]:offsets[i + 1]].mean() for i in range(rows)])
    logit = 0.8 * dense["d0"] + np.where(first.astype(int) % 2 == 0, 0.7, -0.7) - 1.0
    label = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    single = pa.table({"label": label, **dense, **cats})
    strings = pa.array(np.char.add("v", values.astype(str)))
    if isinstance(strings, pa.ChunkedArray):  # (numpy's fixed-width strings may come back in chunks)
        strings = strings.combine_chunks()
    lists = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), strings)
    multi = single.set_column(single.schema.get_field_index("c0"), "c0", lists)
    out.mkdir(parents=True, exist_ok=True)
    files = {"single": out / "single.parquet", "list": out / "list.parquet"}
    pq.write_table(single, files["single"])
    pq.write_table(multi, files["list"])
    return files


def _train(path: Path, out: Path, examples: int, trainers: int) -> dict:
    cmd = [sys.executable, "-m", "cocosync_start", "train", "--data", str(path), "--examples", str(examples),
           "--eval-examples", "2000", "-T", str(trainers), "--table-size", "2048", "--out", str(out),
           "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise click.ClickException(f"{' '.join(cmd)} failed: {(done.stderr or done.stdout)[-800:]}")
    return json.loads((out / "summary.json").read_text())


@click.command("features")
@click.option("--rows", type=click.IntRange(min=10_000), default=300_000, show_default=True,
              help="rows of each file (all but 2,000 held out are trained on).")
@click.option("--max-values", type=click.IntRange(min=1), default=50, show_default=True,
              help="a list holds 1 to this many values.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="runs per file.")
@click.option("--trainers", "-T", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default="runs/bench-features", show_default=True)
def features_cmd(rows: int, max_values: int, repeats: int, trainers: int, out: str) -> None:
    """Multi-valued features against single-valued ones: examples/s of the same DLRM, runs alternating."""
    console = Console(width=160)
    root = Path(out)
    files = write_feature_files(root / "data", rows, max_values)
    eps: dict[str, list[float]] = {k: [] for k in files}
    for r in range(repeats):
        for name, path in (files.items() if r % 2 == 0 else reversed(files.items())):
            s = _train(path, root / f"{name}-{r}", rows - 2000, trainers)
            eps[name].append(s["eps"])
            console.print(f"  {name} run {r}: {s['eps']:,.0f} examples/s, eval NE {s['eval_ne']:.4f}")
    ids = {"single": 26.0, "list": 25 + (1 + max_values) / 2}
    med = {k: statistics.median(v) for k, v in eps.items()}
    ratio = med["list"] / med["single"]
    table = [["26 single-valued", f"{ids['single']:.1f}", f"{med['single']:,.0f}", repeats, ""],
             [f"25 single + 1 list of 1-{max_values}", f"{ids['list']:.1f}", f"{med['list']:,.0f}", repeats,
              fmt_ratio(ratio)]]
    print_table(f"multi-valued features, T={trainers}, {rows - 2000:,} examples a run", COLUMNS, table, console)
    console.print(markdown_table(COLUMNS, table), markup=False)
    verdict = "PASS" if ratio >= TARGET else "FAIL"
    console.print(f"{verdict}: a list feature of 1-{max_values} values at {ratio:.2f}x the examples/s of "
                  f"single-valued features (target >= {TARGET})")
    write_json(root / "features.json", {"examples_per_s": eps, "median": med, "ratio": ratio, "rows": rows,
                                        "max_values": max_values, "trainers": trainers})
