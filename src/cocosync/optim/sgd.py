"""DistributedSGD: SGD with momentum and weight decay (torch.optim.SGD's), RS -> sliced update -> AG."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from cocosync.dsl.ir import Program
from cocosync.optim.base import DistributedOptimizer
from cocosync.programs.mixed_precision import sgd_mp_program
from cocosync.programs.optimizers import sgd_program

__all__ = ["DistributedSGD"]


class DistributedSGD(DistributedOptimizer):
    """Data-parallel SGD as torch.optim.SGD with dampening=0, nesterov=False: g += wd * w; buf <- mu * buf + g;
    w <- w - lr * buf. The momentum buffer is sliced. Whether momentum and weight decay are zero selects the
    program, so they may change between steps but not to or from zero."""

    state_names = {"buf": "momentum_buffer"}
    torch_group_keys = {"dampening": 0, "nesterov": False, "maximize": False, "foreach": None,
                        "differentiable": False, "fused": None}

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0, *,
                 max_grad_norm: float | None = None, master_dtype: torch.dtype | None = None,
                 group: dist.ProcessGroup | None = None):
        if not lr >= 0 or not momentum >= 0 or not weight_decay >= 0:
            raise ValueError(f"DistributedSGD: lr={lr}, momentum={momentum}, weight_decay={weight_decay} must be >= 0")
        self.state_names = {"buf": "momentum_buffer"} if momentum else {}
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay),
                         max_grad_norm=max_grad_norm, master_dtype=master_dtype, group=group)

    def _structure_of(self, group: dict[str, Any]) -> dict[str, bool]:
        return {"momentum": bool(group["momentum"]), "weight_decay": bool(group["weight_decay"])}

    def _program(self, n: int, dtype: torch.dtype, master_dtype: torch.dtype | None, *, clip: bool,
                 params: list[torch.Tensor], momentum: bool, weight_decay: bool) -> Program:
        if master_dtype is None and not clip and not weight_decay:
            return sgd_program(n, dtype, momentum=momentum)  # the paper's program
        return sgd_mp_program(n, dtype, master_dtype, momentum=momentum, weight_decay=weight_decay, clip=clip)

    def _scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        out = {"lr": group["lr"]}
        if group["momentum"]:
            out["mu"] = group["momentum"]
        if group["weight_decay"]:
            out["wd"] = group["weight_decay"]
        return out
