"""Data-parallel optimizer programs with mixed precision and global-norm gradient clipping.

The paper's programs (programs/optimizers.py, programs/lamb.py) keep gradients, weights and state in one dtype.
Here the gradients and the model weights may be low precision (bfloat16/float16) while the optimizer works on
float32 "master" weights and moments:

    g (bf16, Local) -> all_reduce(mean) -> cast f32 [-> clip by global norm] -> update of master, m, v (f32)
                    -> cast bf16 -> update of the model weights w (bf16)

Scheduled with the standard schedule (split + reorder + as_slice(master, m, v) + fuse), this becomes
RS(g) -> cast -> sliced update of the f32 master/m/v -> cast -> AG straight into the bf16 weights: the f32 state is
sliced (ZeRO-1) and only the bf16 weights cross ranks. The reduction accumulates in float32 (the runtime's rule
for low-precision collectives) and rounds the mean to the gradient dtype.

Clipping (`clip=True`, Scalar input `max_norm`): scale = min(1, max_norm / (||mean g|| + 1e-6)), as
torch.nn.utils.clip_grad_norm_; the norm before clipping is also an output, "grad_norm" (what clip_grad_norm_
returns, the number training loops log); the norm of the reduce-scattered slice is global (Sliced semantics). A norm
is a
reduction over the whole tensor: the runtime runs such a fused collective in phases around it
(runtime/steps/fused_collective.py),
still one reduction of the gradients. `grad_norm_program` is the norm alone (reduce-scatter + norm of the slice).

With `master_dtype == dtype` and `clip=False` each program is the paper's program (same stages).
"""

from __future__ import annotations

from typing import Callable

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
    cast,
    float32,
    gt,
    maximum,
    norm,
    reduce_scatter,
    sqrt,
    update,
    where,
)
from cocosync.programs.lamb import trust_ratio  # noqa: E402 - after the DSL imports it uses

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon


def _grad(n: int, dtype: torch.dtype, master_dtype: torch.dtype,
          clip: bool) -> tuple[list[Node], Node, dict[str, Node]]:
    """The inputs g (and max_norm), the averaged gradient in the master dtype, clipped if asked, and the extra
    outputs: with clipping, "grad_norm", the norm before clipping (what clip_grad_norm_ returns)."""
    g = Tensor("g", n, dtype, Local)
    g1 = all_reduce(g, ReduceOp.MEAN)
    if master_dtype != dtype:
        g1 = cast(g1, master_dtype)
    if not clip:
        return [g], g1, {}
    max_norm = Scalar("max_norm")
    total = norm(g1)
    coef = max_norm / (total + CLIP_EPS)
    return [g, max_norm], g1 * where(gt(coef, 1.0), 1.0, coef), {"grad_norm": total}


def _outputs(nodes: list[Node], extra: dict[str, Node]) -> dict[str, Node]:
    """The updated states under their names, then the extra outputs."""
    return {**{o.args[0].name: o for o in nodes}, **extra}


def _weights(n: int, dtype: torch.dtype, master_dtype: torch.dtype) -> tuple[list[Node], Node]:
    """The model weights w (and the master copy): returns (inputs, the tensor the update reads)."""
    w = Tensor("w", n, dtype, Replicated)
    if master_dtype == dtype:
        return [w], w
    master = Tensor("master", n, master_dtype, Replicated)
    return [w, master], master


def _write(ws: list[Node], new: Node, kept: Callable[[Node, Node], Node] = lambda new, old: new) -> list[Node]:
    """Update the master (if any) and the model weights (cast down)."""
    new = kept(new, ws[-1])
    if len(ws) == 1:
        return [update(ws[0], new)]
    master1 = update(ws[1], new)
    return [update(ws[0], cast(master1, ws[0].dtype)), master1]


def _keep(n: int, master_dtype: torch.dtype, masked: bool) -> tuple[list[Node], Callable[[Node, Node], Node]]:
    """With `masked`: the input "keep" (1 where the element's parameter has a gradient this step, 0 where
    torch.optim would skip the parameter) and a function (new value, old value) -> the new value only there."""
    if not masked:
        return [], lambda new, old: new
    keep = Tensor("keep", n, master_dtype, Replicated)
    cond = gt(keep, 0.5)
    return [keep], lambda new, old: where(cond, new, old)


