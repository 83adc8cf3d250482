"""MegatronMLP: the Megatron-LM MLP block, its forward one compiled DSL plan with the paper's schedule.

    out = dropout(all_reduce(relu(x @ w1 + b1) @ w2) + b2) + x       (w1, b1 column-sliced, w2 row-sliced)

The program (`mlp_program`) writes dropout as a multiplication by a keep-mask input scaled by 1/(1-p): the mask of
call i is `interp.dropout_mask(shape, p, seed + i)`, so the result is exactly the DSL's `dropout(., p, seed + i)`
while one compiled plan serves every call (a DSL dropout bakes its seed into the program, and the mask multiply
stays an ordinary elementwise stage that fuses into the epilogue). The schedule is the paper's Megatron schedule
(`parallel.tp_schedule`): all_reduce -> reduce_scatter + all_gather, bias + dropout + residual on the slices,
matmul -> RS -> epilogue -> AG overlapped by column chunks.

Backward: a second DSL program (`mlp_backward_program`) with the same schedule; its inputs are the transposed views
x^T, h^T, W1^T, W2^T (the DSL has no transpose op). dZ = dOut * mask, the all_reduce's backward is the identity,
dW2 = h^T dZ, dh = relu'(h) * (dZ W2^T), dW1 = x^T dh, and dX = all_reduce(dh W1^T) + dOut: Megatron's "f"
all_reduce of the dX partials, split into reduce_scatter -> + dOut on slices -> all_gather and overlapped with the
last matmul, like the forward's. db1 = sum(dh), db2 = sum(dZ) are torch row sums (the DSL reduces whole tensors
only). `h` (this rank's activation slice) is a second output of the forward plan.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cocosync.dsl import Program, Replicated, Sliced, Tensor, all_reduce, gt, where
from cocosync.nn.parallel import (
    PlanCache,
    check_chunks,
    check_divisible,
    check_dropout,
    group_info,
    init_weight,
    scaled_keep_mask,
    tp_schedule,
)

__all__ = ["MegatronMLP", "mlp_program", "mlp_backward_program"]


def mlp_program(rows: int, hidden: int, ffn: int, dtype: torch.dtype = torch.float32, *, dropout: bool = True,
                bias: bool = True) -> Program:
    """The block on (rows, hidden) inputs; with `dropout`, input `mask` (rows, hidden) holds keep / (1 - p)."""
    x = Tensor("x", (rows, hidden), dtype, Replicated)
    w1 = Tensor("w1", (hidden, ffn), dtype, Sliced(1))
    w2 = Tensor("w2", (ffn, hidden), dtype, Sliced(0))
    inputs = [x, w1, w2]
    a = x @ w1
    if bias:
        b1 = Tensor("b1", (ffn,), dtype, Sliced(0))
        inputs.append(b1)
        a = a + b1
    h = where(gt(a, 0.0), a, 0.0)  # relu
    z = all_reduce(h @ w2)
    if bias:
        b2 = Tensor("b2", (hidden,), dtype, Replicated)
        inputs.append(b2)
        z = z + b2
    if dropout:
        mask = Tensor("mask", (rows, hidden), dtype, Replicated)
        inputs.append(mask)
        z = z * mask
    return Program("megatron_mlp_block", inputs, {"out": z + x, "h": h})


def mlp_backward_program(rows: int, hidden: int, ffn: int, dtype: torch.dtype = torch.float32, *,
                         dropout: bool = True) -> Program:
    """Gradients of `mlp_program` given dOut (the same on every rank); see the module docstring."""
    dout = Tensor("dout", (rows, hidden), dtype, Replicated)
    x_t = Tensor("x_t", (hidden, rows), dtype, Replicated)
    h = Tensor("h", (rows, ffn), dtype, Sliced(1))
    h_t = Tensor("h_t", (ffn, rows), dtype, Sliced(0))
    w1_t = Tensor("w1_t", (ffn, hidden), dtype, Sliced(0))
    w2_t = Tensor("w2_t", (hidden, ffn), dtype, Sliced(1))
    inputs, dz = [dout, x_t, h, h_t, w1_t, w2_t], dout
    if dropout:
        mask = Tensor("mask", (rows, hidden), dtype, Replicated)
        inputs.append(mask)
        dz = dout * mask
    dh = where(gt(h, 0.0), dz @ w2_t, 0.0)
    dx = all_reduce(dh @ w1_t) + dout
    return Program("megatron_mlp_block_backward", inputs, {"dx": dx, "dw1": x_t @ dh, "dw2": h_t @ dz, "dh": dh,
                                                           "dz": dz})


class _MLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w1, b1, w2, b2, mask, block):
        plan = block._plans.get((x2.shape[0], x2.dtype, mask is not None), x2.device)
        inputs = {"x": x2.detach(), "w1": w1.detach(), "w2": w2.detach()}
        if b1 is not None:
            inputs.update(b1=b1.detach(), b2=b2.detach())
        if mask is not None:
            inputs["mask"] = mask
        res = plan(**inputs)
        ctx.save_for_backward(x2, w1, w2, res["h"], mask)
        ctx.block, ctx.has_bias = block, b1 is not None
        return res["out"]

    @staticmethod
    def backward(ctx, dout):
        x2, w1, w2, h, mask = ctx.saved_tensors
        plan = ctx.block._backward_plans.get((x2.shape[0], x2.dtype, mask is not None), x2.device)
        inputs = {"dout": dout.contiguous(), "x_t": x2.t(), "h": h, "h_t": h.t(), "w1_t": w1.detach().t(),
                  "w2_t": w2.detach().t()}
        if mask is not None:
            inputs["mask"] = mask
        g = plan(**inputs)
        db1 = g["dh"].sum(0) if ctx.has_bias else None
        db2 = g["dz"].sum(0) if ctx.has_bias else None
        return g["dx"], g["dw1"], db1, g["dw2"], db2, None, None


class MegatronMLP(nn.Module):
    """The Megatron MLP block with residual: out = dropout(relu(x W1 + b1) W2 + b2, p) + x, tensor-parallel over
    the ranks of `group` (W1 by columns, W2 by rows), its forward one compiled plan per input row count.

    Input/output: (..., hidden), the same on every rank. Parameters: w1 (hidden, ffn / world), b1 (ffn / world,),
    w2 (ffn / world, hidden), b2 (hidden,) (replicated). Dropout draws a new mask per training call (seed + call
    index, identical on every rank); in eval mode, or with p=0, it is skipped. chunks: overlap chunks (1: none;
    None, the default: 1 for CPU inputs, 2 on GPUs, see nn.parallel.resolve_chunks;
    'auto': measured per input shape, nn/auto_chunks.py)."""

    def __init__(self, hidden: int, ffn: int, *, p: float = 0.1, seed: int = 0, bias: bool = True,
                 chunks: int | None = None,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.float32,
                 backend: str | None = None, kernels: str | None = None, rank: int | None = None,
                 world: int | None = None):
        super().__init__()
        if rank is None or world is None:
            rank, world = group_info(group, type(self).__name__)
        check_divisible(type(self).__name__, "ffn", ffn, world)
        check_dropout("MegatronMLP", p, seed)
        check_chunks("MegatronMLP", chunks)
        self.hidden, self.ffn, self.p, self.seed, self.chunks = hidden, ffn, p, seed, chunks
        self.rank, self.world, self.group = rank, world, group
        self.calls = 0  # training calls so far: call i uses the mask of seed + i
        self.w1 = nn.Parameter(torch.empty(hidden, ffn // world, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(ffn // world, hidden, dtype=dtype))
        self.b1 = nn.Parameter(torch.zeros(ffn // world, dtype=dtype)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(hidden, dtype=dtype)) if bias else None
        init_weight(self.w1, hidden)
        init_weight(self.w2, ffn)
        self._plans = PlanCache(lambda key, c: tp_schedule(mlp_program(key[0], hidden, ffn, key[1], dropout=key[2],
                                                                       bias=bias), c, key[0], world),
                                group, chunks=chunks, backend=backend, kernels=kernels, rank=rank, world=world)
        self._backward_plans = PlanCache(lambda key, c: tp_schedule(mlp_backward_program(
            key[0], hidden, ffn, key[1], dropout=key[2]), c, key[0], world), group, chunks=chunks, backend=backend,
            kernels=kernels, rank=rank, world=world)

    @classmethod
    def from_dense(cls, fc1: nn.Linear, fc2: nn.Linear, rank: int, world: int, **kwargs: Any) -> "MegatronMLP":
        """This rank's shard of the dense block relu(fc1(x)) -> fc2 (fc1: hidden -> ffn, fc2: ffn -> hidden)."""
        if fc2.in_features != fc1.out_features or fc2.out_features != fc1.in_features:
            raise ValueError(f"MegatronMLP.from_dense: fc1 {fc1.in_features}->{fc1.out_features} and fc2 "
                             f"{fc2.in_features}->{fc2.out_features} do not form hidden->ffn->hidden")
        if (fc1.bias is None) != (fc2.bias is None):
            raise ValueError("MegatronMLP.from_dense: fc1 and fc2 must both have a bias or both have none")
        block = cls(fc1.in_features, fc1.out_features, bias=fc1.bias is not None, rank=rank, world=world,
                    dtype=fc1.weight.dtype, **kwargs)
        with torch.no_grad():
            block.w1.copy_(fc1.weight.t().chunk(world, 1)[rank])
            block.w2.copy_(fc2.weight.t().chunk(world, 0)[rank])
            if fc1.bias is not None:
                block.b1.copy_(fc1.bias.chunk(world, 0)[rank])
                block.b2.copy_(fc2.bias)
        return block

    def mask(self, shape: tuple[int, ...], call: int, dtype: torch.dtype) -> torch.Tensor:
        """The scaled keep-mask of training call `call`: DSL dropout(p, seed + call)'s mask / (1 - p)."""
        return scaled_keep_mask(shape, self.p, self.seed + call, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MegatronMLP: input must be a tensor, got {type(x).__name__}")
        if x.ndim < 1 or x.shape[-1] != self.hidden:
            raise ValueError(f"MegatronMLP: input of shape {tuple(x.shape)} must end with hidden={self.hidden}")
        if x.dtype != self.w1.dtype or x.device != self.w1.device:
            raise ValueError(f"MegatronMLP: input is {x.dtype} on {x.device}; the parameters are {self.w1.dtype} on "
                             f"{self.w1.device}")
        x2 = x.reshape(-1, self.hidden)
        mask = None
        if self.training and self.p > 0:
            mask = self.mask(tuple(x2.shape), self.calls, x.dtype)
            self.calls += 1
        out = _MLPFn.apply(x2, self.w1, self.b1, self.w2, self.b2, mask, self)
        return out.reshape(x.shape)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, ffn={self.ffn} (this rank: {self.ffn // self.world}), p={self.p}, "
                f"seed={self.seed}, chunks={self.chunks}")
