"""``cocosync bench sync``: one dense-sync round of ShadowSync's algorithms as compiled DSL programs against the
hand-written code they replace, on T local trainers: MA and BMUF on shared memory (shadowsync/sync/compiled.py) vs
the classes on gloo; EASGD's program (one generated loop) vs the torch calls its class made, every trainer moving
one centre in shared memory.

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

ALGORITHMS = ("ma", "bmuf", "easgd")
DEFAULT_PARAMS = "27601,16000000"  # the default DLRM's dense part; a 16M-parameter dense part
COLUMNS = ["algorithm", "params", "schedule", "ours", "baseline", "speedup", "ours in copies"]
BASELINES = {"ma": "gloo", "bmuf": "gloo", "easgd": "torch ops"}


def _easgd_by_hand(x: torch.Tensor, c: torch.Tensor, alpha: float) -> None:
    """EASGD's update as its class made it before the program (five passes over the vector): the baseline."""
    diff = x.clone().sub_(c).mul_(alpha)
    x.sub_(diff)
    c.add_(diff)


def _easgd_cases(n: int, shm: Any) -> dict[str, Any]:
    """Both EASGD updates against centres every trainer shares (local rank 0's arena tensors)."""
    from cocosync.shadowsync.config import SyncConfig
    from cocosync.shadowsync.sync import EASGD

    cfg = SyncConfig(algorithm="shadow-easgd")
    centres = []
    for _ in range(2):
        mine = shm.arena.empty(n)  # collective: every trainer allocates, all use local rank 0's
        if shm.local_rank == 0:
            mine.normal_()
        centres.append(shm.arena.peer_view(mine, 0))
    shm.barrier()
    ours, ref_x = EASGD(torch.randn(n), cfg, center=centres[0]), torch.randn(n)
    return {"ours": lambda: ours.sync(True), "baseline": lambda: _easgd_by_hand(ref_x, centres[1], ours.alpha)}


def _bench_rank(params: list[int], repeats: int) -> dict:
    from cocosync.runtime.comm.communicators import shared_communicator
    from cocosync.shadowsync.config import SyncConfig
    from cocosync.shadowsync.sync import BMUF, ModelAveraging
    from cocosync.shadowsync.sync.compiled import CompiledSync

    gloo = dist.new_group(backend="gloo")
    shm = shared_communicator()
    out: dict[str, Any] = {}
    for n in params:
        reps = repeats if n <= 1_000_000 else max(3, repeats // 4)
        copy_src = torch.randn(n)
        for alg in ALGORITHMS:
            schedule = "one loop"
            barriers = {"ours": shm.barrier, "baseline": shm.barrier, "copy": shm.barrier}
            if alg == "easgd":
                cases = _easgd_cases(n, shm)
            else:
                cfg = SyncConfig(algorithm=f"shadow-{alg}")
                ours = CompiledSync(torch.randn(n), cfg)
                ref = (BMUF if alg == "bmuf" else ModelAveraging)(torch.randn(n), cfg, group=gloo)
                cases = {"ours": lambda: ours.sync(True), "baseline": lambda: ref.sync(True)}
                schedule = "sliced" if ours.sliced else "replicated"
                # each side meets through its own transport and is timed in blocks (time_blocks): gloo warm, ours
                # not sharing the cores with gloo's threads still finishing the previous call
                barriers["baseline"] = lambda: dist.barrier(gloo)
            cases["copy"] = copy_src.clone  # the unit of `ours in copies`
            samples = time_blocks(cases, reps, block=4, before=barriers)
            out[f"{alg}|{n}"] = {"samples": samples, "schedule": schedule}
    return out


def run(params: list[int], trainers: int, repeats: int) -> dict:
    with RankPool(trainers, timeout=900) as pool:
        per_rank = pool.run(_bench_rank, params, repeats, timeout=880)
    rows = []
    for key, first in per_rank[0].items():
        alg, n = key.split("|")
        med = {}
        for impl in ("ours", "baseline", "copy"):
            slowest = [max(v) for v in zip(*(pr[key]["samples"][impl] for pr in per_rank))]
            med[impl] = stats(slowest).median
        rows.append({"algorithm": alg, "params": int(n), "schedule": first["schedule"], "ours_s": med["ours"],
                     "baseline": BASELINES[alg], "baseline_s": med["baseline"],
                     "gloo_s": med["baseline"] if BASELINES[alg] == "gloo" else None,
                     "speedup": med["baseline"] / med["ours"], "copy_s": med["copy"],
                     "ours_in_copies": med["ours"] / med["copy"]})
    return {"T": trainers, "threads_per_rank": 1, "rows": rows}


def table_rows(result: dict) -> list[list[str]]:
    return [[r["algorithm"], f"{r['params']:,}", r["schedule"], fmt_seconds(r["ours_s"]),
             f"{fmt_seconds(r['baseline_s'])} ({r['baseline']})", fmt_ratio(r["speedup"]), f"{r['ours_in_copies']:.1f}"]
            for r in result["rows"]]


@click.command("sync")
@click.option("--params", default=DEFAULT_PARAMS, show_default=True,
              help="comma-separated dense-parameter counts (the synchronized vector).")
@click.option("--trainers", default=2, show_default=True, type=click.IntRange(2, 16), help="trainer processes.")
@click.option("--repeats", default=40, show_default=True, type=click.IntRange(3), help="timed rounds per case.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write results as JSON.")
@click.option("--markdown", is_flag=True, help="also print the table as markdown (for BENCHMARKS.md).")
def sync_cmd(params: str, trainers: int, repeats: int, json_path: str | None, markdown: bool) -> None:
    """One sync round of MA, BMUF and EASGD: the compiled DSL programs vs the code they replace (the classes on
    gloo; EASGD's torch calls)."""
    try:
        sizes = [int(p.replace("_", "")) for p in params.split(",") if p.strip()]
    except ValueError:
        raise click.BadParameter(f"--params {params!r}: expected comma-separated integers") from None
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"--params {params!r}: expected counts >= 1")
    result = run(sizes, trainers, repeats)
    print_table(f"sync round, T={trainers} trainers: median time (slowest rank)", COLUMNS, table_rows(result),
                caption="ours: the compiled program (shared memory); baseline: the hand-written class on gloo (MA, "
                        "BMUF), EASGD's torch calls; speedup = baseline / ours; copies: ours / one clone of the "
                        "vector")
    if markdown:
        click.echo(markdown_table(COLUMNS, table_rows(result)))
    if json_path:
        write_json(json_path, {"suite": "sync", **result})
        click.echo(f"wrote {json_path}")
