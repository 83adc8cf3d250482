"""Tensor-parallel linear layers (Megatron-LM) whose forward runs a compiled DSL plan.

Weights use the DSL's orientation, `y = x @ W` with W of shape (in_features, out_features) (the transpose of
`nn.Linear.weight`):

- ColumnParallelLinear: each rank holds W[:, cols of rank] and b[cols of rank]; the input is Replicated, the output
  is this rank's column slice (Sliced(1)); program `x @ w + b` (no communication; `gather_output=True` adds an
  all_gather). Backward: dX partials are all-reduced (Megatron's "f" operator), dW = x^T dY, db = sum(dY).
- RowParallelLinear: each rank holds W[rows of rank, :] and the whole bias; the input is this rank's column slice
  (the output of a ColumnParallelLinear); program `all_reduce(x @ w) + b`, scheduled like the paper's Megatron
  layer (split the all_reduce, bias on slices, all_gather; overlapped by chunks). The forward all_reduce has an
  identity backward ("g" operator).

Forward: the compiled plan (one per input row count and dtype, built on first use). Backward: plain torch ops plus
the plan's communicator (`plan.comm`, shared memory on one node), not a DSL program: the DSL has no transpose, and
the backward of these layers is two matmuls and at most one all_reduce.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from cocosync.dsl import Program, Replicated, Sliced, Tensor, all_gather, all_reduce
from cocosync.dsl.types import ReduceOp

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "group_info", "PlanCache", "tp_schedule"]


def group_info(group: dist.ProcessGroup | None, what: str) -> tuple[int, int]:
    """(rank, world size) of this process in `group`; a clear error when torch.distributed is not set up."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what}: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first (torchrun / cocosync RankPool set it up)")
    return dist.get_rank(group), dist.get_world_size(group)


def check_divisible(what: str, name: str, value: int, world: int) -> None:
    if value <= 0 or value % world:
        raise ValueError(f"{what}: {name}={value} must be a positive multiple of the tensor-parallel world size "
                         f"{world}")


def tp_schedule(program: Program, chunks: int, rows: int, world: int):
    """The schedule of `... matmul -> all_reduce -> elementwise epilogue` for `chunks` overlap chunks.

    chunks > 1: the paper's Megatron schedule: split the all_reduce into reduce_scatter + all_gather (over rows),
    move the epilogue onto the slices, and overlap matmul -> RS -> epilogue -> AG by column chunks.
    chunks = 1 (no overlap): the all_reduce stays whole when the shared-memory runtime reduces it one-shot (one
    barrier; see ShmCommunicator's one_shot_bytes), which measured faster than two collectives with the epilogue on
    slices between them; larger ones are split (the epilogue then runs on 1/world of the rows).
    When `rows` is not divisible by `world` the all_reduce stays whole (a Schedule with no directives)."""
    from cocosync.runtime.comm.collectives import DEFAULT_ONE_SHOT_BYTES
    from cocosync.runtime.comm.tuned import tuned
    from cocosync.schedule import Schedule

    s = Schedule(program)
    if rows % world:
        return s
    ar = program.stage(next(st.name for st in program.stages if st.op == "all_reduce"))
    one_shot = tuned("one_shot_bytes", world, DEFAULT_ONE_SHOT_BYTES)  # the communicator's threshold
    if chunks == 1 and ar.dtype.itemsize * torch.Size(ar.shape).numel() * (world - 1) <= one_shot:
        return s
    producer = ar.args[0].name
    rs, ag = s.split(ar.name)
    movable = s.movable(ag)
    if movable:
        s.reorder(movable, ag)
    if chunks > 1:
        chain = s.chain(rs)
        if chain is not None:
            s.overlap([producer, *chain], chunks=chunks)
    return s


def check_dropout(what: str, p: float, seed: int) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{what}: p={p} must be in [0, 1)")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"{what}: seed={seed!r} must be a non-negative int")


