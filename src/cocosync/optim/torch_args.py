"""torch.optim's constructor contract for our optimizers: the same checks, in the same order, with the same
exception types and messages (torch's optimizer database tests them: tests/optim/test_optim_db.py), and the flags
that only choose torch's implementation (foreach, fused, capturable) accepted, since ours has one implementation
whatever they say. What would change the result and is not implemented is refused by name."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_lr", "check_adam_args", "check_sgd_args", "refuse_unsupported"]


def _scalar(v: Any) -> Any:
    return v.item() if isinstance(v, torch.Tensor) else v


def check_lr(lr: Any, foreach: bool | None, capturable: bool = False) -> None:
    if isinstance(lr, torch.Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


def check_adam_args(lr: Any, betas: Any, eps: float, weight_decay: float, foreach: bool | None,
                    capturable: bool) -> tuple[float, float]:
    """torch.optim.Adam's checks; returns the betas as floats."""
    check_lr(lr, foreach, capturable)
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2:
        raise ValueError(f"betas={betas!r}: expected two coefficients")
    for i in (0, 1):
        if not 0.0 <= betas[i] < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {betas[i]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not (all(isinstance(b, float) for b in betas) or all(isinstance(b, torch.Tensor) for b in betas)):
        raise ValueError("betas must be either both floats or both Tensors")
    for i in (0, 1):
        if isinstance(betas[i], torch.Tensor):
            if not capturable and foreach:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
            if betas[i].numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
    return float(_scalar(betas[0])), float(_scalar(betas[1]))


def check_sgd_args(lr: Any, momentum: float, dampening: float, weight_decay: float, nesterov: bool,
                   foreach: bool | None) -> None:
    """torch.optim.SGD's checks."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if lr < 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if momentum < 0.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if weight_decay < 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def refuse_unsupported(name: str, **flags: Any) -> None:
    """A ValueError naming the first flag set that would change the update and that we do not implement."""
    why = {"differentiable": "would make the step part of the autograd graph (the fused collective is not)"}
    for key, value in flags.items():
        if value:
            raise ValueError(f"{name}: {key}={value!r} is not supported: it {why[key]}; use torch.optim."
                             f"{name.removeprefix('Distributed')} with the cocosync torch.distributed backend")
