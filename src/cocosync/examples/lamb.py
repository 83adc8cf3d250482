"""The data-parallel LAMB program (You et al.): Adam's moments, then a layer-wise trust ratio ||w|| / ||r||."""

from __future__ import annotations

import torch

from cocosync.dsl import (Local, Program, ReduceOp, Replicated, Scalar, Tensor, all_reduce, float32, gt, norm, sqrt,
                          update, where)


def lamb_program(n: int, dtype: torch.dtype = float32) -> Program:
    """r = m_hat / (sqrt(v_hat) + eps) + wd * w;  w <- w - lr * (||w|| / ||r||) * r  (ratio 1 when a norm is 0).
    Scalars as in `adam_scalars` (c1, c2 are the bias corrections)."""
    g = Tensor("g", n, dtype, Local)
    w, m, v = (Tensor(x, n, dtype, Replicated) for x in ("w", "m", "v"))
    lr, beta1, beta2, eps, wd, c1, c2 = (Scalar(x) for x in ("lr", "beta1", "beta2", "eps", "wd", "c1", "c2"))
    g1 = all_reduce(g, ReduceOp.MEAN)
    m1 = update(m, beta1 * m + (1 - beta1) * g1)
    v1 = update(v, beta2 * v + (1 - beta2) * g1 * g1)
    r = (m1 / c1) / (sqrt(v1 / c2) + eps) + wd * w
    w_norm, r_norm = norm(w), norm(r)
    ratio = where(gt(w_norm, 0.0), where(gt(r_norm, 0.0), w_norm / r_norm, 1.0), 1.0)
    w1 = update(w, w - lr * ratio * r)
    return Program("lamb", [g, w, m, v, lr, beta1, beta2, eps, wd, c1, c2], [w1, m1, v1])


def lamb_reference(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, step: int, lr: float = 1e-3,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, wd: float = 0.0):
    """One LAMB step in plain torch (the same equations), for tests: returns new (w, m, v)."""
    b1, b2 = betas
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    r = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps) + wd * w
    wn, rn = w.norm(), r.norm()
    ratio = (wn / rn) if (wn > 0 and rn > 0) else torch.tensor(1.0)
    return w - lr * ratio * r, m, v
