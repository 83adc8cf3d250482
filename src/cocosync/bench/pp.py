"""``cocosync bench pp``: a pipeline stage boundary, 2 stages x 2 tensor-parallel ranks (4 local ranks), one intra-op
thread each. Stage 0 holds partial sums y (the last row-parallel layer's output before its all_reduce); stage 1
needs dropout(all_reduce(y) + b).

Compared round-robin in the same run (median of the per-iteration max over the 4 ranks):

- plain:    stage 0: gloo all_reduce(y) in the stage + bias + torch dropout, then each rank sends the full
            activation to its peer in stage 1 (torch.distributed isend/irecv);
- ours c=1: `cocosync.nn.PipelineSend` with chunks=1: its plan (paper's pipeline schedule) reduce-scatters y,
            applies bias + dropout to its slice, sends only the slice (1/2 of the bytes per rank) and all-gathers on
            stage 1, stage by stage;
- ours:     the same with `--chunks` chunks (the Overlap step: RS -> epilogue -> send -> AG pipelined by chunks).

Every rank runs PipelineSend (it is a collective over the world). Each rank skips what its stage does not need
(runtime.reference.prune: the last stage only receives and all-gathers, the first stage's received value is zeros). The
collectives within a stage go through shared memory (its ranks share this node); the sends between stages go
through gloo in both, as they would between nodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import torch
import torch.distributed as dist

from cocosync.bench.common import (
    fmt_ratio,
    fmt_seconds,
    markdown_table,
    parse_shapes,
    print_table,
    save_figure,
    stats,
    time_interleaved,
    write_json,
)

__all__ = ["run_pp", "table_rows", "bar_png", "pp_cmd"]

COLUMNS = ["rows x hidden", "activation", "plain (gloo AR + full send)", "ours c=1", "ours overlap", "plain/ours c=1",
           "plain/ours overlap"]
CASES = {"plain": "plain", "ours1": "ours c=1", "ours": "ours overlap"}


def _bench_rank(shapes: list[tuple[int, int]], chunks: int, repeats: int, p: float) -> dict[str, Any]:
    from cocosync.nn import PipelineSend

    rank, P = dist.get_rank(), dist.get_world_size()
    G = P // 2
    stage, index = rank // G, rank % G
    groups = [dist.new_group(list(range(s * G, (s + 1) * G))) for s in range(2)]
    mine = groups[stage]
    out: dict[str, Any] = {}
    for rows, hidden in shapes:
        gen = torch.Generator().manual_seed(rank)
        y = torch.randn(rows, hidden, generator=gen) if stage == 0 else torch.zeros(rows, hidden)
        b = torch.randn(hidden, generator=torch.Generator().manual_seed(99))
        mods = {}
        for key, c in (("ours1", 1), ("ours", chunks)):
            mods[key] = PipelineSend(hidden, stages=2, p=p, chunks=c)
            with torch.no_grad():
                mods[key].bias.copy_(b)
        buf = torch.empty(rows, hidden)

        def plain() -> torch.Tensor:
            if stage == 0:
                z = y.clone()
                dist.all_reduce(z, group=mine)
                z = torch.nn.functional.dropout(z + b, p, training=True)
                dist.isend(z, rank + G).wait()
                return z
            dist.irecv(buf, rank - G).wait()
            return buf

        cases = {"plain": plain}
        for key, mod in mods.items():
            cases[key] = lambda mod=mod: mod(y)
        with torch.no_grad():
            samples = time_interleaved(cases, repeats, warmup=2, before=dist.barrier)
        plans = list(mods["ours"]._plans.plans.values())
        fast = [s for plan in plans for s in plan.fast_steps]
        out[f"{rows}x{hidden}"] = {"samples": samples, "fast": fast, "bytes": rows * hidden * 4, "index": index,
                                   "backend": plans[0].comm.backend}
    return out


def run_pp(shapes: list[tuple[int, int]], chunks: int, repeats: int, p: float = 0.1, P: int = 4) -> dict[str, Any]:
    from cocosync.testing.launch import RankPool

    with RankPool(P, threads=1, timeout=1800) as pool:
        per_rank = pool.run(_bench_rank, shapes, chunks, repeats, p, timeout=1800)
    result: dict[str, Any] = {"P": P, "stages": 2, "chunks": chunks, "repeats": repeats, "p": p, "rows": {}}
    for key in per_rank[0]:
        row: dict[str, Any] = {"bytes": per_rank[0][key]["bytes"]}
        for case in CASES:
            per_iter = [max(r[key]["samples"][case][i] for r in per_rank) for i in range(repeats)]
            st = stats(per_iter)
            row[case] = st.median
            row[f"{case}_p10"], row[f"{case}_p90"] = st.p10, st.p90
        row["overlap_fast"] = any(s.startswith("overlap(") for s in per_rank[0][key]["fast"])
        row["stage_backend"] = per_rank[0][key]["backend"]
        result["rows"][key] = row
    return result


def _mb(n: int) -> str:
    return f"{n / 2 ** 20:.2f} MB"


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    return [[key, _mb(r["bytes"]), fmt_seconds(r["plain"]), fmt_seconds(r["ours1"]), fmt_seconds(r["ours"]),
             fmt_ratio(r["plain"] / r["ours1"]), fmt_ratio(r["plain"] / r["ours"])]
            for key, r in result["rows"].items()]


def bar_png(result: dict[str, Any], path: str | Path, cases: dict[str, str], ours: set[str], title: str) -> Path:
    """Grouped bars of the medians (ms) per shape; `ours` cases in green shades, baselines in gray."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(result["rows"])
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(keys) * len(cases) / 2), 4))
    width = 0.8 / len(cases)
    greens = iter(["tab:green", "yellowgreen", "darkgreen", "olivedrab", "lime"])
    grays = iter(["tab:gray", "silver", "dimgray"])
    for j, (case, label) in enumerate(cases.items()):
        vals = [result["rows"][k][case] * 1e3 for k in keys]
        xs = [i + (j - (len(cases) - 1) / 2) * width for i in range(len(keys))]
        ax.bar(xs, vals, width, label=label, color=next(greens) if case in ours else next(grays))
        for x, v in zip(xs, vals):
            ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(keys)), keys)
    ax.set_ylabel("median ms (max over ranks)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


@click.command("pp")
@click.option("--shapes", default="64x1024,512x1024,2048x1024", show_default=True,
              help="Comma-separated ROWSxHIDDEN of the activation (rows even: the stage has 2 ranks).")
@click.option("--chunks", default=2, show_default=True, type=click.IntRange(2), help="Overlap chunks.")
@click.option("--repeats", default=20, show_default=True, type=click.IntRange(1), help="Timed repeats.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write results as JSON (and a PNG bar chart next to it, same name with .png).")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None, help="Bar chart path (PNG).")
@click.option("--markdown", is_flag=True, help="Also print the table as markdown (for BENCHMARKS.md).")
def pp_cmd(shapes: str, chunks: int, repeats: int, json_path: str | None, png_path: str | None,
           markdown: bool) -> None:
    """Pipeline send, 2 stages x 2 ranks: plain (gloo all_reduce + full send) vs cocosync.nn.PipelineSend."""
    result = run_pp(parse_shapes(shapes, 2, "ROWSxHIDDEN"), chunks, repeats)
    rows = table_rows(result)
    print_table(f"Pipeline send, 2 stages x 2 ranks, 1 thread/rank, median of {repeats} (chunks={chunks})", COLUMNS,
                rows)
    if markdown:
        click.echo(markdown_table(COLUMNS, rows))
    if json_path:
        click.echo(f"wrote {write_json(json_path, {'suite': 'pp', **result})}")
        png_path = png_path or str(Path(json_path).with_suffix(".png"))
    if png_path:
        title = "pp: 2 stages x 2 ranks, send of one activation"
        click.echo(f"wrote {bar_png(result, png_path, CASES, {'ours1', 'ours'}, title)}")
