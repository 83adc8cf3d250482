"""`cocosync data ...`: write synthetic Criteo-format data sets and inspect data files."""

from __future__ import annotations

import json
import os
import time

import click

__all__ = ["data"]


@click.group()
def data() -> None:
    """Click-through-rate data: synthesize (Criteo format, known Bayes NE), convert MovieLens, inspect."""


@data.command()
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--rows", type=click.IntRange(min=1), default=1_000_000, show_default=True, help="Training rows.")
@click.option("--eval-rows", type=click.IntRange(min=0), default=100_000, show_default=True,
              help="Held-out rows (same teacher, another random stream); 0 = none.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed of the rows.")
@click.option("--teacher-seed", type=int, default=0, show_default=True, help="Seed of the hidden teacher model.")
@click.option("--ctr", type=float, default=0.04, show_default=True, help="Target mean click rate.")
@click.option("--gzip", "use_gzip", is_flag=True, help="Write .tsv.gz instead of .tsv.")
def synth(out: str, rows: int, eval_rows: int, seed: int, teacher_seed: int, ctr: float, use_gzip: bool) -> None:
    """Write OUT/train.tsv[.gz] (and OUT/eval.tsv[.gz]) from the synthetic teacher, each with a
    `.prob.npy` sidecar of true click probabilities, plus OUT/meta.json (config and Bayes NE)."""
    from dataclasses import asdict

    from rich.console import Console
    from rich.markup import escape

    from cocosync.shadowsync.config import SynthConfig
    from cocosync.shadowsync.data.synth import EVAL, TRAIN, write_synthetic
    from cocosync.shadowsync.metrics import summary_table

    try:
        cfg = SynthConfig(teacher_seed=teacher_seed, ctr=ctr)
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
    os.makedirs(out, exist_ok=True)
    ext = ".tsv.gz" if use_gzip else ".tsv"
    results = []
    for name, n, split in (("train", rows, TRAIN), ("eval", eval_rows, EVAL)):
        if n == 0:
            continue
        path = os.path.join(out, name + ext)
        t0 = time.perf_counter()
        stats = write_synthetic(path, n, seed, synth=cfg, split=split)
        results.append({"name": name, "path": path, **stats, "seconds": time.perf_counter() - t0})
    meta = {"seed": seed, "synth": asdict(cfg), "files": results}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    Console().print(summary_table(results, title=escape(f"synthetic data in {out}")))


def _criteo_shape(path: str, lines: int = 100) -> tuple[int, int]:
    """(integer columns, categorical columns) of a Criteo-layout file from its first lines: after the label, the
    longest run of columns that hold only integers (or nothing), then the rest."""
    import gzip
    import itertools
    import re

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        rows = [line.rstrip("\n").split("\t") for line in itertools.islice(f, lines) if line.strip()]
    if not rows:
        raise click.ClickException(f"{path}: no lines")
    fields = max(set(len(r) for r in rows), key=[len(r) for r in rows].count)
    is_int = re.compile(r"-?[0-9]*$")
    dense = 0
    while 1 + dense < fields and all(len(r) != fields or is_int.match(r[1 + dense]) for r in rows):
        dense += 1
    return dense, fields - 1 - dense