def scaled_keep_mask(shape: tuple[int, ...], p: float, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """DSL dropout(p, seed)'s keep-mask / (1 - p), as `dtype`: the modules multiply by it (one plan per shape).
    Built in place on the uniform draw (compare, scale): two passes instead of four, no bool temporary."""
    from cocosync.interp import dropout_uniform

    u = dropout_uniform(shape, seed).ge_(p)  # 1.0 where kept, 0.0 where dropped
    return (u if dtype == torch.float32 else u.to(dtype)).div_(1.0 - p)


def check_chunks(what: str, chunks: int | str | None) -> None:
    if chunks is not None and chunks != "auto" and (not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"{what}: chunks={chunks!r} must be an int >= 1, None (1 on CPU, 2 on GPU) or 'auto' "
                         "(measured per input shape, nn/auto_chunks.py)")


def resolve_chunks(chunks: int | None, device_type: str) -> int:
    """Overlap chunks for inputs on `device_type`; chunks=None picks 2 (the paper's overlap) where communication
    has its own engine (GPUs), 1 on CPU, where the communication costs the same cores the compute needs and
    overlapping measured slower (BENCHMARKS.md, tp and pp)."""
    return chunks if chunks is not None else (1 if device_type == "cpu" else 2)


class PlanCache:
    """Compiled plans of one layer, keyed by a hashable key (rows, dtype, ...) and the inputs' device type, built on
    first use by `build(key, chunks) -> Schedule` (chunks: `resolve_chunks(chunks, device type)`) and compiled for
    `group`. Keeps the `size` most recently used."""

    def __init__(self, build: Callable[[Any, int], Any], group: dist.ProcessGroup | None, *,
                 chunks: int | None = 1, backend: str | None = None, kernels: str | None = None, size: int = 8,
                 rank: int | None = None, world: int | None = None):
        self.build, self.group, self.backend, self.kernels, self.size = build, group, backend, kernels, size
        self.chunks = chunks
        self.rank, self.world = rank, world  # what the layer's shards were cut for (checked against the group)
        self.plans: dict[Any, Any] = {}
        self.chosen: dict[Any, tuple[int, dict[int, float]]] = {}  # chunks="auto": key -> (chunks, medians)

    def get(self, key: tuple, device: torch.device | str = "cpu"):
        from cocosync import compile_plan, lower

        dev = torch.device(device).type
        key = (*key, dev)
        plan = self.plans.pop(key, None)
        if plan is None:
            def compile_for(c: int):
                return compile_plan(lower(self.build(key[:-1], c)), self.group, backend=self.backend,
                                    kernels=self.kernels)
            if self.chunks == "auto":
                from cocosync.nn.auto_chunks import choose_chunks

                c, plan, medians = choose_chunks(compile_for, self.group)
                self.chosen[key] = (c, medians)
            else:
                plan = compile_for(resolve_chunks(self.chunks, dev))
            if self.world is not None and (plan.comm.group_size, plan.comm.group_rank) != (self.world, self.rank):
                raise ValueError(f"the layer's shards were cut for rank {self.rank} of {self.world}, but this process "
                                 f"is rank {plan.comm.group_rank} of {plan.comm.group_size} in its group; "
                                 "pass the group's rank "
                                 "and size to from_dense (or leave rank/world out)")
            while len(self.plans) >= self.size:
                self.plans.pop(next(iter(self.plans)))
        self.plans[key] = plan  # most recent last
        return plan


def _check_input(what: str, x: torch.Tensor, features: int, weight: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: input must be a tensor, got {type(x).__name__}")
    if x.ndim < 1 or x.shape[-1] != features:
        raise ValueError(f"{what}: input of shape {tuple(x.shape)} must end with this rank's {features} features")
    if x.dtype != weight.dtype:
        raise ValueError(f"{what}: input dtype {x.dtype} differs from the weight's {weight.dtype}; cast one of them")
    if x.device != weight.device:
        raise ValueError(f"{what}: input is on {x.device}, the weight on {weight.device}")


def init_weight(w: torch.Tensor, fan_in: int) -> None:
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        w.uniform_(-bound, bound)


# ---- ColumnParallelLinear ---------------------------------------------------------------------------------------
def column_program(rows: int, in_features: int, out_features: int, dtype: torch.dtype, bias: bool,
                   gather: bool) -> Program:
    """y = x @ w (+ b): x Replicated, w column-sliced -> y Sliced(1) (all-gathered to Replicated if `gather`)."""
    x = Tensor("x", (rows, in_features), dtype, Replicated)
    w = Tensor("w", (in_features, out_features), dtype, Sliced(1))
    inputs, y = [x, w], x @ w
    if bias:
        b = Tensor("b", (out_features,), dtype, Sliced(0))
        inputs.append(b)
        y = y + b
    if gather:
        y = all_gather(y)
    return Program("column_parallel_linear", inputs, {"y": y})


class _ColumnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, layer):  # x2: (rows, in) Replicated
        plan = layer._plans.get((x2.shape[0], x2.dtype), x2.device)
        inputs = {"x": x2.detach(), "w": weight.detach()}
        if bias is not None:
            inputs["b"] = bias.detach()
        y = plan(**inputs)["y"]
        ctx.save_for_backward(x2, weight)
        ctx.plan, ctx.has_bias, ctx.gather = plan, bias is not None, layer.gather_output
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        comm = ctx.plan.comm
        if ctx.gather:  # the all_gather's backward: this rank's columns (dY is the same on every rank)
            dy = comm.part(dy, 1)
        dy = dy.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = comm.all_reduce(dy @ weight.t(), ReduceOp.SUM)  # each rank holds a partial sum over its columns
        dw = x2.t() @ dy if ctx.needs_input_grad[1] else None
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


class ColumnParallelLinear(nn.Module):
    """y = x @ W + b with W (in_features, out_features) split by columns over the ranks of `group`.

    Input: (..., in_features), the same on every rank. Output: (..., out_features / world), this rank's columns, or
    (..., out_features) with gather_output=True. Parameters: weight (in_features, out_features / world), bias
    (out_features / world,)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, gather_output: bool = False,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.float32,
                 backend: str | None = None, kernels: str | None = None, rank: int | None = None,
                 world: int | None = None):
        super().__init__()
        if rank is None or world is None:
            rank, world = group_info(group, type(self).__name__)
        check_divisible(type(self).__name__, "out_features", out_features, world)
        self.in_features, self.out_features, self.world, self.rank = in_features, out_features, world, rank
        self.gather_output, self.group = gather_output, group
        self.weight = nn.Parameter(torch.empty(in_features, out_features // world, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features // world, dtype=dtype)) if bias else None
        init_weight(self.weight, in_features)
        self._plans = PlanCache(lambda key, _: _schedule_plain(column_program(
            key[0], in_features, out_features, key[1], bias, gather_output)), group, backend=backend, kernels=kernels,
            rank=rank, world=world)

    @classmethod
    def from_dense(cls, linear: nn.Linear, rank: int, world: int, **kwargs: Any) -> "ColumnParallelLinear":
        """This rank's shard of `linear` (weight (out, in)): columns rank*out/world ... of W = linear.weight.T."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, rank=rank, world=world,
                    dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.t().chunk(world, 1)[rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.chunk(world, 0)[rank])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(type(self).__name__, x, self.in_features, self.weight)
        lead = x.shape[:-1]
        y = _ColumnFn.apply(x.reshape(-1, self.in_features), self.weight, self.bias, self)
        return y.reshape(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank: "
                f"{self.out_features // self.world}), bias={self.bias is not None}, gather_output={self.gather_output}")


def _schedule_plain(program: Program):
    from cocosync.schedule import Schedule

    return Schedule(program)


# ---- RowParallelLinear ------------------------------------------------------------------------------------------
def row_program(rows: int, in_features: int, out_features: int, dtype: torch.dtype, bias: bool) -> Program:
    """z = all_reduce(x @ w) (+ b): x and w sliced along the contracted dim give Local partial sums."""
    x = Tensor("x", (rows, in_features), dtype, Sliced(1))
    w = Tensor("w", (in_features, out_features), dtype, Sliced(0))
    inputs, z = [x, w], all_reduce(x @ w)
    if bias:
        b = Tensor("b", (out_features,), dtype, Replicated)
        inputs.append(b)
        z = z + b
    return Program("row_parallel_linear", inputs, {"z": z})


class _RowFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, layer):  # x2: (rows, in / world), this rank's columns of the input
        plan = layer._plans.get((x2.shape[0], x2.dtype), x2.device)
        inputs = {"x": x2.detach(), "w": weight.detach()}
        if bias is not None:
            inputs["b"] = bias.detach()
        z = plan(**inputs)["z"]
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return z

    @staticmethod
    def backward(ctx, dz):  # the all_reduce's backward is the identity: dZ is the same on every rank
        x2, weight = ctx.saved_tensors
        dz = dz.contiguous()
        dx = dz @ weight.t() if ctx.needs_input_grad[0] else None
        dw = x2.t() @ dz if ctx.needs_input_grad[1] else None
        db = dz.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


