"""The data-parallel LAMB program (You et al.): Adam's moments, then a layer-wise trust ratio ||w|| / ||r||."""

from __future__ import annotations

import torch

from cocosync.dsl import (
    Local,
    Node,
    Program,
    ReduceOp,
    Replicated,
    Scalar,
    Tensor,
    all_reduce,
    float32,
    gt,
    norm,
    segment_norm,
    sqrt,
    update,
    where,
)


def trust_ratio(w: Node, r: Node, sizes: tuple[int, ...] | None) -> Node:
    """||w|| / ||r|| (1 when a norm is 0): one ratio over the whole vector, or per segment (per parameter tensor)."""
    if sizes is None:
        w_norm, r_norm = norm(w), norm(r)
    else:
        w_norm, r_norm = segment_norm(w, sizes), segment_norm(r, sizes)
    return where(gt(w_norm, 0.0), where(gt(r_norm, 0.0), w_norm / r_norm, 1.0), 1.0)


def lamb_program(n: int, dtype: torch.dtype = float32, sizes: tuple[int, ...] | None = None) -> Program:
    """r = m_hat / (sqrt(v_hat) + eps) + wd * w;  w <- w - lr * (||w|| / ||r||) * r  (ratio 1 when a norm is 0).
    Scalars as in `adam_scalars` (c1, c2 are the bias corrections). sizes: the lengths of the parameter tensors
    laid end to end in w, for one ratio per tensor (LAMB as published); None: one ratio over all of w."""
    g = Tensor("g", n, dtype, Local)
    w, m, v = (Tensor(x, n, dtype, Replicated) for x in ("w", "m", "v"))
    lr, beta1, beta2, eps, wd, c1, c2 = (Scalar(x) for x in ("lr", "beta1", "beta2", "eps", "wd", "c1", "c2"))
    g1 = all_reduce(g, ReduceOp.MEAN)
    m1 = update(m, beta1 * m + (1 - beta1) * g1)
    v1 = update(v, beta2 * v + (1 - beta2) * g1 * g1)
    r = (m1 / c1) / (sqrt(v1 / c2) + eps) + wd * w
    w1 = update(w, w - lr * trust_ratio(w, r, sizes) * r)
    return Program("lamb" if sizes is None else "lamb_per_tensor", [g, w, m, v, lr, beta1, beta2, eps, wd, c1, c2],
                   [w1, m1, v1])


def lamb_reference(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, step: int, lr: float = 1e-3,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, wd: float = 0.0,
                   sizes: tuple[int, ...] | None = None):
    """One LAMB step in plain torch (the same equations), for tests: returns new (w, m, v); with `sizes`, one trust
    ratio per segment (tensor) of the flat vectors."""
    if sizes is not None:
        parts = [lamb_reference(*xs, step, lr, betas, eps, wd) for xs in zip(*(t.split(list(sizes))
                                                                                 for t in (w, m, v, g)))]
        return tuple(torch.cat(p) for p in zip(*parts))
    b1, b2 = betas
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    r = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps) + wd * w
    wn, rn = w.norm(), r.norm()
    ratio = (wn / rn) if (wn > 0 and rn > 0) else torch.tensor(1.0)
    return w - lr * ratio * r, m, v
