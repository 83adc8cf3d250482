"""``cocosync bench sync``: one dense-sync round of ShadowSync's collective algorithms, the compiled DSL program on
shared memory (shadowsync/sync/compiled.py) against the hand-written classes on gloo, on T local trainers.

Per algorithm and size: each rank builds both over the same vector; rounds are timed round-robin in blocks, each
after a barrier of its own transport (time_blocks), medians of the slowest rank; `copies` = a round's time in units
of one copy of the vector on this machine (the memory traffic floor is a few copies: snapshot, reduce,
write-back)."""

from __future__ import annotations

from typing import Any

import click
import torch
import torch.distributed as dist

from cocosync.bench.common import (
    fmt_ratio,
    fmt_seconds,
    markdown_table,
    print_table,
    stats,
    time_blocks,
    write_json,
)
from cocosync.testing import RankPool

ALGORITHMS = ("ma", "bmuf")
DEFAULT_PARAMS = "27601,16000000"  # the default DLRM's dense part; a 16M-parameter dense part
COLUMNS = ["algorithm", "params", "schedule", "ours", "gloo", "speedup", "ours in copies"]


def _bench_rank(params: list[int], repeats: int) -> dict:
    from cocosync.shadowsync.sync import BMUF, ModelAveraging
    from cocosync.shadowsync.sync.compiled import CompiledSync
    from cocosync.shadowsync.train_config import SyncConfig

    gloo = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}
    for n in params:
        reps = repeats if n <= 1_000_000 else max(3, repeats // 4)
        copy_src = torch.randn(n)
        for alg in ALGORITHMS:
            cfg = SyncConfig(algorithm=f"shadow-{alg}")
            ours_x, ref_x = torch.randn(n), torch.randn(n)
            ours = CompiledSync(ours_x, cfg)
            ref = (BMUF if alg == "bmuf" else ModelAveraging)(ref_x, cfg, group=gloo)
            cases = {"ours": lambda: ours.sync(True), "gloo": lambda: ref.sync(True),
                     "copy": lambda: copy_src.clone()}
            # each side meets through its own transport and is timed in blocks (time_blocks): gloo warm, ours not
            # sharing the cores with gloo's threads still finishing the previous call
            shm = ours.plan.comm.shm
            samples = time_blocks(cases, reps, block=4, before={"ours": shm.barrier, "gloo": lambda: dist.barrier(gloo),
                                                              "copy": shm.barrier})
            out[f"{alg}|{n}"] = {"samples": samples, "schedule": "sliced" if ours.sliced else "replicated"}
    return out


def run(params: list[int], trainers: int, repeats: int) -> dict:
    with RankPool(trainers, timeout=900) as pool:
        per_rank = pool.run(_bench_rank, params, repeats, timeout=880)
    rows = []
    for key, first in per_rank[0].items():
        alg, n = key.split("|")
        med = {}
        for impl in ("ours", "gloo", "copy"):
            slowest = [max(v) for v in zip(*(pr[key]["samples"][impl] for pr in per_rank))]
            med[impl] = stats(slowest).median
        rows.append({"algorithm": alg, "params": int(n), "schedule": first["schedule"], "ours_s": med["ours"],
                     "gloo_s": med["gloo"], "speedup": med["gloo"] / med["ours"], "copy_s": med["copy"],
                     "ours_in_copies": med["ours"] / med["copy"]})
    return {"T": trainers, "threads_per_rank": 1, "rows": rows}


def table_rows(result: dict) -> list[list[str]]:
    return [[r["algorithm"], f"{r['params']:,}", r["schedule"], fmt_seconds(r["ours_s"]), fmt_seconds(r["gloo_s"]),
             fmt_ratio(r["speedup"]), f"{r['ours_in_copies']:.1f}"] for r in result["rows"]]


@click.command("sync")
@click.option("--params", default=DEFAULT_PARAMS, show_default=True,
              help="comma-separated dense-parameter counts (the synchronized vector).")
@click.option("--trainers", default=2, show_default=True, type=click.IntRange(2, 16), help="trainer processes.")
@click.option("--repeats", default=40, show_default=True, type=click.IntRange(3), help="timed rounds per case.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write results as JSON.")
@click.option("--markdown", is_flag=True, help="also print the table as markdown (for BENCHMARKS.md).")
def sync_cmd(params: str, trainers: int, repeats: int, json_path: str | None, markdown: bool) -> None:
    """One sync round of MA and BMUF: the compiled DSL program on shared memory vs the classes on gloo."""
    try:
        sizes = [int(p.replace("_", "")) for p in params.split(",") if p.strip()]
    except ValueError:
        raise click.BadParameter(f"--params {params!r}: expected comma-separated integers") from None
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"--params {params!r}: expected counts >= 1")
    result = run(sizes, trainers, repeats)
    print_table(f"sync round, T={trainers} trainers: median time (slowest rank)", COLUMNS, table_rows(result),
                caption="ours: compiled program on shared memory; gloo: the hand-written class on gloo; "
                        "speedup = gloo / ours; copies: ours / one clone of the vector")
    if markdown:
        click.echo(markdown_table(COLUMNS, table_rows(result)))
    if json_path:
        write_json(json_path, {"suite": "sync", **result})
        click.echo(f"wrote {json_path}")
