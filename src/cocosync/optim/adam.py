"""DistributedAdam: Adam with AdamW's decoupled weight decay, as one fused RS -> sliced Adam -> AG per step."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from cocosync.dsl.ir import Program
from cocosync.optim.base import DistributedOptimizer
from cocosync.programs.mixed_precision import adam_mp_program
from cocosync.programs.optimizers import adam_program, adam_scalars

__all__ = ["DistributedAdam"]


class DistributedAdam(DistributedOptimizer):
    """Data-parallel Adam(W) without DDP: ``step()`` averages the gradients over ranks and updates the parameters
    with the paper's Adam program under its standard schedule (RS -> sliced m, v, w update -> AG; m and v sliced).

    `weight_decay` is decoupled, as torch.optim.AdamW (weight_decay=0 is torch.optim.Adam). Parameter groups may
    set their own lr, betas, eps and weight_decay. amsgrad and maximize are not supported. See DistributedOptimizer
    for max_grad_norm, master_dtype, group.
    """

    state_names = {"m": "exp_avg", "v": "exp_avg_sq"}
    # weight decay is decoupled: torch.optim.AdamW, or Adam(decoupled_weight_decay=True)
    torch_group_keys = {"amsgrad": False, "maximize": False, "decoupled_weight_decay": True, "foreach": None,
                        "capturable": False, "differentiable": False, "fused": None}

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, max_grad_norm: float | None = None,
                 master_dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None):
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"DistributedAdam: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"DistributedAdam: betas={betas} must be two numbers in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay),
                         max_grad_norm=max_grad_norm, master_dtype=master_dtype, group=group)

    def _program(self, n: int, dtype: torch.dtype, master_dtype: torch.dtype | None, *, clip: bool,
                 params: list[torch.Tensor]) -> Program:
        if master_dtype is None and not clip:
            return adam_program(n, dtype)  # the paper's program
        return adam_mp_program(n, dtype, master_dtype, clip=clip)

    def _scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        return adam_scalars(step, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                            weight_decay=group["weight_decay"])
