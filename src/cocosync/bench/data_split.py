"""``cocosync bench data-split``: what one of S training readers costs when it reads its line-aligned byte range of a
file (split='bytes') against reading every S-th line (split='lines', every reader scanning the whole file).

A synthetic Criteo-format file (plain text, in the page cache after it is written) is read shard by shard in one
process, the two splits round-robin; per split: the median seconds of one shard's read (each shard timed
`repeats` times, the median over shards reported), the bytes a shard reads (mean), and rows/s. The bound a shard
cannot beat is its 1/S of the file's bytes, so `bytes read / (size / S)` is the split's I/O amplification."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import click

from cocosync.bench.common import (
    fmt_bytes,
    fmt_ratio,
    fmt_seconds,
    markdown_table,
    print_table,
    time_interleaved,
    write_json,
)

COLUMNS = ["split", "one shard's read (median)", "bytes read per shard", "x its 1/S share", "rows/s per reader"]


def run(rows: int, readers: int, repeats: int) -> dict[str, Any]:
    from cocosync.shadowsync.config import DataConfig
    from cocosync.shadowsync.data.criteo import CriteoReader
    from cocosync.shadowsync.data.synth import write_synthetic

    cfg = DataConfig(table_size=100_000)
    with tempfile.TemporaryDirectory(prefix="cocosync-bench-data-") as tmp:
        path = str(Path(tmp) / "train.tsv")
        write_synthetic(path, rows, seed=0)
        size = Path(path).stat().st_size
        read_bytes: dict[str, list[int]] = {"bytes": [], "lines": []}
        got_rows: dict[str, int] = {"bytes": 0, "lines": 0}

        def case(split: str, shard: int):
            def fn():
                r = CriteoReader(path, cfg, shard=(shard, readers), batch_size=4096, split=split)
                n = sum(len(b) for b in r)
                if len(read_bytes[split]) < readers:  # the first pass over the shards records what they read
                    read_bytes[split].append(r.bytes_read)
                    got_rows[split] += n
            return fn

        cases = {(split, i): case(split, i) for i in range(readers) for split in ("bytes", "lines")}
        samples = time_interleaved(cases, repeats, warmup=1)
    out = []
    for split in ("bytes", "lines"):
        per_shard = [statistics.median(samples[(split, i)]) for i in range(readers)]
        t = statistics.median(per_shard)
        mean_bytes = sum(read_bytes[split]) / readers
        out.append({"split": split, "shard_s": t, "bytes_per_shard": mean_bytes,
                    "amplification": mean_bytes / (size / readers), "rows": got_rows[split],
                    "rows_per_s": rows / readers / t})
    return {"file_bytes": size, "file_rows": rows, "readers": readers, "repeats": repeats, "rows": out,
            "speedup": out[1]["shard_s"] / out[0]["shard_s"]}


def table_rows(result: dict) -> list[list[str]]:
    return [[r["split"], fmt_seconds(r["shard_s"]), fmt_bytes(r["bytes_per_shard"]), f"{r['amplification']:.2f}",
             f"{r['rows_per_s']:,.0f}"] for r in result["rows"]]


@click.command("data-split")
@click.option("--rows", default=400_000, show_default=True, type=click.IntRange(1000), help="lines in the file.")
@click.option("--readers", default=4, show_default=True, type=click.IntRange(1, 256),
              help="S: trainers x workers sharing the file.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1), help="timed reads per shard.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write results as JSON.")
@click.option("--markdown", is_flag=True, help="also print the table as markdown (for BENCHMARKS.md).")
def data_split_cmd(rows: int, readers: int, repeats: int, json_path: str | None, markdown: bool) -> None:
    """One of S readers of a training file: its byte range (bytes) vs every S-th line (lines)."""
    result = run(rows, readers, repeats)
    if not result["rows"][0]["rows"] == result["rows"][1]["rows"] == rows:  # both must read every line once
        raise click.ClickException(f"the shards read {[r['rows'] for r in result['rows']]} lines of {rows}")
    print_table(f"reading a {fmt_bytes(result['file_bytes'])} file ({rows:,} lines) as {readers} shards", COLUMNS,
                table_rows(result), caption=f"bytes is {fmt_ratio(result['speedup'])} faster per reader than lines")
    if markdown:
        click.echo(markdown_table(COLUMNS, table_rows(result)))
    if json_path:
        write_json(json_path, {"suite": "data-split", **result})
        click.echo(f"wrote {json_path}")
