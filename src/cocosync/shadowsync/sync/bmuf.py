"""Blockwise model-update filtering (Chen & Huo 2016): model averaging followed by block momentum.

    avg       = mean over trainers of x_local
    desc      = avg - x_start                         (x_start: where this block's local training started)
    delta    <- block_momentum * delta + block_lr * desc
    x_global  = x_prev_global + delta
    x_start   = x_global + block_momentum * delta     (Nesterov, NBM)   or   x_global   (classic, CBM)
    x_local  <- x_start

For classic block momentum x_start = x_prev_global, i.e. desc = avg - x_prev_global. With the Nesterov
restart the descent must be measured from the look-ahead point the block started from, otherwise the
momentum term is counted again in every block and delta never decays.

x_prev_global starts at the initial parameters, which must be the same on every trainer (the trainer
starts all replicas from one initialization). In the last round (no trainer active) every trainer ends on
x_global itself, so the final model is the global one, without the Nesterov look-ahead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cocosync.shadowsync.config import SyncConfig
from cocosync.shadowsync.sync.base import SyncAlgorithm

__all__ = ["BMUF"]


class BMUF(SyncAlgorithm):
    name = "bmuf"
    collective = True

    def __init__(self, flat: torch.Tensor, cfg: SyncConfig, group: dist.ProcessGroup | None = None):
        super().__init__(flat, cfg, group)
        self.global_params = flat.detach().clone()  # x_prev_global
        self.start = flat.detach().clone()  # x_start of the current block
        self.delta = torch.zeros_like(flat)
        self.momentum = cfg.momentum_for(self.group_size())

    def _sync(self, active: bool) -> int:
        snapshot = self.flat.clone()
        avg, n_active = self._mean_and_active(snapshot, active)
        desc = avg.sub_(self.start)
        self.delta.mul_(self.momentum).add_(desc, alpha=self.cfg.block_lr)
        self.global_params.add_(self.delta)
        self.start.copy_(self.global_params)
        if self.cfg.nesterov and n_active > 0:
            self.start.add_(self.delta, alpha=self.momentum)
        self.flat.add_(self.start - snapshot)  # delta write-back: keeps updates made during the all_reduce
        return n_active

    def state(self) -> dict[str, torch.Tensor]:
        return {"bmuf.global": self.global_params.clone(), "bmuf.start": self.start.clone(),
                "bmuf.delta": self.delta.clone()}

    def load_state(self, saved: dict[str, torch.Tensor]) -> None:
        if "bmuf.global" in saved:  # else start from the common point, as a fresh run
            self.global_params.copy_(torch.as_tensor(saved["bmuf.global"]))
            self.start.copy_(torch.as_tensor(saved["bmuf.start"]))
            self.delta.copy_(torch.as_tensor(saved["bmuf.delta"]))
