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
    values = torch.tensor([bw, alloc_bw, call, latency, comm_bw, flops], dtype=torch.float64)
    dist.all_reduce(values)  # one model for all ranks: their mean
    values /= world
    return MachineModel(*[float(v) for v in values], world=world)


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
