"""A cost model of a plan from quantities measured on the machine: memory copy bandwidth, the per-call latency
and bandwidth of the shared-memory collectives, and matmul throughput (the bandwidths and the matmul rate, at the
program's own matmul shapes, are timed in the candidates' round-robin: measure.py). It predicts a candidate without
running it (more ranks, other sizes); the tuner reports its error against the candidates it timed.

Per plan step, with this rank's bytes (a sliced tensor counts 1/G):
* kernel with a fast (generated) form: the bytes of its inputs and of the values it hands on (updates, values
  later steps read) at copy bandwidth, one call's overhead; run stage by stage: every stage reads its operands at
  copy bandwidth and writes a freshly allocated result at the (much lower) bandwidth of new memory; a matmul
  2*m*n*k / matmul throughput;
* collective: latency + bytes a rank moves / collective bandwidth, where all_reduce moves 2(G-1)/G of its vector,
  reduce_scatter and all_gather (G-1)/G of the whole; across N nodes (L ranks each) the runtime's collectives are
  hierarchical: the shared-memory part over the L local ranks, then each rank's 1/L over the network among the N
  ranks with its local rank (gloo: its own latency and bandwidth, `inter_*`), e.g. an all_reduce adds
  inter_latency + (V/L) 2(N-1)/N / inter_bw;
* fused collective: one latency, its reduce-scatter and all-gather traffic, its computations' traffic;
* overlap by c chunks: c latencies + the longer of communication and computation + the shorter / c (a fused
  collective inside the chain computes on the communication side).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from cocosync.dsl.ir import Node
from cocosync.lower.plan import Collective, FusedCollective, Kernel, Overlap, Plan

__all__ = ["MachineModel", "predict"]

COMM_FACTOR = {"all_reduce": lambda g: 2 * (g - 1) / g, "reduce_scatter": lambda g: (g - 1) / g,
               "all_gather": lambda g: (g - 1) / g, "broadcast": lambda g: (g - 1) / g,
               "reduce": lambda g: (g - 1) / g, "send": lambda g: 1.0}


@dataclass(frozen=True)
class MachineModel:
    copy_bw: float  # bytes/s of a large memory copy
    # bytes/s of writing a freshly allocated large tensor. Whether fresh results fault their pages in depends on
    # glibc's dynamic mmap threshold (16 MB results: ~4 GB/s cold, ~55 GB/s warm), which moved unfused candidates'
    # times +-30% between runs; the tuner's ranks pin the allocator in a training loop's steady state (warm pages,
    # measure.steady_allocator) and measure this there
    alloc_bw: float
    call_s: float  # the overhead of one kernel call
    comm_latency_s: float  # a tiny all_reduce
    comm_bw: float  # bytes/s a rank moves in a large all_reduce
    matmul_flops: float  # flop/s of a float32 matmul
    world: int
    inter_latency_s: float = 0.0  # a tiny gloo all_reduce between nodes (loopback TCP when measured on one node)
    inter_bw: float = float("inf")  # bytes/s a rank moves in a large gloo all_reduce between nodes
    nodes: int = 1
    inter_rs_bw: float = float("inf")  # the same for gloo's reduce_scatter (slower than its (n-1)/n share suggests)
    inter_ag_bw: float = float("inf")  # and all_gather

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def at(self, world: int, nodes: int = 1, *, net_bw: float | None = None) -> "MachineModel":
        """The same machine model for `world` ranks on `nodes` nodes (a configuration not timed); `net_bw`
        (bytes/s) replaces the measured network bandwidth (e.g. a 25 Gb/s link instead of loopback)."""
        if nodes < 1 or world % nodes:
            raise ValueError(f"nodes={nodes} must divide world={world}")
        if net_bw is None:
            return replace(self, world=world, nodes=nodes)
        return replace(self, world=world, nodes=nodes, inter_bw=net_bw, inter_rs_bw=net_bw, inter_ag_bw=net_bw)


def _bytes(n: Node, g: int) -> float:
    numel = 1
    for d in n.shape:
        numel *= d
    size = numel * torch.empty((), dtype=n.dtype).element_size()
    return size / g if n.layout.is_sliced else size


def _group(n: Node, world: int) -> int:
    groups = n.attr("groups") or 1
    return max(1, world // groups)


def _compute(stages: tuple[Node, ...], m: MachineModel, fast: bool, handed_on: set[int]) -> float:
    inside = {id(s) for s in stages}
    seconds, read, written = 0.0, {}, 0.0
    for s in stages:
        if s.op == "matmul":
            a = s.args[0]
            k = a.shape[-1] if not a.layout.is_sliced or a.layout.dim != a.ndim - 1 else a.shape[-1] / m.world
            numel = 1
            for d in s.shape:
                numel *= d
            seconds += 2 * numel * k / (m.world if s.layout.is_sliced else 1) / m.matmul_flops
            continue
        if s.op in COMM_FACTOR or not s.ndim:
            continue
        if not fast:  # each stage: its operands read, its result in new memory
            seconds += _bytes(s, m.world) / m.alloc_bw + sum(_bytes(a, m.world) for a in s.args if a.ndim) / m.copy_bw
            continue
        if s.op == "update" or id(s) in handed_on:
            written += _bytes(s, m.world)
        for a in s.args:
            if id(a) not in inside and a.ndim:
                read[id(a)] = _bytes(a, m.world)
    return seconds + (sum(read.values()) + written) / m.copy_bw


def _comm(s: Node, m: MachineModel) -> float:
    """Seconds of communication (no latency) of one collective stage; across nodes the network part adds its own
    latency."""
    g = _group(s, m.world)
    whole = _bytes(s.args[0], m.world) * (g if s.op == "all_gather" else 1)
    factor = COMM_FACTOR.get(s.op, lambda g: 1.0)
    local = m.world // m.nodes
    if m.nodes == 1 or g <= local or s.op == "send":  # within a node (send: one hop either way)
        return whole * factor(g) / m.comm_bw
    nodes = g // local  # a group spanning nodes: shared memory over the local ranks, then 1/local across nodes
    net = {"reduce_scatter": m.inter_rs_bw, "all_gather": m.inter_ag_bw}.get(s.op, m.inter_bw)
    return whole * factor(local) / m.comm_bw + m.inter_latency_s + whole / local * factor(nodes) / net


def predict(plan: Plan, m: MachineModel, fast: list[bool] | None = None) -> float:
    """Seconds one call of `plan` takes on a rank, by the model; `fast`: which steps run in a generated form
    (CompiledPlan.runners; default: all)."""
    fast = fast if fast is not None else [True] * len(plan.steps)
    step_of = {id(s): i for i, step in enumerate(plan.steps) for s in step.stages}
    handed_on = {id(a) for i, step in enumerate(plan.steps) for s in step.stages for a in s.args
                 if step_of.get(id(a), i) != i} | {id(o) for o in plan.program.outputs}
    total = 0.0
    for step, quick in zip(plan.steps, fast):
        if isinstance(step, Kernel):
            total += m.call_s + _compute(step.stages, m, quick, handed_on)
        elif isinstance(step, Collective):
            total += m.comm_latency_s + (_comm(step.stage, m) if step.stage.op in COMM_FACTOR else 0.0)
        elif isinstance(step, FusedCollective):
            total += (m.comm_latency_s + _comm(step.rs, m) + _comm(step.ag, m)
                      + _compute(step.compute, m, quick, handed_on))
        elif isinstance(step, Overlap):  # a fused collective inside computes on the communication side
            fused = {id(s) for i in step.inner if isinstance(i, FusedCollective) for s in i.compute}
            comm = sum(_comm(s, m) for s in step.stages if s.op in COMM_FACTOR) + _compute(
                tuple(s for s in step.stages if id(s) in fused), m, quick, handed_on)
            work = _compute(tuple(s for s in step.stages if s.op not in COMM_FACTOR and id(s) not in fused), m,
                            quick, handed_on)
            total += step.chunks * (m.comm_latency_s + m.call_s) + max(comm, work) + min(comm, work) / step.chunks
    return total
