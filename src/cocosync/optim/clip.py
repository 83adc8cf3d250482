"""Clipping by the global norm of the averaged gradient over every parameter group (what
torch.nn.utils.clip_grad_norm_ computes on DDP-averaged gradients, and FSDP's `clip_grad_norm_` on sharded ones).

With one group the optimizers clip inside the fused update (`max_grad_norm=`: one reduction of the gradients). Over
several groups, or through `opt.clip_grad_norm_(max_norm)` before `step()`, the norm needs every group's gradient
first: a reduce-scatter per group computes the norm of its averaged gradient (`grad_norm_program`, the gradients
kept), and every rank scales its local gradients by the same coefficient, which scales their average alike. That is
one extra reduce-scatter of the gradients per step: the price of clipping outside the fused update.

`torch.nn.utils.clip_grad_norm_` called on a distributed optimizer's parameters clips each rank's own gradient
before the average (and returns a per-rank norm): `watch_local_clipping` wraps it to warn once, saying what to use.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import torch

from cocosync.lower import lower
from cocosync.programs.mixed_precision import CLIP_EPS, grad_norm_program
from cocosync.runtime.executor import compile_plan

__all__ = ["GlobalNormClip", "watch_local_clipping"]

#: id -> (weak reference to a parameter of a DistributedOptimizer over several ranks, the optimizer's class name)
_WATCHED: dict[int, tuple[weakref.ref, str]] = {}
_WARNED: list[bool] = []


def watch_local_clipping(params: list[torch.Tensor], owner: str) -> None:
    """Warn (once per process) when torch.nn.utils.clip_grad_norm_ is called on any of `params`."""
    for p in params:
        _WATCHED[id(p)] = (weakref.ref(p), owner)
    original = torch.nn.utils.clip_grad_norm_
    if getattr(original, "_cocosync_watch", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        owner = next((w[1] for w in map(_WATCHED.get, map(id, params)) if w is not None and w[0]() is not None), None)
        if owner is not None and not _WARNED:
            _WARNED.append(True)
            warnings.warn(f"torch.nn.utils.clip_grad_norm_ on the parameters of a {owner} clips each rank's own "
                          f"gradient before {owner}.step() averages them, and returns this rank's norm; for the "
                          "norm of the averaged gradient (what DDP users get) call opt.clip_grad_norm_(max_norm) "
                          "or construct it with max_grad_norm=", UserWarning, stacklevel=2)
        return original(params, *args, **kwargs)

    clip_grad_norm_._cocosync_watch = True  # type: ignore[attr-defined]
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_


class GlobalNormClip:
    """The global gradient norm of a DistributedOptimizer's groups, and clipping to a maximum."""

    def __init__(self, opt: Any):
        self.opt = opt
        self._plans: dict[int, Any] = {}

    def _group_norm(self, gi: int, u: Any) -> torch.Tensor:
        if u.compiled is None:  # no torch.distributed: the local gradient is the average
            return torch.linalg.vector_norm(u.flat.grad.float())
        if gi not in self._plans:  # collective: every rank compiles group gi's norm on its first use
            self._plans[gi] = compile_plan(lower(grad_norm_program(u.flat.padded, u.flat.dtype)),
                                           self.opt._process_group)
        return next(iter(self._plans[gi](g=u.flat.grad).values())).float()

    def norm(self) -> torch.Tensor:
        """The L2 norm of the averaged gradient over every group (collective; the same on every rank)."""
        squares = [self._group_norm(gi, u).square() for gi, u in enumerate(self.opt._updates)]
        return torch.stack(squares).sum().sqrt()

    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale every rank's gradients so that their average has norm <= max_norm; returns the norm before."""
        total = self.norm()
        coef = torch.clamp(max_norm / (total + CLIP_EPS), max=1.0)
        for u in self.opt._updates:
            u.flat.grad.mul_(coef.to(u.flat.grad.dtype))
        return total