class RowParallelLinear(nn.Module):
    """z = x @ W + b with W (in_features, out_features) split by rows over the ranks of `group`.

    Input: (..., in_features / world), this rank's slice of the features (e.g. a ColumnParallelLinear's output).
    Output: (..., out_features), the same on every rank. Parameters: weight (in_features / world, out_features),
    bias (out_features,) (replicated). chunks: overlap chunks of the Megatron schedule (1: no overlap step; None,
    the default: 1 for CPU inputs, 2 on GPUs, see resolve_chunks; 'auto':
    measured per input shape, nn/auto_chunks.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, chunks: int | None = None,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.float32,
                 backend: str | None = None, kernels: str | None = None, rank: int | None = None,
                 world: int | None = None):
        super().__init__()
        if rank is None or world is None:
            rank, world = group_info(group, type(self).__name__)
        check_divisible(type(self).__name__, "in_features", in_features, world)
        check_chunks(type(self).__name__, chunks)
        self.in_features, self.out_features, self.world, self.rank = in_features, out_features, world, rank
        self.chunks, self.group = chunks, group
        self.weight = nn.Parameter(torch.empty(in_features // world, out_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        init_weight(self.weight, in_features)
        self._plans = PlanCache(lambda key, c: tp_schedule(row_program(key[0], in_features, out_features, key[1], bias),
                                                           c, key[0], world), group, chunks=chunks, backend=backend,
                                kernels=kernels, rank=rank, world=world)

    @classmethod
    def from_dense(cls, linear: nn.Linear, rank: int, world: int, **kwargs: Any) -> "RowParallelLinear":
        """This rank's shard of `linear`: rows rank*in/world ... of W = linear.weight.T, and the whole bias."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, rank=rank, world=world,
                    dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.t().chunk(world, 0)[rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(type(self).__name__, x, self.in_features // self.world, self.weight)
        lead = x.shape[:-1]
        z = _RowFn.apply(x.reshape(-1, x.shape[-1]), self.weight, self.bias, self)
        return z.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.in_features // self.world}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, chunks={self.chunks}")
