"""Elastic averaging SGD (Zhang et al. 2015) against a central copy in shared memory (the single-node sync PS).

    diff      = x_local - x_center              (both read once: the snapshot)
    x_local  <- x_local  - alpha * diff
    x_center <- x_center + alpha * diff

No collective: each trainer talks only to the center, lock-free, whenever it likes (Hogwild on the center).
Across machines the centre is a `RemoteCenter` (sharded over the sync servers, see center.py): the server computes
diff for its range and moves its centre in the same round trip.
"""

from __future__ import annotations

import torch

from cocosync.shadowsync.sync.base import SyncAlgorithm
from cocosync.shadowsync.sync.center import RemoteCenter
from cocosync.shadowsync.train_config import SyncConfig

__all__ = ["EASGD"]


class EASGD(SyncAlgorithm):
    name = "easgd"

    def __init__(self, flat: torch.Tensor, cfg: SyncConfig, *, center: torch.Tensor | RemoteCenter):
        super().__init__(flat, cfg)
        if isinstance(center, RemoteCenter):
            if center.numel != flat.numel():
                raise ValueError(f"EASGD remote center has {center.numel} elements, the dense buffer {flat.numel()}")
        elif center.shape != flat.shape or center.dtype != flat.dtype:
            raise ValueError(f"EASGD center {tuple(center.shape)}/{center.dtype} does not match the dense "
                             f"buffer {tuple(flat.shape)}/{flat.dtype}")
        self.center = center

    def _sync(self, active: bool) -> int:
        if isinstance(self.center, RemoteCenter):
            self.flat.sub_(self.center.exchange(self.flat.clone(), self.cfg.alpha))
            return int(active)
        diff = self.flat.clone().sub_(self.center).mul_(self.cfg.alpha)  # alpha * (x_local - x_center)
        self.flat.sub_(diff)
        self.center.add_(diff)
        return int(active)
