"""A hand-written fused Adam over the shared-memory fused all-reduce: the benchmarks' upper reference for what the
compiled DSL program (DistributedAdam) can reach, and a direct user of `fused_all_reduce`'s chunk callback."""

from __future__ import annotations

import math

import torch

from cocosync.runtime.comm.collectives import ShmCommunicator
from cocosync.runtime.comm.fused import ChunkFn, fused_all_reduce, slice_bounds

__all__ = ["AdamSlice", "adam_chunk_update"]


_FUSED_ADAM = getattr(torch, "_fused_adam_", None)
_steps: dict[int, torch.Tensor] = {}


def _step_tensor(step: int) -> torch.Tensor:
    t = _steps.get(step)
    if t is None:
        if len(_steps) > 64:
            _steps.clear()
        t = _steps[step] = torch.tensor(float(step))
    return t


def adam_chunk_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int,
                      lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                      weight_decay: float = 0.0) -> None:
    """One Adam step on a chunk, in place, with torch.optim.Adam's formulas (non-amsgrad).

    Uses torch's fused CPU Adam kernel (one pass over p, g, m, v: the chunk is read and written once) when this
    torch has it, else the single-tensor formulas of torch.optim.Adam."""
    b1, b2 = betas
    if _FUSED_ADAM is not None and p.dtype == g.dtype == m.dtype == v.dtype and p.device.type == "cpu":
        _FUSED_ADAM([p], [g], [m], [v], [], [_step_tensor(step)], amsgrad=False, lr=lr, beta1=b1, beta2=b2,
                    weight_decay=weight_decay, eps=eps, maximize=False)
        return
    if weight_decay:
        g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    bc1 = 1 - b1 ** step
    bc2_sqrt = math.sqrt(1 - b2 ** step)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)


class AdamSlice:
    """Adam state (m, v) for this rank's slice of a flat parameter vector: ``fn`` for fused_all_reduce.

    Usage: ``opt = AdamSlice(comm, numel, lr=...)``; each step: ``opt.step(grads, params)`` reduces the gradients
    (mean over ranks by default), updates the slice, and all-gathers the parameters.
    """

    def __init__(self, comm: ShmCommunicator, numel: int, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, grad_op: str = "mean"):
        self.comm = comm
        self.start, self.stop = slice_bounds(comm, numel)
        self.m = torch.zeros(self.stop - self.start)
        self.v = torch.zeros(self.stop - self.start)
        self.hp = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.grad_op = grad_op
        self.steps = 0

    def chunk_fn(self) -> ChunkFn:
        s, step, hp = self.start, self.steps, self.hp

        def fn(offset: int, g: torch.Tensor, p: torch.Tensor) -> None:
            a, b = offset - s, offset - s + g.numel()
            adam_chunk_update(p, g, self.m[a:b], self.v[a:b], step=step, **hp)
        return fn

    def step(self, grads: torch.Tensor, params: torch.Tensor, gather: bool = True) -> torch.Tensor:
        self.steps += 1
        return fused_all_reduce(self.comm, grads, self.chunk_fn(), out=params, op=self.grad_op, gather=gather)