def _per_step(names: str, n: int, master_dtype: torch.dtype, masked: bool) -> list[Node]:
    """Inputs that depend on the step count: Scalars, or with `masked` one value per element (each parameter has
    its own step count once some were skipped, as torch.optim's state[p]["step"])."""
    return [Tensor(x, n, master_dtype, Replicated) if masked else Scalar(x) for x in names.split()]


#: the per-element inputs of the masked programs (sliced like the optimizer state)
MASK_INPUTS = ("keep", "c1", "c2", "damp")


def _check(dtype: torch.dtype, master_dtype: torch.dtype | None) -> torch.dtype:
    master_dtype = master_dtype or dtype
    if master_dtype != dtype and master_dtype != float32:
        raise ValueError(f"master_dtype={master_dtype}: master weights must be float32 (or the weights' dtype)")
    return master_dtype


def _mp_name(base: str, dtype, master_dtype, clip: bool) -> str:
    mp = "" if master_dtype == dtype else f"_{str(dtype).split('.')[-1]}_master"
    return base + mp + ("_clip" if clip else "")


def adam_mp_program(n: int, dtype: torch.dtype = float32, master_dtype: torch.dtype | None = None, *,
                    clip: bool = False, decoupled: bool = True, amsgrad: bool = False,
                    masked: bool = False) -> Program:
    """Adam(W) (scalars of `adam_scalars`) on master weights; state names master, m, v (master_dtype). Weight
    decay decoupled (AdamW) or, with decoupled=False, L2 on the (clipped) gradient as torch.optim.Adam. amsgrad:
    the denominator uses the running maximum vmax of v (state vmax), as torch.optim.Adam(amsgrad=True).
    masked: elements whose "keep" is 0 keep their weights and state, and the bias corrections c1, c2 are per
    element (parameters without a gradient on some steps, skipped as torch.optim skips them)."""
    master_dtype = _check(dtype, master_dtype)
    gin, g1, extra = _grad(n, dtype, master_dtype, clip)
    ws, w = _weights(n, dtype, master_dtype)
    m, v = (Tensor(x, n, master_dtype, Replicated) for x in ("m", "v"))
    lr, beta1, beta2, eps, wd = (Scalar(x) for x in ("lr", "beta1", "beta2", "eps", "wd"))
    c1, c2 = _per_step("c1 c2", n, master_dtype, masked)
    keep, kept = _keep(n, master_dtype, masked)
    if not decoupled:
        g1 = g1 + wd * w
    m1 = update(m, kept(beta1 * m + (1 - beta1) * g1, m))
    v1 = update(v, kept(beta2 * v + (1 - beta2) * g1 * g1, v))
    states, second = [m1, v1], v1
    vmax = Tensor("vmax", n, master_dtype, Replicated)
    if amsgrad:
        second = update(vmax, maximum(vmax, v1))
        states.append(second)
    step = lr * (m1 / c1) / (sqrt(second / c2) + eps)
    outs = _write(ws, (w * (1 - lr * wd) if decoupled else w) - step, kept)
    inputs = [gin[0], *ws, m, v, *([vmax] if amsgrad else []), lr, beta1, beta2, eps, wd, c1, c2, *keep, *gin[1:]]
    name = ("adam" if decoupled else "adam_l2") + ("_amsgrad" if amsgrad else "") + ("_masked" if masked else "")
    return Program(_mp_name(name, dtype, master_dtype, clip), inputs, _outputs([*outs, *states], extra))


