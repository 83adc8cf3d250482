"""Shared benchmark utilities: timing (medians over repeats), sizes, memory bandwidth, rich tables, JSON records.

Every suite measures ours and the baselines in the same run, reports medians, ratios (baseline / ours: higher is
better for us) and, where a memory-traffic bound exists, the fraction of it reached (bound time / our time).
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from cocosync.timing import Stats, copy_bandwidth, stats, time_blocks, time_calls, time_interleaved

__all__ = ["Stats", "time_calls", "time_blocks", "time_interleaved", "stats", "parse_size", "parse_shapes", "fmt_bytes",
           "fmt_seconds", "fmt_ratio", "copy_bandwidth", "bound_seconds", "machine_info", "print_table",
           "markdown_table", "write_json", "TimeBudget", "fit_line"]


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """'4K' / '16MB' / '1g' / '4096' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot parse size {text!r}: use a number with an optional unit K, M or G (e.g. 4K, 64M)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_shapes(text: str, dims: int, form: str) -> list[tuple[int, ...]]:
    """'64x1024,512x1024' -> [(64, 1024), (512, 1024)]; `form` (e.g. 'ROWSxHIDDEN') names the dims in errors."""
    import click

    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != dims or min(s) < 1 for s in shapes):
        example = "x".join(["64", "1024", "4096"][:dims])
        raise click.BadParameter(f"{text!r}: expected comma-separated {form} (positive ints), e.g. {example}")
    return shapes


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} us"


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def bound_seconds(traffic_bytes: float, bandwidth: float) -> float:
    """Time to move `traffic_bytes` at `bandwidth` bytes/s (a lower bound for a memory-bound operation)."""
    return traffic_bytes / bandwidth


def machine_info() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover
        load = None
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:  # pragma: no cover
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg_at_start": load, "torch": torch.__version__,
            "python": sys.version.split()[0], "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": " ".join(["cocosync", *sys.argv[1:]]) if sys.argv else None}


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], console=None,
                caption: str | None = None) -> None:
    """A rich table; numbers are right-aligned."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*[str(v) for v in r])
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped / redirected: do not squeeze the table into 80 columns
            console = Console(width=160)
    console.print(table)


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """The same table as GitHub markdown (for BENCHMARKS.md)."""
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"]
    lines += ["| " + " | ".join(str(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write payload (plus machine info under 'machine') as indented JSON; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2, default=str) + "\n")
    return p


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Lay out, write (PNG, creating the folder) and close a matplotlib figure; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


class TimeBudget:
    """A bench's `--time-limit` (seconds; None: none): `allows()` says whether one more step, judged by the slowest
    `step()` so far, would end within it, so a bench on a machine lent for minutes reports what finished."""

    def __init__(self, limit: float | None):
        self.limit, self.t0, self.slowest = limit, time.monotonic(), 0.0

    def allows(self) -> bool:
        return self.limit is None or time.monotonic() - self.t0 + self.slowest <= self.limit

    def step(self) -> Any:
        """A context timing one step."""
        import contextlib

        @contextlib.contextmanager
        def timed():
            started = time.monotonic()
            yield
            self.slowest = max(self.slowest, time.monotonic() - started)

        return timed()


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b