@data.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--table-size", type=click.IntRange(min=2), default=10_000, show_default=True)
@click.option("--max-rows", type=click.IntRange(min=1), default=None, help="Read at most this many rows.")
def inspect(paths: tuple[str, ...], table_size: int, max_rows: int | None) -> None:
    """Read data file(s) as training reads them: Parquet/CSV (the schema found, as `cocosync train` finds it) or
    Criteo layout (its integer and categorical columns counted from the first lines): rows, click rate, bad rows,
    read speed, Bayes NE if known."""
    import numpy as np
    from rich.console import Console
    from rich.markup import escape

    from cocosync.shadowsync.config import DataConfig
    from cocosync.shadowsync.data.criteo import CriteoReader
    from cocosync.shadowsync.data.tabular import TabularError, TabularReader, data_format, infer_schema
    from cocosync.shadowsync.metrics import bayes_ne, summary_table

    console = Console()
    formats = {data_format(p) for p in paths}
    if len(formats) > 1:
        raise click.UsageError(f"the files are of different formats ({', '.join(sorted(formats))}): inspect one kind")
    if formats == {"criteo"}:
        num_dense, num_sparse = _criteo_shape(paths[0])
        config = DataConfig(table_size=table_size, max_bad_fraction=1.0, num_dense=max(1, num_dense),
                            num_sparse=max(1, num_sparse), train_path=tuple(paths))
        reader = CriteoReader(list(paths), config, batch_size=65536, max_rows=max_rows)
        console.print(f"Criteo layout: label, {num_dense} integer and {num_sparse} categorical columns")
        features = num_sparse
    else:
        try:
            schema = infer_schema(paths[0])
        except TabularError as e:
            raise click.ClickException(str(e)) from None
        console.print(escape(f"{schema.format}: {schema.describe()}"), soft_wrap=True)
        reader = TabularReader(list(paths), schema, batch_size=65536, max_rows=max_rows)
        features = 0
    t0 = time.perf_counter()
    labels, probs, missing = [], [], 0
    try:
        for b in reader:
            labels.append(b.label.numpy())
            if features:
                missing += int((b.sparse == 0).sum())
            if b.prob is not None:
                probs.append(b.prob.numpy())
    except (TabularError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    seconds = time.perf_counter() - t0
    y = np.concatenate(labels) if labels else np.zeros(0)
    row = {"rows": int(y.size), "ctr": float(y.mean()) if y.size else float("nan"), "bad_lines": reader.bad_lines,
           "rows_per_s": y.size / seconds if seconds > 0 else float("nan")}
    if features:
        row["missing_cat"] = missing / max(1, y.size * features)
    if probs and 0 < row["ctr"] < 1:
        row["bayes_ne"] = bayes_ne(y, np.concatenate(probs))
    console.print(summary_table([row], title=", ".join(paths)))
    for line_no, reason in reader.bad_examples:
        console.print(f"  line {line_no}: {reason}", markup=False)


@data.command()
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--cache", type=click.Path(file_okay=False), default=None,
              help="where the downloaded wheel is kept.  [default: ~/.cache/cocosync]")
@click.option("--split-seed", type=int, default=0, show_default=True, help="seed of the train/valid/test split.")
@click.option("--rows", type=click.IntRange(min=10), default=None, help="a sample: this many ratings in all.")
@click.option("--format", "fmt", type=click.Choice(["parquet", "tsv"]), default="parquet", show_default=True,
              help="parquet: named columns, genres as one list-valued feature; tsv: the Criteo format (genres as 19 "
                   "flags and the first genre).")
def movielens(out: str, cache: str | None, split_seed: int, rows: int | None, fmt: str) -> None:
    """Real ratings as click data: write MovieLens-100K (GroupLens; fetched from the RecBole wheel on PyPI) as
    OUT/{train,valid,test}.parquet (label, age, year, user_id, movie_id, gender, occupation, zip, genres) or .tsv in
    the Criteo format (21 integer and 8 categorical features), a click being a rating >= 4, 80/10/10 split, and
    OUT/meta.json; print the command that trains on it."""
    from pathlib import Path

    from rich.console import Console
    from rich.markup import escape

    from cocosync.shadowsync.data.movielens import MovieLensError, fetch_wheel, write_ctr, write_parquet
    from cocosync.shadowsync.metrics import summary_table

    try:
        write = write_parquet if fmt == "parquet" else write_ctr
        meta = write(Path(out), fetch_wheel(Path(cache) if cache else None), split_seed=split_seed, max_rows=rows)
    except MovieLensError as e:
        raise click.ClickException(str(e)) from None
    console = Console()
    console.print(summary_table([{"name": name, **f} for name, f in meta["files"].items()],
                                title=escape(meta["source"])))
    f = meta["files"]
    console.print("train on it (the best model on valid is kept as checkpoints/best; score it on test with "
                  "`cocosync eval RUN/checkpoints/best --data " + escape(f["test"]["path"]) + "`):", soft_wrap=True)
    console.print(escape(train_command(meta)), soft_wrap=True, markup=False)


def train_command(meta: dict, model: str | None = None) -> str:
    """The `cocosync train` line for a converted data set (valid as the eval curve's held-out set; a TSV's shape and
    tables sized for its categoricals, a Parquet file's found from it)."""
    import shlex

    f = meta["files"]
    if meta.get("format") == "parquet":
        return shlex.join(["cocosync", "train", "--data", f["train"]["path"], "--eval-data", f["valid"]["path"],
                           "--eval-examples", str(f["valid"]["rows"]), "--epochs", str(meta["epochs"]),
                           "--eval-every", str(meta["eval_every"]), *(["--model", model] if model else [])])
    return shlex.join(["cocosync", "train", "--data", f["train"]["path"], "--eval-data", f["valid"]["path"],
                       "--num-dense", str(meta["num_dense"]), "--num-sparse", str(meta["num_sparse"]),
                       "--eval-examples", str(f["valid"]["rows"]), "--epochs", str(meta["epochs"]),
                       "--eval-every", str(meta["eval_every"]), "--table-size", str(meta["table_size"])])
