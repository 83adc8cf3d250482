"""DistributedSGD: torch.optim.SGD (momentum, dampening, Nesterov, weight decay, maximize) as RS -> sliced update
-> AG."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from cocosync.dsl.ir import Program
from cocosync.optim.base import DistributedOptimizer
from cocosync.optim.torch_args import check_sgd_args, refuse_unsupported
from cocosync.programs.mixed_precision import sgd_mp_program
from cocosync.programs.optimizers import sgd_program

__all__ = ["DistributedSGD"]


class DistributedSGD(DistributedOptimizer):
    """Data-parallel SGD with torch.optim.SGD's arguments and semantics: g += wd * w (g negated first with
    `maximize`); buf <- mu * buf + (1 - dampening) * g (buf = g on the first step); w <- w - lr * buf, or
    w - lr * (g + mu * buf) with `nesterov`. The momentum buffer is sliced. Whether momentum, dampening, weight decay
    and Nesterov are on selects the program, so their values may change between steps but not to or from zero.
    `foreach` and `fused` are accepted (ours has one implementation); `differentiable` is refused."""

    state_names = {"buf": "momentum_buffer"}
    torch_group_keys = {"foreach": None, "differentiable": False, "fused": None}

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, differentiable: bool = False,
                 fused: bool | None = None, max_grad_norm: float | None = None,
                 master_dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None,
                 schedule: str = "standard"):
        check_sgd_args(lr, momentum, dampening, weight_decay, nesterov, foreach)
        refuse_unsupported("DistributedSGD", differentiable=differentiable)
        self.state_names = {"buf": "momentum_buffer"} if momentum else {}
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=bool(nesterov), maximize=bool(maximize)),
                         max_grad_norm=max_grad_norm, master_dtype=master_dtype, group=group,
                         schedule=schedule)

    def _structure_of(self, group: dict[str, Any]) -> dict[str, bool]:
        return {"momentum": bool(group["momentum"]), "weight_decay": bool(group["weight_decay"]),
                "dampening": bool(group.get("dampening", 0)) and bool(group["momentum"]),
                "nesterov": bool(group.get("nesterov", False))}

    def _program(self, n: int, dtype: torch.dtype, master_dtype: torch.dtype | None, *, clip: bool,
                 params: list[torch.Tensor], momentum: bool, weight_decay: bool, dampening: bool = False,
                 nesterov: bool = False, masked: bool = False) -> Program:
        if master_dtype is None and not (clip or weight_decay or dampening or nesterov or masked):
            return sgd_program(n, dtype, momentum=momentum)  # the paper's program
        return sgd_mp_program(n, dtype, master_dtype, momentum=momentum, weight_decay=weight_decay, clip=clip,
                              dampening=dampening, nesterov=nesterov, masked=masked)

    def _scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        out = {"lr": group["lr"]}
        if group["momentum"]:
            out["mu"] = group["momentum"]
            if group.get("dampening"):
                out["damp"] = 1.0 if step == 1 else 1.0 - group["dampening"]
        if group["weight_decay"]:
            out["wd"] = group["weight_decay"]
        return out
