"""Hand-tuned runtime constants decided by measurement, saved for this number of local ranks (runtime/comm/tuned.py
reads them):

* `cocosync tune one-shot` times the shared-memory all_reduce in its one-shot form (every rank reads every peer's
  whole vector behind one barrier) and in its three-phase form (reduce-scatter, all-gather) over sizes,
  round-robin, and writes the largest size up to which one-shot stays faster as `one_shot_bytes`;
* `cocosync tune kernel-bytes` times the standard fused Adam collective (16 MB of fp32 gradient) with each of
  KERNEL_BYTES_CHOICES bytes per kernel call, round-robin, and writes the fastest median as `kernel_bytes`;
* `cocosync tune eager-work` times a 3-stage epilogue (bias + relu + residual: one generated kernel) compiled
  by Inductor and run eagerly at EAGER_SIZES elements, round-robin, and writes the work (elements x the kernel's
  stages) from which the compiled kernel stays faster as `eager_work`."""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import torch

from cocosync.reduce_op import ReduceOp
from cocosync.runtime.comm.collectives import ShmCommunicator
from cocosync.runtime.comm.tuned import constants_path
from cocosync.timing import time_interleaved

__all__ = ["PEER_BYTES", "KERNEL_BYTES_CHOICES", "EAGER_SIZES", "measure_one_shot", "choose_one_shot",
           "measure_kernel_bytes", "choose_kernel_bytes", "measure_eager_work", "choose_eager_work", "save_constant"]

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


#: bytes of gradient per fused-kernel call compared by `cocosync tune kernel-bytes` (the hand rule's sweep)
KERNEL_BYTES_CHOICES = tuple(k << 10 for k in (256, 512, 1024, 2048, 4096, 8192))


def measure_kernel_bytes(repeats: int, numel: int = 4 << 20) -> dict[str, Any]:
    """On every rank of one node: the standard fused Adam step on `numel` fp32 elements compiled once per choice of
    kernel bytes, timed round-robin; the slowest rank's median per choice (every rank returns the same rows)."""
    import torch.distributed as dist

    from cocosync.interp import rank_inputs
    from cocosync.lower import lower
    from cocosync.programs.optimizers import adam_program
    from cocosync.runtime.comm.communicators import shared_communicator
    from cocosync.runtime.executor import compile_plan
    from cocosync.schedule.standard import adam_schedule
    from cocosync.tune.workloads import BUILTIN, global_inputs

    world, rank = dist.get_world_size(), dist.get_rank()
    program = adam_program(numel)
    scheduled = adam_schedule(program).program
    inputs = global_inputs(program, world, BUILTIN["adam"][3])
    cases = {}
    for size in KERNEL_BYTES_CHOICES:
        fn = compile_plan(lower(scheduled), kernel_bytes=size)
        args = rank_inputs(scheduled, world, inputs, rank)
        cases[size] = lambda f=fn, a=args: f(**a)
    comm = shared_communicator()
    samples = time_interleaved(cases, repeats, warmup=2, before=comm.barrier)
    medians = torch.tensor([statistics.median(samples[size]) for size in KERNEL_BYTES_CHOICES], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # a collective is as slow as its slowest rank
    rows = [{"kernel_bytes": size, "median_s": float(t)} for size, t in zip(KERNEL_BYTES_CHOICES, medians)]
    return {"local_ranks": comm.local_size, "numel": numel, "rows": rows}


def choose_kernel_bytes(rows: list[dict[str, Any]], default: int, margin: float = 0.05) -> int:
    """The fastest choice, unless it beats the default by less than `margin` (machine noise): then the default."""
    best = min(rows, key=lambda r: r["median_s"])
    base = next((r for r in rows if r["kernel_bytes"] == default), None)
    if base is not None and best["median_s"] > base["median_s"] * (1 - margin):
        return default
    return best["kernel_bytes"]


#: elements of the epilogue compared by `cocosync tune eager-work` (rows of 1024 features: 16 to 2048 rows)
EAGER_SIZES = tuple(k << 10 for k in (16, 32, 64, 128, 256, 512, 1024, 2048))


def measure_eager_work(repeats: int) -> dict[str, Any]:
    """On every rank of one node: the epilogue kernel compiled (Inductor) and eager at each of EAGER_SIZES, timed
    round-robin; the slowest rank's medians (every rank returns the same rows)."""
    import torch.distributed as dist

    from cocosync.dsl import Program, Replicated, Tensor, maximum
    from cocosync.interp import rank_inputs
    from cocosync.lower import lower
    from cocosync.runtime.comm.communicators import shared_communicator
    from cocosync.runtime.executor import compile_plan
    from cocosync.tune.measure import steady_allocator
    from cocosync.tune.workloads import global_inputs

    world, rank = dist.get_world_size(), dist.get_rank()
    steady_allocator()  # fresh results reuse warm pages, as in a training loop (tune/measure.py)
    cases, stages = {}, 0
    for numel in EAGER_SIZES:
        x = Tensor("x", (numel // 1024, 1024), torch.float32, Replicated)
        b = Tensor("b", (1024,), torch.float32, Replicated)
        program = Program("epilogue", [x, b], {"out": maximum(x + b, 0.0) + x})
        plan = lower(program)
        stages = len(plan.steps[0].stages)
        args = rank_inputs(program, world, global_inputs(program, world, {}), rank)
        for form, work in (("compiled", 0), ("eager", 1 << 62)):
            fn = compile_plan(plan, kernels="inductor", eager_work=work)
            cases[(form, numel)] = lambda f=fn, a=args: f(**a)
    comm = shared_communicator()
    samples = time_interleaved(cases, repeats, warmup=2, before=comm.barrier)
    medians = torch.tensor([statistics.median(samples[k]) for k in cases], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    by = dict(zip(cases, (float(m) for m in medians)))
    rows = [{"numel": n, "compiled_s": by[("compiled", n)], "eager_s": by[("eager", n)]} for n in EAGER_SIZES]
    return {"local_ranks": comm.local_size, "stages": stages, "rows": rows}


def choose_eager_work(rows: list[dict[str, Any]], stages: int) -> int:
    """Elements x stages of the smallest size from which the compiled kernel is faster at every larger size (below
    it kernels run eagerly); past the largest size measured where it never is."""
    first = None
    for r in sorted(rows, key=lambda r: r["numel"]):
        if r["compiled_s"] < r["eager_s"]:
            first = r["numel"] if first is None else first
        else:
            first = None
    return (first if first is not None else 2 * max(r["numel"] for r in rows)) * stages


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

