"""``cocosync bench backend``: the `cocosync` torch.distributed backend against gloo, through the ordinary
torch.distributed API (what DDP and every other client call): all_reduce per size, and a DDP training step.

Two ranks (RankPool, one intra-op thread each); both process groups are made with `new_group` over the whole world,
timed round-robin in one run; medians of the slowest rank, and gloo/cocosync ratios."""

from __future__ import annotations

from typing import Any

import click
import torch
import torch.distributed as dist

from cocosync.bench.common import (
    fmt_bytes,
    fmt_ratio,
    fmt_seconds,
    markdown_table,
    parse_size,
    print_table,
    stats,
    time_interleaved,
    write_json,
)
from cocosync.runtime.comm.backend import register
from cocosync.testing import RankPool

DEFAULT_SIZES = "4K,64K,1M,16M"
COLUMNS = ["case", "size", "cocosync", "gloo", "gloo/cocosync"]


def _ddp_step(group: Any, width: int) -> Any:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    ddp = DDP(model, process_group=group, bucket_cap_mb=25)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(16, width)

    def step() -> None:
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()
    return step


def _bench_rank(sizes: list[int], repeats: int, width: int) -> dict:
    register()
    ours, gloo = dist.new_group(backend="cocosync"), dist.new_group(backend="gloo")
    rows: dict[str, list[float]] = {}
    for nbytes in sizes:
        x = torch.randn(max(1, nbytes // 4))
        cases = {("all_reduce", nbytes, "cocosync"): lambda: dist.all_reduce(x, group=ours),
                 ("all_reduce", nbytes, "gloo"): lambda: dist.all_reduce(x, group=gloo)}
        for k, v in time_interleaved(cases, repeats, warmup=3).items():
            rows["|".join(map(str, k))] = v
    steps = {"cocosync": _ddp_step(ours, width), "gloo": _ddp_step(gloo, width)}
    params = 4 * (width * width + width)
    for k, v in time_interleaved({("ddp step", params * 4, n): f for n, f in steps.items()},
                                 max(3, repeats // 2), warmup=2).items():
        rows["|".join(map(str, k))] = v
    return rows


def run(sizes: list[int], repeats: int, width: int) -> dict:
    with RankPool(2, timeout=600) as pool:
        per_rank = pool.run(_bench_rank, sizes, repeats, width)
    rows = []
    for key in per_rank[0]:
        slowest = [max(vals) for vals in zip(*(pr[key] for pr in per_rank))]
        case, nbytes, impl = key.split("|")
        rows.append({"case": case, "bytes": int(nbytes), "impl": impl, **stats(slowest).as_dict()})
    return {"P": 2, "threads_per_rank": 1, "rows": rows}


def table_rows(result: dict) -> list[list[str]]:
    by = {(r["case"], r["bytes"], r["impl"]): r["median_s"] for r in result["rows"]}
    out = []
    for case, nbytes, impl in by:
        if impl != "cocosync":
            continue
        ours, gloo = by[(case, nbytes, "cocosync")], by[(case, nbytes, "gloo")]
        out.append([case, fmt_bytes(nbytes), fmt_seconds(ours), fmt_seconds(gloo), fmt_ratio(gloo / ours)])
    return out


@click.command("backend")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write results as JSON.")
@click.option("--sizes", default=DEFAULT_SIZES, show_default=True, help="all_reduce sizes.")
@click.option("--repeats", default=20, show_default=True, type=click.IntRange(1), help="Timed repeats.")
@click.option("--width", default=1024, show_default=True, type=click.IntRange(8),
              help="Width of the 4 Linear layers of the DDP step.")
@click.option("--markdown", is_flag=True, help="Also print the table as markdown (for BENCHMARKS.md).")
def backend_cmd(json_path, sizes, repeats, width, markdown) -> None:
    """The cocosync torch.distributed backend vs gloo (2 local ranks): all_reduce and a DDP step."""
    result = run([parse_size(s) for s in sizes.split(",")], repeats, width)
    print_table("torch.distributed backend: median time per call (slowest rank)", COLUMNS, table_rows(result),
                caption="P=2, 1 thread/rank; both groups made with new_group over the world; ratios > 1: ours faster")
    if markdown:
        click.echo(markdown_table(COLUMNS, table_rows(result)))
    if json_path:
        write_json(json_path, {"suite": "backend", **result})
        click.echo(f"wrote {json_path}")
