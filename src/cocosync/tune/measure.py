"""What runs on every rank of a tuning job: the machine model's measurements, then each candidate compiled and
timed round-robin (the same shuffled order on every rank, since they are collectives), medians returned."""

from __future__ import annotations

import ctypes
import ctypes.util
import statistics
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from cocosync.dsl.types import local_shape_of
from cocosync.lower import lower
from cocosync.reduce_op import ReduceOp
from cocosync.runtime.comm.communicators import shared_communicator
from cocosync.runtime.executor import compile_plan
from cocosync.schedule.schedule import replay
from cocosync.timing import copy_bandwidth, time_calls, time_interleaved
from cocosync.tune.cost import MachineModel
from cocosync.tune.workloads import global_inputs, local_inputs, workload

__all__ = ["measure_machine", "time_candidates"]


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def steady_allocator() -> bool:
    """Pin glibc's allocator in the state a training loop settles in: blocks up to 32 MB (glibc's largest mmap
    threshold) come from the heap and freed memory stays mapped, so a fresh result reuses warm pages. Left to itself
    glibc moves its mmap threshold as blocks are freed, and whether a fresh 16 MB result faults its pages in (~4 GB/s
    here, against ~55 GB/s warm) then depends on what ran before: unfused candidates moved +-30% between runs.
    False where the C library has no mallopt (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def _median(fn, n: int) -> float:
    return statistics.median(time_calls(fn, n, warmup=0))


def measure_machine() -> MachineModel:
    """Collective on every rank: copy bandwidth, kernel call overhead, shared-memory all_reduce latency and
    bandwidth, matmul throughput."""
    comm = shared_communicator()
    world = dist.get_world_size()
    bw = copy_bandwidth(32 << 20, repeats=5, before=comm.barrier)
    # a stage run alone: two 16 MB operands read, a fresh result written (in steady_allocator's state, warm pages
    # once the heap has grown); the result's share of the time gives the bandwidth of writing fresh memory
    x, y = torch.rand(4 << 20), torch.rand(4 << 20)
    for _ in range(3):
        torch.add(x, y)
    fresh = x.numel() * 4
    alloc_bw = fresh / max(_median(lambda: torch.add(x, y), 11) - 2 * fresh / bw, fresh / bw)
    a, b = torch.ones(64), torch.ones(64)
    call = _median(lambda: torch.add(a, b, out=a), 200)
    tiny = torch.ones(1)
    comm.barrier()
    latency = _median(lambda: comm.all_reduce(tiny, ReduceOp.SUM), 200)
    big = torch.ones(4 << 20)  # 16 MB
    comm.barrier()
    t_big = _median(lambda: comm.all_reduce(big, ReduceOp.SUM), 11)
    comm_bw = big.numel() * 4 * 2 * (world - 1) / world / max(t_big - latency, 1e-9)
    x = torch.rand(512, 512)
    flops = 2 * 512**3 / _median(lambda: x @ x, 10)
    net = _network(comm)
    values = torch.tensor([bw, alloc_bw, call, latency, comm_bw, flops, *net], dtype=torch.float64)
    dist.all_reduce(values)  # one model for all ranks: their mean
    values /= world
    *local, inter_latency, inter_bw, rs_bw, ag_bw = [float(v) for v in values]
    return MachineModel(*local, world=world, inter_latency_s=inter_latency, inter_bw=inter_bw, nodes=comm.nnodes,
                        inter_rs_bw=rs_bw, inter_ag_bw=ag_bw)


def _network(comm) -> tuple[float, float, float, float]:
    """Latency, and bandwidth (bytes a rank moves per second, by the ideal (n-1)/n share) of gloo's all_reduce,
    reduce_scatter and all_gather among the ranks that talk across nodes (the runtime's inter-node group and calls;
    on one node the world group over loopback, the stand-in for a network this host cannot show)."""
    from cocosync.runtime.comm.collectives import all_gather_single, reduce_scatter_single

    group = comm.groups.inter if comm.nnodes > 1 else None
    n = dist.get_world_size(group)
    tiny, big = torch.ones(1), torch.ones(4 << 20)  # 16 MB, the size the built-in workloads move
    part = torch.empty(big.numel() // n)

    def rs():
        try:
            reduce_scatter_single(part, big, group=group)
        except (RuntimeError, NotImplementedError):  # as the runtime falls back
            dist.all_reduce(big.clone(), group=group)

    def ag():
        try:
            all_gather_single(big, part, group=group)
        except (RuntimeError, NotImplementedError):
            dist.all_gather(list(big.view(n, -1).unbind(0)), part, group=group)

    dist.barrier()
    latency = _median(lambda: dist.all_reduce(tiny, group=group), 50)
    out = [latency]
    for fn, factor in ((lambda: dist.all_reduce(big, group=group), 2), (rs, 1), (ag, 1)):
        dist.barrier()
        t = _median(fn, 3)
        out.append(big.numel() * 4 * factor * (n - 1) / n / max(t - latency, 1e-9))
    return tuple(out)


def _probes(program, world: int) -> dict[str, tuple[Any, float]]:
    """Cases timed in the candidates' round-robin, so that the machine's drift during a run (copy bandwidth moved
    1.5-2.4e10 B/s between runs here) hits the model's inputs and the candidates alike: name -> (call, the work one
    call does: bytes moved, or flop for the program's own matmuls at this rank's shapes)."""
    comm = shared_communicator()
    src, dst = torch.ones(8 << 20), torch.empty(8 << 20)  # 32 MB
    x, y = torch.rand(4 << 20), torch.rand(4 << 20)  # 16 MB
    big = torch.ones(4 << 20)
    out = {"copy": (lambda: dst.copy_(src), 2 * src.numel() * 4.0),
           "fresh": (lambda: torch.add(x, y), x.numel() * 4.0),
           "all_reduce": (lambda: comm.all_reduce(big, ReduceOp.SUM), big.numel() * 4 * 2 * (world - 1) / world)}
    mats = []
    for n in program.stages:
        if n.op == "matmul":
            a, b = (torch.rand(local_shape_of(t.shape, t.layout, world), dtype=t.dtype) for t in n.args)
            mats.append((a, b, 2.0 * (a @ b).numel() * a.shape[-1]))
    if mats:
        out["matmul"] = (lambda: [a @ b for a, b, _ in mats], sum(f for *_, f in mats))
    return out


def _from_probes(model: MachineModel, medians: dict[str, float], work: dict[str, float]) -> MachineModel:
    """The machine model with the round-robin's copy, fresh-write, all_reduce and matmul rates (mean over ranks)."""
    copy_bw = work["copy"] / medians["copy"]
    fresh = work["fresh"]  # two operands read, the result written to fresh memory
    alloc_bw = fresh / max(medians["fresh"] - 2 * fresh / copy_bw, fresh / copy_bw)
    comm_bw = work["all_reduce"] / max(medians["all_reduce"] - model.comm_latency_s, 1e-9)
    flops = work["matmul"] / medians["matmul"] if "matmul" in medians else model.matmul_flops
    values = torch.tensor([copy_bw, alloc_bw, comm_bw, flops], dtype=torch.float64)
    dist.all_reduce(values)
    values /= dist.get_world_size()
    copy_bw, alloc_bw, comm_bw, flops = (float(v) for v in values)
    return replace(model, copy_bw=copy_bw, alloc_bw=alloc_bw, comm_bw=comm_bw, matmul_flops=flops)


def time_candidates(source: str, directives: list[tuple], repeats: int) -> dict[str, Any]:
    """On every rank: the workload `source`'s program under each directive list, timed round-robin together with the
    machine model's probes; the medians (s) and the machine model. Rank 0's numbers are what the tuner reports."""
    work = workload(source)
    program = work.build()
    world, rank = dist.get_world_size(), dist.get_rank()
    steady_allocator()
    model = measure_machine()
    inputs = global_inputs(program, world, work.scalars)
    cases: dict[Any, Any] = {}
    fast = []
    for i, ds in enumerate(directives):
        scheduled = replay(program, ds)
        fn = compile_plan(lower(scheduled), None)
        fast.append([r is not None for r in fn.runners])
        args = local_inputs(scheduled, world, inputs, rank)
        cases[i] = (lambda f=fn, a=args: f(**a))
    probes = _probes(program, world)
    cases |= {name: call for name, (call, _) in probes.items()}
    comm = shared_communicator()
    samples = time_interleaved(cases, repeats, warmup=2, before=comm.barrier)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    model = _from_probes(model, {k: medians[k] for k in probes}, {k: w for k, (_, w) in probes.items()})
    return {"medians": [medians[i] for i in range(len(directives))], "model": model, "fast": fast}