def lamb_mp_program(n: int, dtype: torch.dtype = float32, master_dtype: torch.dtype | None = None, *,
                    clip: bool = False, sizes: tuple[int, ...] | None = None, masked: bool = False) -> Program:
    """LAMB (as `lamb_program`: trust ratio ||w|| / ||r|| over the whole vector, or per segment of `sizes`) on
    master weights. masked: as `adam_mp_program` (a skipped tensor still enters a ratio over the whole vector)."""
    master_dtype = _check(dtype, master_dtype)
    gin, g1, extra = _grad(n, dtype, master_dtype, clip)
    ws, w = _weights(n, dtype, master_dtype)
    m, v = (Tensor(x, n, master_dtype, Replicated) for x in ("m", "v"))
    lr, beta1, beta2, eps, wd = (Scalar(x) for x in ("lr", "beta1", "beta2", "eps", "wd"))
    c1, c2 = _per_step("c1 c2", n, master_dtype, masked)
    keep, kept = _keep(n, master_dtype, masked)
    m1 = update(m, kept(beta1 * m + (1 - beta1) * g1, m))
    v1 = update(v, kept(beta2 * v + (1 - beta2) * g1 * g1, v))
    r = (m1 / c1) / (sqrt(v1 / c2) + eps) + wd * w
    outs = _write(ws, w - lr * trust_ratio(w, r, sizes) * r, kept)
    name = _mp_name("lamb" if sizes is None else "lamb_per_tensor", dtype, master_dtype, clip)
    return Program(name + ("_masked" if masked else ""),
                   [gin[0], *ws, m, v, lr, beta1, beta2, eps, wd, c1, c2, *keep, *gin[1:]],
                   _outputs([*outs, m1, v1], extra))


def sgd_mp_program(n: int, dtype: torch.dtype = float32, master_dtype: torch.dtype | None = None, *,
                   momentum: bool = False, weight_decay: bool = False, clip: bool = False, dampening: bool = False,
                   nesterov: bool = False, masked: bool = False) -> Program:
    """SGD as torch.optim.SGD: g += wd * w; buf <- mu * buf + damp * g; w <- w - lr * d with d = buf, or
    g + mu * buf (Nesterov). damp is 1 - dampening, except 1 on the first step (torch starts buf at g).
    Scalars lr (and mu, damp, wd); state buf (master_dtype). masked: as `adam_mp_program` (damp per element)."""
    master_dtype = _check(dtype, master_dtype)
    keep, kept = _keep(n, master_dtype, masked)
    gin, g1, extra = _grad(n, dtype, master_dtype, clip)
    ws, w = _weights(n, dtype, master_dtype)
    lr = Scalar("lr")
    states: list[Node] = []
    scalars: list[Node] = [lr]
    if weight_decay:
        wd = Scalar("wd")
        g1 = g1 + wd * w
    outs: list[Node] = []
    if momentum:
        buf, mu = Tensor("buf", n, master_dtype, Replicated), Scalar("mu")
        states.append(buf)
        scalars.append(mu)
        if dampening:
            damp, = _per_step("damp", n, master_dtype, masked)
            scalars.append(damp)
            buf1 = update(buf, kept(mu * buf + damp * g1, buf))
        else:
            buf1 = update(buf, kept(mu * buf + g1, buf))
        outs.append(buf1)
        g1 = g1 + mu * buf1 if nesterov else buf1
    if weight_decay:
        scalars.append(wd)
    base = "sgd_momentum" + ("_dampening" if dampening else "") + ("_nesterov" if nesterov else "")
    name = _mp_name(base if momentum else "sgd", dtype, master_dtype, clip) + ("_masked" if masked else "")
    return Program(name, [gin[0], *ws, *states, *scalars, *keep, *gin[1:]],
                   _outputs([*_write(ws, w - lr * g1, kept), *outs], extra))


def grad_norm_program(n: int, dtype: torch.dtype = float32) -> Program:
    """||mean_r(g_r)||: the L2 norm of the averaged gradient (float32), for clipping before a fused update step.
    reduce_scatter + norm of the slice (global for a Sliced tensor): 1/P of the reduction, no all-gather."""
    g = Tensor("g", n, dtype, Local)
    gs = reduce_scatter(g, ReduceOp.MEAN)
    if dtype != float32:
        gs = cast(gs, float32)
    return Program("grad_norm", [g], [norm(gs)])
