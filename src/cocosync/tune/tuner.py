"""`cocosync.autotune`: enumerate a program's legal schedules (space.py), prune by the oracle on small inputs
(oracle.py), lower and time each on real ranks round-robin (measure.py), predict each with the cost model
(cost.py), choose the fastest median, and cache the choice on disk.

The cache key is (program listing, world size, nodes, torch version, machine, kernel backend); an entry holds
every candidate's directives and times, so a cached answer prints the same table. Cache: $COCOSYNC_CACHE_DIR or
~/.cache/cocosync, file tune/<key>.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cocosync.lower import lower
from cocosync.schedule.schedule import replay
from cocosync.tune.cost import MachineModel, predict
from cocosync.tune.oracle import agrees
from cocosync.tune.space import schedule_space
from cocosync.tune.workloads import workload

__all__ = ["autotune", "TuneResult", "cache_dir"]


@dataclass
class TuneResult:
    workload: str
    world: int
    candidates: list[dict[str, Any]]  # name, schedule (directive list), measured_s, predicted_s, or pruned (why)
    chosen: str
    reason: str
    model: dict[str, float]
    model_error: float | None  # median |predicted - measured| / measured over the timed candidates
    cached: bool = False
    key: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"workload": self.workload, "world": self.world, "candidates": self.candidates,
                "chosen": self.chosen, "reason": self.reason, "model": self.model,
                "model_error": self.model_error, "key": self.key}


def cache_dir() -> Path:
    return Path(os.environ.get("COCOSYNC_CACHE_DIR", Path.home() / ".cache" / "cocosync")) / "tune"


def _key(listing: str, world: int, nnodes: int) -> str:
    machine = f"{platform.machine()}-{platform.processor()}-{os.cpu_count()}"
    kernels = os.environ.get("COCOSYNC_KERNELS", "inductor")  # generated or eager kernels time differently
    raw = json.dumps([listing, world, nnodes, torch.__version__, machine, kernels])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def autotune(target: str, *, world: int = 2, repeats: int = 7, use_cache: bool = True,
             progress: Any = None) -> TuneResult:
    """Tune the schedule of `target` (a built-in workload name or FILE.py) on `world` local ranks."""
    work = workload(target)
    program = work.build()
    key = _key(str(program), world, 1)
    path = cache_dir() / f"{key}.json"
    if use_cache and path.is_file():
        saved = json.loads(path.read_text())
        return TuneResult(**{k: saved[k] for k in ("workload", "world", "candidates", "chosen", "reason", "model",
                                                   "model_error")}, cached=True, key=key)
    rows: list[dict[str, Any]] = []
    legal = []
    for c in schedule_space(program, work.internal, world=world):
        row: dict[str, Any] = {"name": c.name, "schedule": c.listing}
        try:
            why = agrees(work, c, world)
        except Exception as e:  # noqa: BLE001 - a schedule that does not apply at the oracle's size is pruned
            why = f"{type(e).__name__}: {e}"
        if why is not None:
            row["pruned"] = why
        else:
            legal.append((c, row))
        rows.append(row)
    from cocosync.testing.launch import RankPool
    from cocosync.tune.measure import time_candidates

    with RankPool(world, threads=1, timeout=1800) as pool:
        out = pool.run(time_candidates, work.source, [c.directives for c, _ in legal], repeats)[0]
    model: MachineModel = out["model"]
    errors = []
    for (c, row), measured, fast in zip(legal, out["medians"], out["fast"]):
        row["measured_s"] = measured
        row["predicted_s"] = predict(lower(replay(program, c.directives)), model, fast)
        errors.append(abs(row["predicted_s"] - measured) / measured)
    best = min((row for _, row in legal), key=lambda r: r["measured_s"])
    written = rows[0]
    reason = (f"fastest median of {len(legal)} legal schedules ({repeats} round-robin repeats on {world} ranks): "
              f"{best['measured_s'] * 1e3:.3f} ms"
              + (f", {written['measured_s'] / best['measured_s']:.2f}x the program as written"
                 if "measured_s" in written and best is not written else ""))
    result = TuneResult(work.name, world, rows, best["name"], reason, model.as_dict(),
                        statistics.median(errors) if errors else None, key=key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.as_json(), indent=2))
    os.replace(tmp, path)
    return result
