"""Model-parallel workloads of the CoCoNeT paper: a Megatron-LM MLP layer and a pipeline stage boundary."""

from __future__ import annotations

import torch

from cocosync.dsl import Local, Program, Replicated, Sliced, Tensor, all_reduce, dropout, float32, maximum, send


def megatron_mlp_program(batch: int, hidden: int, ffn: int, *, p: float = 0.1, seed: int = 0,
                         dtype: torch.dtype = float32) -> Program:
    """out = dropout(all_reduce(relu(x @ w1) @ w2) + b) + x, with w1 column-sliced and w2 row-sliced (Megatron):
    the second matmul gives Local partial sums, the all_reduce adds them."""
    x = Tensor("x", (batch, hidden), dtype, Replicated)
    w1 = Tensor("w1", (hidden, ffn), dtype, Sliced(1))
    w2 = Tensor("w2", (ffn, hidden), dtype, Sliced(0))
    b = Tensor("b", (hidden,), dtype, Replicated)
    h = maximum(x @ w1, 0.0)
    z = all_reduce(h @ w2)
    out = dropout(z + b, p, seed) + x
    return Program("megatron_mlp", [x, w1, w2, b], {"out": out})


def pipeline_program(batch: int, hidden: int, *, p: float = 0.1, seed: int = 0,
                     dtype: torch.dtype = float32) -> Program:
    """The boundary between two pipeline stages (groups=2): the last model-parallel layer of a stage all-reduces its
    partial sums y, adds the bias, applies dropout and sends the activation to the next stage."""
    y = Tensor("y", (batch, hidden), dtype, Local)
    b = Tensor("b", (hidden,), dtype, Replicated)
    z = all_reduce(y, groups=2)
    recv = send(dropout(z + b, p, seed), groups=2)
    return Program("pipeline", [y, b], {"recv": recv})
