"""Blockwise model-update filtering (Chen & Huo 2016): model averaging followed by block momentum.

    avg       = mean over trainers of x_local
    desc      = avg - x_prev_global
    delta    <- block_momentum * delta + block_lr * desc
    x_global  = x_prev_global + delta
    x_local  <- x_global + block_momentum * delta   (Nesterov)   or   x_global   (classic)

x_prev_global starts at the initial parameters, which must be the same on every trainer (the trainer
starts all replicas from one initialization). In the last round (no trainer active) every
trainer ends on x_global itself, so the final model is the global one, without the Nesterov look-ahead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..train_config import SyncConfig
from .base import SyncAlgorithm

__all__ = ["BMUF"]


class BMUF(SyncAlgorithm):
    name = "bmuf"
    collective = True

    def __init__(self, flat: torch.Tensor, cfg: SyncConfig, group: dist.ProcessGroup | None = None):
        super().__init__(flat, cfg, group)
        self.global_params = flat.detach().clone()  # x_prev_global
        self.delta = torch.zeros_like(flat)

    def _sync(self, active: bool) -> int:
        snapshot = self.flat.clone()
        avg, n_active = self._mean_and_active(snapshot, active)
        desc = avg.sub_(self.global_params)
        self.delta.mul_(self.cfg.block_momentum).add_(desc, alpha=self.cfg.block_lr)
        self.global_params.add_(self.delta)
        target = self.global_params.clone()
        if self.cfg.nesterov and n_active > 0:
            target.add_(self.delta, alpha=self.cfg.block_momentum)
        self.flat.add_(target.sub_(snapshot))
        return n_active
