"""The data-parallel SGD and Adam programs of the CoCoNeT paper: gradients Local, weights Replicated,
AllReduce then Update. The gradient is averaged over ranks (as DDP does)."""

from __future__ import annotations

import torch

from cocosync.dsl import Local, Program, ReduceOp, Replicated, Scalar, Tensor, all_reduce, float32, sqrt, update


def sgd_program(n: int, dtype: torch.dtype = float32, *, momentum: bool = False) -> Program:
    """w <- w - lr * mean_r(g_r)  (with momentum: buf <- mu * buf + g; w <- w - lr * buf)."""
    g = Tensor("g", n, dtype, Local)
    w = Tensor("w", n, dtype, Replicated)
    lr = Scalar("lr")
    g1 = all_reduce(g, ReduceOp.MEAN)
    if not momentum:
        return Program("sgd", [g, w, lr], [update(w, w - lr * g1)])
    buf, mu = Tensor("buf", n, dtype, Replicated), Scalar("mu")
    buf1 = update(buf, mu * buf + g1)
    return Program("sgd_momentum", [g, w, buf, lr, mu], [update(w, w - lr * buf1), buf1])


def adam_program(n: int, dtype: torch.dtype = float32, *, decoupled: bool = True) -> Program:
    """Adam(W): m, v moments; c1 = 1 - beta1^t and c2 = 1 - beta2^t are the bias corrections of step t.
    Weight decay wd is decoupled (AdamW: w shrinks by lr * wd) or, with decoupled=False, L2 as torch.optim.Adam
    (wd * w is added to the gradient before the moments); wd = 0 gives Adam either way."""
    g = Tensor("g", n, dtype, Local)
    w, m, v = (Tensor(x, n, dtype, Replicated) for x in ("w", "m", "v"))
    lr, beta1, beta2, eps, wd, c1, c2 = (Scalar(x) for x in ("lr", "beta1", "beta2", "eps", "wd", "c1", "c2"))
    g1 = all_reduce(g, ReduceOp.MEAN)
    if not decoupled:
        g1 = g1 + wd * w
    m1 = update(m, beta1 * m + (1 - beta1) * g1)
    v1 = update(v, beta2 * v + (1 - beta2) * g1 * g1)
    step = lr * (m1 / c1) / (sqrt(v1 / c2) + eps)
    w1 = update(w, (w * (1 - lr * wd) if decoupled else w) - step)
    return Program("adam" if decoupled else "adam_l2", [g, w, m, v, lr, beta1, beta2, eps, wd, c1, c2], [w1, m1, v1])


def adam_scalars(step: int, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> dict[str, float]:
    """The Scalar inputs of `adam_program` for step `step` (1-based), as torch.optim.AdamW defines them."""
    b1, b2 = betas
    return {"lr": lr, "beta1": b1, "beta2": b2, "eps": eps, "wd": weight_decay, "c1": 1 - b1**step,
            "c2": 1 - b2**step}
