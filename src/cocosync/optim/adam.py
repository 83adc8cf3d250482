"""DistributedAdam and DistributedAdamW: Adam as one fused RS -> sliced Adam -> AG per step, with torch.optim.Adam's
L2 weight decay or AdamW's decoupled one."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from cocosync.dsl.ir import Program
from cocosync.optim.base import DistributedOptimizer
from cocosync.optim.torch_args import check_adam_args, refuse_unsupported
from cocosync.programs.mixed_precision import adam_mp_program
from cocosync.programs.optimizers import adam_program, adam_scalars

__all__ = ["DistributedAdam", "DistributedAdamW"]


class DistributedAdam(DistributedOptimizer):
    """Data-parallel Adam without DDP: ``step()`` averages the gradients over ranks and updates the parameters
    with the paper's Adam program under its standard schedule (RS -> sliced m, v, w update -> AG; m and v sliced).

    torch.optim.Adam's arguments and semantics: weight decay is L2 (weight_decay * w added to the gradient) unless
    `decoupled_weight_decay=True` (torch.optim.AdamW's, as DistributedAdamW); `maximize` ascends; `foreach`, `fused`
    and `capturable` choose torch's implementation and are accepted (ours has one); `amsgrad` keeps the running
    maximum of the second moment (sliced like it); `differentiable` is refused by name. Parameter groups may set
    their own lr, betas, eps, weight_decay and maximize. See DistributedOptimizer for max_grad_norm, master_dtype,
    group, schedule.
    """

    state_names = {"m": "exp_avg", "v": "exp_avg_sq"}
    torch_group_keys = {"foreach": None, "capturable": False, "differentiable": False, "fused": None}

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas: tuple[Any, Any] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False,
                 max_grad_norm: float | None = None, master_dtype: torch.dtype | None = None,
                 group: dist.ProcessGroup | None = None,
                 schedule: str = "standard"):
        betas = check_adam_args(lr, betas, eps, weight_decay, foreach, capturable)
        refuse_unsupported(type(self).__name__, differentiable=differentiable)
        self.amsgrad = bool(amsgrad)
        if self.amsgrad:
            self.state_names = {**self.state_names, "vmax": "max_exp_avg_sq"}
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=self.amsgrad,
                                      maximize=bool(maximize), decoupled_weight_decay=bool(decoupled_weight_decay)),
                         max_grad_norm=max_grad_norm, master_dtype=master_dtype, group=group,
                         schedule=schedule)

    def _structure_of(self, group: dict[str, Any]) -> dict[str, bool]:
        return {"decoupled": bool(group.get("decoupled_weight_decay", True)),
                "amsgrad": bool(group.get("amsgrad", False))}

    def _program(self, n: int, dtype: torch.dtype, master_dtype: torch.dtype | None, *, clip: bool,
                 params: list[torch.Tensor], masked: bool = False, decoupled: bool = True,
                 amsgrad: bool = False) -> Program:
        if amsgrad != self.amsgrad:  # its state (max_exp_avg_sq) exists for every group or for none
            raise ValueError(f"{type(self).__name__}: a parameter group with amsgrad={amsgrad} in an optimizer "
                             f"constructed with amsgrad={self.amsgrad}; use one setting for all groups")
        if master_dtype is None and not clip and not amsgrad and not masked:
            return adam_program(n, dtype, decoupled=decoupled)  # the paper's program
        return adam_mp_program(n, dtype, master_dtype, clip=clip, decoupled=decoupled, amsgrad=amsgrad,
                               masked=masked)

    def _scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        return adam_scalars(step, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                            weight_decay=group["weight_decay"])


class DistributedAdamW(DistributedAdam):
    """Data-parallel AdamW (decoupled weight decay, as torch.optim.AdamW); see DistributedAdam."""

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas: tuple[Any, Any] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, max_grad_norm: float | None = None,
                 master_dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None,
                 schedule: str = "standard"):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, max_grad_norm=max_grad_norm, master_dtype=master_dtype,
                         group=group, schedule=schedule)
