"""Hand-tuned runtime constants decided by measurement: `cocosync tune one-shot` times the shared-memory all_reduce
in its one-shot form (every rank reads every peer's whole vector behind one barrier) and in its three-phase form
(reduce-scatter, all-gather) over sizes, round-robin, and writes the largest size up to which one-shot stays faster
as `one_shot_bytes` for this number of local ranks (runtime/comm/tuned.py reads it)."""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import torch

from cocosync.bench.common import time_interleaved
from cocosync.reduce_op import ReduceOp
from cocosync.runtime.comm.collectives import ShmCommunicator
from cocosync.runtime.comm.tuned import constants_path

__all__ = ["PEER_BYTES", "measure_one_shot", "choose_one_shot", "save_constant"]

#: (local ranks - 1) x vector bytes at which the two forms are compared (the constant's unit)
PEER_BYTES = tuple(k << 10 for k in (16, 64, 256, 512, 1024, 2048, 4096, 8192))


def measure_one_shot(repeats: int) -> dict[str, Any]:
    """On every rank of one node: medians (s) of both forms at each of PEER_BYTES (ordinary, not arena, tensors)."""
    one_shot, three_phase = ShmCommunicator(one_shot_bytes=1 << 62), ShmCommunicator(one_shot_bytes=0)
    peers = one_shot.local_size - 1
    cases = {}
    for size in PEER_BYTES:
        x = torch.ones(max(1, size // 4 // peers))
        cases[("one-shot", size)] = lambda x=x: one_shot.all_reduce(x, ReduceOp.SUM)
        cases[("three-phase", size)] = lambda x=x: three_phase.all_reduce(x, ReduceOp.SUM)
    samples = time_interleaved(cases, repeats, warmup=2, before=one_shot.barrier)
    rows = [{"peer_bytes": size, "one_shot_s": statistics.median(samples[("one-shot", size)]),
             "three_phase_s": statistics.median(samples[("three-phase", size)])} for size in PEER_BYTES]
    return {"local_ranks": one_shot.local_size, "rows": rows}


def choose_one_shot(rows: list[dict[str, Any]]) -> int:
    """The largest size up to which one-shot is faster at every measured size (0: never faster)."""
    best = 0
    for r in sorted(rows, key=lambda r: r["peer_bytes"]):
        if r["one_shot_s"] >= r["three_phase_s"]:
            break
        best = r["peer_bytes"]
    return best


def save_constant(name: str, local_ranks: int, value: int) -> str:
    """Merge `name@local_ranks = value` into the tuned constants file; returns its path."""
    path = constants_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    saved[f"{name}@{local_ranks}"] = int(value)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return str(path)

