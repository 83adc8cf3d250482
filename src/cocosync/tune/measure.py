"""What runs on every rank of a tuning job: the machine model's measurements, then each candidate compiled and
timed round-robin (the same shuffled order on every rank, since they are collectives), medians returned."""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from cocosync.bench.common import copy_bandwidth, time_calls, time_interleaved
from cocosync.lower import lower
from cocosync.reduce_op import ReduceOp
from cocosync.runtime.comm.communicators import shared_communicator
from cocosync.runtime.executor import compile_plan
from cocosync.schedule.schedule import replay
from cocosync.tune.cost import MachineModel
from cocosync.tune.workloads import global_inputs, local_inputs, workload

__all__ = ["measure_machine", "time_candidates"]


def _median(fn, n: int) -> float:
    return statistics.median(time_calls(fn, n, warmup=0))


def measure_machine() -> MachineModel:
    """Collective on every rank: copy bandwidth, kernel call overhead, shared-memory all_reduce latency and
    bandwidth, matmul throughput."""
    comm = shared_communicator()
    world = dist.get_world_size()
    bw = copy_bandwidth(32 << 20, repeats=5, before=comm.barrier)
    fresh = 32 << 20
    alloc_bw = fresh / _median(lambda: torch.empty(fresh // 4).fill_(1.0), 5)
    a, b = torch.ones(64), torch.ones(64)
    call = _median(lambda: torch.add(a, b, out=a), 200)
    tiny = torch.ones(1)
    comm.barrier()
    latency = _median(lambda: comm.all_reduce(tiny, ReduceOp.SUM), 200)
    big = torch.ones(4 << 20)  # 16 MB
    comm.barrier()
    t_big = _median(lambda: comm.all_reduce(big, ReduceOp.SUM), 5)
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


def time_candidates(source: str, directives: list[tuple], repeats: int) -> dict[str, Any]:
    """On every rank: the workload `source`'s program under each directive list, timed round-robin; the medians (s)
    and the machine model. Rank 0's numbers are what the tuner reports."""
    work = workload(source)
    program = work.build()
    world, rank = dist.get_world_size(), dist.get_rank()
    model = measure_machine()
    inputs = global_inputs(program, world, work.scalars)
    cases, fast = {}, []
    for i, ds in enumerate(directives):
        scheduled = replay(program, ds)
        fn = compile_plan(lower(scheduled), None)
        fast.append([r is not None for r in fn.runners])
        args = local_inputs(scheduled, world, inputs, rank)
        cases[i] = (lambda f=fn, a=args: f(**a))
    comm = shared_communicator()
    samples = time_interleaved(cases, repeats, warmup=2, before=comm.barrier)
    return {"medians": [statistics.median(samples[i]) for i in range(len(directives))], "model": model,
            "fast": fast}
