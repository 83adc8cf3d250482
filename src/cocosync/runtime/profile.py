"""Per-step wall times of a compiled plan: where a call's time goes (GEMMs, collectives, fused kernels).

    with plan.profile() as prof:
        for _ in range(20):
            plan(**inputs)
    for row in prof.rows():
        print(row)        # {'step': 'kernel(matmul1, ...)', 'fast': True, 'calls': 20, 'median_ms': ..., 'share': ...}

`sync=True` makes the ranks of the plan's node meet before every step (a shared-memory barrier, off the clock), so
a collective's time is its own and not its wait for a slower peer; the waits between steps are reported as one more
row (the wait before the first step is left out: it holds whatever the ranks did between calls). The barriers
themselves change the timing a little: use it to see the split, and plain calls to time the whole.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["StepProfile"]

WAIT = "(waiting for peers between steps)"


class StepProfile:
    """Samples of every step of a CompiledPlan, collected while its `profile()` context is active."""

    def __init__(self, steps: list[str], fast: list[bool], sync: bool):
        self.steps, self.fast, self.sync = steps, fast, sync
        self.samples: list[list[float]] = [[] for _ in steps]
        self.waits: list[float] = []
        self._call_wait = 0.0

    def begin_call(self) -> None:
        self._call_wait = 0.0

    def add(self, i: int, seconds: float, waited: float = 0.0) -> None:
        self.samples[i].append(seconds)
        self._call_wait += waited
        if i == len(self.steps) - 1 and self.sync:
            self.waits.append(self._call_wait)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per step (and one for the waits with sync=True): median milliseconds per call, and its share of
        the sum of the medians."""
        rows = [{"step": s, "fast": f, "calls": len(xs), "median_ms": statistics.median(xs) * 1e3 if xs else 0.0}
                for s, f, xs in zip(self.steps, self.fast, self.samples)]
        if self.sync and self.waits:
            rows.append({"step": WAIT, "fast": None, "calls": len(self.waits),
                         "median_ms": statistics.median(self.waits) * 1e3})
        total = sum(r["median_ms"] for r in rows) or 1.0
        for r in rows:
            r["share"] = r["median_ms"] / total
        return rows


def timed_steps(plan, env: dict, prof: StepProfile) -> None:
    """Run the plan's steps on env, timing each (with prof.sync: after a barrier of the node's ranks)."""
    barrier = plan.comm.shm.barrier if prof.sync and plan.comm.shm is not None else None
    prof.begin_call()
    for i in range(len(plan.runners)):
        waited = 0.0
        if barrier is not None:
            t0 = time.perf_counter()
            barrier()
            waited = time.perf_counter() - t0 if i else 0.0
        t0 = time.perf_counter()
        plan.run_step(i, env)
        prof.add(i, time.perf_counter() - t0, waited)
