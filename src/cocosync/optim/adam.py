"""DistributedAdam and DistributedAdamW: Adam as one fused RS -> sliced Adam -> AG per step, with torch.optim.Adam's
L2 weight decay or AdamW's decoupled one."""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch
import torch.distributed as dist

from cocosync.dsl.ir import Program
from cocosync.optim.base import DistributedOptimizer
from cocosync.programs.mixed_precision import adam_mp_program
from cocosync.programs.optimizers import adam_program, adam_scalars

__all__ = ["DistributedAdam", "DistributedAdamW"]

_DECOUPLED_DEFAULT_CHANGES = (
    "DistributedAdam(weight_decay=...) decays the weights decoupled (as torch.optim.AdamW), while torch.optim.Adam "
    "adds weight_decay * w to the gradient (L2). Say which you want: DistributedAdamW (or "
    "decoupled_weight_decay=True) keeps today's behaviour; decoupled_weight_decay=False is torch.optim.Adam's. The "
    "default will become torch.optim.Adam's.")


class DistributedAdam(DistributedOptimizer):
    """Data-parallel Adam without DDP: ``step()`` averages the gradients over ranks and updates the parameters
    with the paper's Adam program under its standard schedule (RS -> sliced m, v, w update -> AG; m and v sliced).

    `decoupled_weight_decay` as torch.optim.Adam's: False adds weight_decay * w to the gradient (L2, torch.optim.Adam);
    True decays the weights decoupled (torch.optim.AdamW, as DistributedAdamW). Left unset with weight_decay > 0 it is
    decoupled, with a FutureWarning (today's behaviour; the default will become torch.optim.Adam's). Parameter
    groups may set their own lr, betas, eps and weight_decay. amsgrad and maximize are not supported. See
    DistributedOptimizer for max_grad_norm, master_dtype, group.
    """

    state_names = {"m": "exp_avg", "v": "exp_avg_sq"}
    torch_group_keys = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                        "differentiable": False, "fused": None}

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, decoupled_weight_decay: bool | None = None,
                 max_grad_norm: float | None = None, master_dtype: torch.dtype | None = None,
                 group: dist.ProcessGroup | None = None):
        name = type(self).__name__
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"{name}: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"{name}: betas={betas} must be two numbers in [0, 1)")
        if decoupled_weight_decay is None:
            if weight_decay:
                warnings.warn(_DECOUPLED_DEFAULT_CHANGES, FutureWarning, stacklevel=2)
            decoupled_weight_decay = True
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      decoupled_weight_decay=bool(decoupled_weight_decay)),
                         max_grad_norm=max_grad_norm, master_dtype=master_dtype, group=group)

    def _structure_of(self, group: dict[str, Any]) -> dict[str, bool]:
        return {"decoupled": bool(group.get("decoupled_weight_decay", True))}

    def _program(self, n: int, dtype: torch.dtype, master_dtype: torch.dtype | None, *, clip: bool,
                 params: list[torch.Tensor], decoupled: bool = True) -> Program:
        if master_dtype is None and not clip:
            return adam_program(n, dtype, decoupled=decoupled)  # the paper's program
        return adam_mp_program(n, dtype, master_dtype, clip=clip, decoupled=decoupled)

    def _scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        return adam_scalars(step, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                            weight_decay=group["weight_decay"])


class DistributedAdamW(DistributedAdam):
    """Data-parallel AdamW (decoupled weight decay, as torch.optim.AdamW); see DistributedAdam."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, max_grad_norm: float | None = None,
                 master_dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, decoupled_weight_decay=True,
                         max_grad_norm=max_grad_norm, master_dtype=master_dtype, group=group)
