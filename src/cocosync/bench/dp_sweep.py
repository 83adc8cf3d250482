"""``cocosync bench dp --tf-batches 1,2,4,8``: the train step (ours vs DDP) against the tokens each rank processes.

What ours saves per step is nearly constant (DDP's gloo all-reduce that backward does not hide, its bucket copies),
while forward + backward grow with the tokens: the ratio says in which regime the optimizer's communication
matters. `dp.run_train_sweep` runs it: one `run_dp` (a fresh RankPool) per batch size, the train section only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from cocosync.bench.common import fmt_ratio, fmt_seconds, markdown_table, print_table, save_figure

__all__ = ["sweep_rows", "show_sweep", "sweep_png", "parse_batches", "COLUMNS"]

COLUMNS = ["batch / rank", "tokens / rank", "ours", "DDP + Adam(fused)", "DDP / ours", "target"]


def parse_batches(text: str) -> list[int]:
    try:
        batches = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise click.BadParameter(f"{text!r}: expected comma-separated positive integers, e.g. 1,2,4,8",
                                 param_hint="--tf-batches")
    return batches


def sweep_rows(result: dict[str, Any]) -> list[list[str]]:
    out = []
    for r in result["rows"]:
        ok = r["ours_s"] and r["ddp_s"]
        ratio = r["ddp_s"] / r["ours_s"] if ok else None
        out.append([str(r["batch"]), str(r["tokens"]), fmt_seconds(r["ours_s"]) if r["ours_s"] else "n/a",
                    fmt_seconds(r["ddp_s"]) if r["ddp_s"] else "n/a", fmt_ratio(ratio) if ratio else "n/a",
                    "-" if ratio is None else ("met" if ratio >= result["target"] else "missed")])
    return out


def show_sweep(result: dict[str, Any], markdown: bool = False) -> None:
    c = result["config"]
    title = (f"train step vs tokens per rank: {c['tf_layers']}-layer transformer, d={c['tf_dim']}, seq {c['tf_seq']}, "
             f"P={result['P']}, median of {c['repeats']} (target {result['target']}x)")
    print_table(title, COLUMNS, sweep_rows(result))
    if markdown:
        click.echo(markdown_table(COLUMNS, sweep_rows(result)))


def sweep_png(result: dict[str, Any], path: str | Path) -> Path:
    """DDP / ours against tokens per rank, with the target as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(r["tokens"], r["ddp_s"] / r["ours_s"]) for r in result["rows"] if r["ours_s"] and r["ddp_s"]]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if pts:
        ax.plot(*zip(*pts), marker="o", color="tab:green", label="DDP / ours (median)")
        for x, y in pts:
            ax.annotate(f"{y:.2f}x", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.axhline(result["target"], color="tab:gray", linestyle="--", label=f"target {result['target']}x")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)  # speedups from zero: the gaps read at their true size
    ax.set_xlabel("tokens per rank per step")
    ax.set_ylabel("speedup over DDP")
    c = result["config"]
    ax.set_title(f"train step: {c['tf_layers']}-layer transformer, d={c['tf_dim']}, P={result['P']}", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
