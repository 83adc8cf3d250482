"""The PNG bar chart of `cocosync bench dp`: medians per section, ours highlighted, the memory-traffic bound drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cocosync.bench.common import save_figure

SECTIONS = ("adam", "lamb", "sgd", "train")
# the case that is ours, per section
OURS_OF = {"adam": "ours", "lamb": "lamb_ours", "sgd": "sgd_ours", "train": "train_ours"}


def write_png(result: dict[str, Any], path: str | Path) -> Path:
    """A bar chart of the medians (ms), one panel per section, ours highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = [s for s in SECTIONS if any(r["section"] == s and r.get("median_s") for r in result["rows"])] or ["adam"]
    counts = [max(1, sum(1 for r in result["rows"] if r["section"] == s and r.get("median_s"))) for s in sections]
    fig, axes = plt.subplots(len(sections), 1, figsize=(11, 0.9 * len(sections) + 0.42 * sum(counts)), squeeze=False,
                             gridspec_kw={"height_ratios": counts})
    for ax, section in zip(axes[:, 0], sections):
        rows = [r for r in result["rows"] if r["section"] == section and r.get("median_s")]
        labels = [r["label"] for r in rows][::-1]
        vals = [r["median_s"] * 1e3 for r in rows][::-1]
        colors = ["tab:green" if r["case"] == OURS_OF[section] else "tab:gray" for r in rows][::-1]
        ax.barh(labels, vals, color=colors)
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v:.1f} ms", va="center", fontsize=8)
        if section in ("adam", "lamb", "sgd"):
            bound = result.get("sgd_bound_s", result["bound_s"]) if section == "sgd" else result["bound_s"]
            ax.axvline(bound * 1e3, color="tab:red", ls="--", lw=1, label="memory-traffic bound")
            ax.legend(fontsize=7, loc="best")
        ax.set_title(f"{section}: median time per step (ms), P={result['P']}, 1 thread/rank", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlim(0, max(vals, default=1.0) * 1.25)
    return save_figure(fig, path)
