"""DistributedLAMB: LAMB (You et al.) as the paper's program, RS -> sliced update with global norms -> AG."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from cocosync.dsl.ir import Program
from cocosync.optim.base import DistributedOptimizer
from cocosync.programs.lamb import lamb_program
from cocosync.programs.mixed_precision import lamb_mp_program
from cocosync.programs.optimizers import adam_scalars

__all__ = ["DistributedLAMB"]


class DistributedLAMB(DistributedOptimizer):
    """Data-parallel LAMB: Adam's moments, then w <- w - lr * (||w|| / ||r||) * r with r = m_hat / (sqrt(v_hat) +
    eps) + wd * w, as `cocosync.programs.lamb.lamb_program`.

    per_tensor=True (default, LAMB as published and as apex's FusedLAMB): one trust ratio per parameter tensor
    (`segment_norm` over the flat buffer, one segment per parameter); False: ONE ratio over all parameters of a
    parameter group (the norms over its whole flat vector, as `cocosync.programs.lamb.lamb_program` without sizes).

    The norms split the fused collective into two phases (runtime/steps/fused_collective.py): RS -> moments and
    partial sums
    of squares per chunk -> all-reduce of those few sums -> w - lr * ratio * r on the slice -> AG. With
    bfloat16/float16 parameters and `master_dtype=torch.float32`, ||w|| is the norm of the float32 master weights,
    computed on their slices.
    """

    state_names = {"m": "exp_avg", "v": "exp_avg_sq"}

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, *, max_grad_norm: float | None = None,
                 master_dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None,
                 schedule: str = "standard",
                 per_tensor: bool = True):
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"DistributedLAMB: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"DistributedLAMB: betas={betas} must be two numbers in [0, 1)")
        self.per_tensor = bool(per_tensor)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay),
                         max_grad_norm=max_grad_norm, master_dtype=master_dtype, group=group,
                         schedule=schedule)

    def _program(self, n: int, dtype: torch.dtype, master_dtype: torch.dtype | None, *, clip: bool,
                 params: list[torch.Tensor], masked: bool = False) -> Program:
        sizes = None
        if self.per_tensor:  # one segment per parameter, in FlatParams' order, then the zero padding
            sizes = [p.numel() for p in params]
            sizes += [n - sum(sizes)] if n > sum(sizes) else []
            sizes = tuple(sizes)
        if master_dtype is None and not clip and not masked:
            return lamb_program(n, dtype, sizes)  # the paper's program
        return lamb_mp_program(n, dtype, master_dtype, clip=clip, sizes=sizes, masked=masked)

    def _scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        return adam_scalars(step, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                            weight_decay=group["weight_decay"])
