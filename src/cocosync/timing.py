"""Timing implementations side by side on this machine: medians over repeats, cases interleaved so that a change
of machine load hits them alike, and the memory bandwidth a process gets. The benchmarks, the autotuner and the
choices made inside a job (chunks="auto", tuned constants) all measure with these."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

__all__ = ["Stats", "stats", "time_calls", "time_blocks", "time_interleaved", "copy_bandwidth"]


@dataclass(frozen=True, slots=True)
class Stats:
    """Summary of repeated timings, in seconds."""

    median: float
    p10: float
    p90: float
    n: int

    def as_dict(self) -> dict[str, float]:
        return {"median_s": self.median, "p10_s": self.p10, "p90_s": self.p90, "n": self.n}


def stats(samples: Sequence[float]) -> Stats:
    if not samples:
        raise ValueError("no timing samples")
    s = sorted(samples)
    q = lambda f: s[min(len(s) - 1, int(f * (len(s) - 1) + 0.5))]  # noqa: E731
    return Stats(median=statistics.median(s), p10=q(0.1), p90=q(0.9), n=len(s))


def time_calls(fn: Callable[[], Any], repeats: int, *, warmup: int = 1,
               before: Callable[[], Any] | None = None) -> list[float]:
    """Run fn warmup + repeats times; return the `repeats` wall times. `before` (untimed) runs before each call,
    e.g. a barrier so that every rank starts together. (`time_interleaved` with one case.)"""
    return time_interleaved({0: fn}, repeats, warmup=warmup, before=before)[0]


def time_blocks(cases: dict[Any, Callable[[], Any]], repeats: int, *, block: int = 4,
                before: dict[Any, Callable[[], Any]]) -> dict[Any, list[float]]:
    """Round-robin by blocks: each visit of a case runs it `block` times, after its own `before` (e.g. the barrier
    of the transport it uses), and drops the first call, which pays for switching from the previous case (gloo's
    threads idle for a millisecond sleep: its next all_reduce of 110 KB took 2.7 ms instead of 0.43; a call right
    after a gloo one runs 80-90 us slower on 2 cores). Returns `repeats` samples per case; the visit order is
    shuffled with a fixed seed, the same on every rank."""
    order = list(cases)
    rng = random.Random(0)
    out: dict[Any, list[float]] = {k: [] for k in cases}
    while min(len(v) for v in out.values()) < repeats:
        rng.shuffle(order)
        for key in order:
            for i in range(block):
                before[key]()
                t0 = time.perf_counter()
                cases[key]()
                dt = time.perf_counter() - t0
                if i and len(out[key]) < repeats:
                    out[key].append(dt)
    return out


def time_interleaved(cases: dict[Any, Callable[[], Any]], repeats: int, *, warmup: int = 1,
                     before: Callable[[], Any] | None = None) -> dict[Any, list[float]]:
    """Time several implementations round-robin (warm-up rounds first), so that a change of machine load
    during the run hits all of them alike: compare them by ratio. Returns the samples per case.

    The first round runs in the given order; later rounds in an order shuffled with a fixed seed (the same on every
    rank: cases may be collectives), so that on average each case follows each other one equally often. A case
    right after a gloo call measured 80-90 us slower than the same case right after a shared-memory one (gloo's
    threads are still busy): at small sizes a fixed order biased the comparison against the case after gloo."""
    out: dict[Any, list[float]] = {k: [] for k in cases}
    items = list(cases.items())
    rng = random.Random(0)
    for i in range(warmup + repeats):
        if i:
            rng.shuffle(items)
        for key, fn in items:
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i >= warmup:
                out[key].append(dt)
    return out


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5, before: Callable[[], Any] | None = None) -> float:
    """Memory bandwidth of this process in bytes/s: a large torch copy, counted as read + write (STREAM 'copy').
    Run it in every rank at once (with `before` a barrier) to measure what the ranks get together."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    times = time_calls(lambda: dst.copy_(src), repeats, warmup=1, before=before)
    return 2 * nbytes / statistics.median(times)
