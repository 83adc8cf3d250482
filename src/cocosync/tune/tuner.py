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

__all__ = ["autotune", "TuneResult", "cache_dir", "cache_key", "project"]

#: node counts every candidate is predicted at (same ranks per node as timed): configurations not timed
PROJECT_NODES = (1, 2, 4, 8, 16, 32)


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
                "model_error": self.model_error, "key": self.key, **self.extra}


def project(program, candidates: list, fasts: list, model: MachineModel,
            node_counts: tuple[int, ...] = PROJECT_NODES) -> list[dict[str, Any]]:
    """Every candidate (with the steps that ran fast when timed) predicted on more nodes with the measured ranks per
    node (the network: as measured; a real network's bandwidth can be given to MachineModel.at): rows of nodes,
    world, per-candidate predicted_s and the predicted best."""
    local = model.world // model.nodes
    plans = [(c.name, lower(replay(program, c.directives)), fast) for c, fast in zip(candidates, fasts)]
    rows = []
    for n in node_counts:
        m = model.at(local * n, n)
        predicted = {name: predict(plan, m, fast) for name, plan, fast in plans}
        rows.append({"nodes": n, "world": local * n, "predicted_s": predicted,
                     "best": min(predicted, key=predicted.__getitem__)})
    return rows


def cache_dir() -> Path:
    return Path(os.environ.get("COCOSYNC_CACHE_DIR", Path.home() / ".cache" / "cocosync")) / "tune"


def cache_key(listing: str, world: int, nnodes: int) -> str:
    machine = f"{platform.machine()}-{platform.processor()}-{os.cpu_count()}"
    kernels = os.environ.get("COCOSYNC_KERNELS", "inductor")  # generated or eager kernels time differently
    raw = json.dumps([listing, world, nnodes, torch.__version__, machine, kernels])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def autotune(target: str, *, world: int = 2, nodes: int = 1, repeats: int = 7, use_cache: bool = True,
             model_from: dict[str, Any] | None = None, progress: Any = None) -> TuneResult:
    """Tune the schedule of `target` (a built-in workload name or FILE.py) on `world` ranks: one node, or `nodes`
    nodes simulated on this host (torchrun's layout; gloo between them over loopback). `model_from`: a machine
    model measured in another configuration (a TuneResult's `model`): each candidate is also predicted from it
    (`predicted_from_s`) and its median error reported (`cross_error`), the check of predictions for
    configurations not timed."""
    if nodes < 1 or world % nodes:
        raise ValueError(f"nodes={nodes} must divide ranks={world}")
    work = workload(target)
    program = work.build()
    key = cache_key(str(program), world, nodes)
    path = cache_dir() / f"{key}.json"
    if use_cache and path.is_file() and model_from is None:
        saved = json.loads(path.read_text())
        return TuneResult(**{k: saved[k] for k in ("workload", "world", "candidates", "chosen", "reason", "model",
                                                   "model_error")}, cached=True, key=key,
                          extra={k: saved[k] for k in ("nodes", "projection") if k in saved})
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

    with RankPool(world, nnodes=nodes, threads=1, timeout=1800) as pool:
        out = pool.run(time_candidates, work.source, [c.directives for c, _ in legal], repeats)[0]
    model: MachineModel = out["model"]
    errors = []
    for (c, row), measured, fast in zip(legal, out["medians"], out["fast"]):
        row["measured_s"] = measured
        row["predicted_s"] = predict(lower(replay(program, c.directives)), model, fast)
        errors.append(abs(row["predicted_s"] - measured) / measured)
    extra: dict[str, Any] = {"nodes": nodes}
    if model_from is not None:
        other = MachineModel(**model_from).at(world, nodes)
        cross = []
        for (c, row), fast in zip(legal, out["fast"]):
            row["predicted_from_s"] = predict(lower(replay(program, c.directives)), other, fast)
            cross.append(abs(row["predicted_from_s"] - row["measured_s"]) / row["measured_s"])
        extra |= {"model_from": dict(model_from), "cross_error": statistics.median(cross) if cross else None}
    best = min((row for _, row in legal), key=lambda r: r["measured_s"])
    written = rows[0]
    where = f"{world} ranks" + (f" on {nodes} nodes" if nodes > 1 else "")
    reason = (f"fastest median of {len(legal)} legal schedules ({repeats} round-robin repeats on {where}): "
              f"{best['measured_s'] * 1e3:.3f} ms"
              + (f", {written['measured_s'] / best['measured_s']:.2f}x the program as written"
                 if "measured_s" in written and best is not written else ""))
    result = TuneResult(work.name, world, rows, best["name"], reason, model.as_dict(),
                        statistics.median(errors) if errors else None, key=key,
                        extra={**extra, "projection": project(program, [c for c, _ in legal], out["fast"], model)})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.as_json(), indent=2))
    os.replace(tmp, path)
    return result
