"""Metrics of CTR training: NE (He et al. 2014), AUC, Bayes NE, throughput, sync gap; JSON-lines logs,
a summary table (rich) and an NE-vs-examples plot (matplotlib, Agg).

NE = mean log loss / H(base rate), H(p) = -p log p - (1-p) log(1-p), base rate = the labels' mean unless
given. A predictor that always says the base rate has NE 1; lower is better.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

__all__ = [
    "normalized_entropy", "log_loss", "auc", "calibration", "bayes_ne",
    "MetricsLogger", "read_metrics", "json_safe", "summary_table", "plot_ne", "evaluate",
]

_EPS = 1e-7


def _np(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


def _entropy(p: float) -> float:
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def log_loss(labels: Any, probs: Any) -> float:
    """Mean binary cross-entropy (nats), probabilities clipped to [1e-7, 1 - 1e-7]."""
    y, p = _np(labels), np.clip(_np(probs), _EPS, 1 - _EPS)
    if y.shape != p.shape or y.size == 0:
        raise ValueError(f"log_loss: labels {y.shape} and probs {p.shape} must be equal, non-empty shapes")
    return float(-(y * np.log(p) + (1 - y) * np.log1p(-p)).mean())


def normalized_entropy(labels: Any, probs: Any, base_rate: float | None = None) -> float:
    """Log loss over the entropy of the background click rate (`base_rate`, default: mean of labels)."""
    y = _np(labels)
    rate = float(y.mean()) if base_rate is None and y.size else base_rate
    if rate is None or not 0.0 < rate < 1.0:
        raise ValueError(
            f"normalized_entropy: base rate {rate!r} must be strictly between 0 and 1 "
            "(NE is undefined when every label is the same)"
        )
    return log_loss(y, probs) / _entropy(rate)


def calibration(labels: Any, probs: Any) -> float:
    """Predicted CTR over actual CTR (1 is calibrated; NaN when no example clicked)."""
    y, p = _np(labels), _np(probs)
    return float(p.mean() / y.mean()) if y.size and y.mean() > 0 else float("nan")


def bayes_ne(labels: Any, true_probs: Any) -> float:
    """NE of the true click probabilities on these labels: the best NE any model can expect."""
    return normalized_entropy(labels, true_probs)


def auc(labels: Any, probs: Any) -> float:
    """ROC AUC as the Mann-Whitney statistic (tied scores share their mean rank: sklearn's roc_auc_score, which the
    tests compare it with); NaN when only one class is present. Not sklearn itself: importing sklearn.metrics costs
    ~2.4 s of CPU in the process that scores, at every job's end (BENCHMARKS.md, "A job's fixed cost")."""
    y, p = _np(labels).astype(bool).ravel(), _np(probs).ravel()
    positives = int(y.sum())
    negatives = y.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(p, kind="stable")
    _, first, counts = np.unique(p[order], return_index=True, return_counts=True)
    ranks = np.repeat(first + (counts + 1) / 2, counts)  # 1-based, the mean rank of each run of equal scores
    return float((ranks[y[order]].sum() - positives * (positives + 1) / 2) / (positives * negatives))


class MetricsLogger:
    """Append JSON lines (one dict per `log` call, with a wall-clock `time` added) to `path`."""

    def __init__(self, path: str | os.PathLike, *, append: bool = False) -> None:
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")

    def log(self, record: Mapping[str, Any] | None = None, **fields: Any) -> None:
        rec = {"time": time.time(), **(record or {}), **fields}
        self._f.write(json.dumps(rec, default=_jsonable) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def json_safe(obj: Any) -> Any:
    """`obj` with NaN/inf floats replaced by None (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a JSON-lines metrics file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def summary_table(runs: Sequence[Mapping[str, Any]], title: str = "Runs"):
    """A rich Table with one row per run dict and one column per key (in first-seen order)."""
    from rich.table import Table

    columns: list[str] = []
    for run in runs:
        columns += [k for k in run if k not in columns and k != "records"]
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col == "name" else "right")
    for run in runs:
        table.add_row(*(_fmt(run.get(col, "")) for col in columns))
    return table


def curve(records: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    """(examples, value) of `key` over a run's records, finite values only. A summary record counts its session's
    examples, not the run's: after a resume it would plot backwards, so it is left out."""
    return [(r["examples"], r[key]) for r in records
            if "examples" in r and r.get("event") not in ("summary", "start") and r.get(key) is not None
            and math.isfinite(r[key])]


def plot_ne(runs: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, title: str = "NE vs examples") -> str:
    """PNG of NE against examples for several runs on one figure.

    Each run: {"name": str, "records": [{"examples": int, "train_ne"?: float, "eval_ne"?: float}, ...],
    "bayes_ne"?: float}. Train NE is a solid line, eval NE dashed with markers, Bayes NE a dotted level.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        for key, style in (("train_ne", dict(ls="-")), ("eval_ne", dict(ls="--", marker="o", ms=3))):
            pts = curve(run.get("records", []), key)
            if pts:
                x, y = zip(*pts)
                ax.plot(x, y, color=color, label=f"{run.get('name', i)} {key.split('_')[0]}", **style)
        if run.get("bayes_ne") is not None:
            ax.axhline(run["bayes_ne"], color=color, ls=":", lw=1, label=f"{run.get('name', i)} Bayes")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("examples")
    ax.set_ylabel("normalized entropy (lower is better)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable, *, max_batches: int | None = None) -> dict:
    """Eval metrics of `model` (logits out) over batches with .dense/.sparse/.label[/.prob]:
    {examples, ctr, ne, log_loss, auc, bayes_ne (NaN unless every batch knows its true probs)}."""
    was_training = model.training
    model.eval()
    labels, probs, true = [], [], []
    try:
        for i, b in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            labels.append(_np(b.label))
            probs.append(_np(torch.sigmoid(model(b.dense, b.sparse))))
            true.append(_np(b.prob) if getattr(b, "prob", None) is not None else None)
    finally:
        model.train(was_training)
    if not labels:
        raise ValueError("evaluate: no batches to evaluate on")
    y, p = np.concatenate(labels), np.concatenate(probs)
    out = {"examples": int(y.size), "ctr": float(y.mean()), "ne": normalized_entropy(y, p),
           "log_loss": log_loss(y, p), "auc": auc(y, p), "calibration": calibration(y, p), "bayes_ne": float("nan")}
    if all(t is not None for t in true):
        out["bayes_ne"] = bayes_ne(y, np.concatenate(true))
    return out
