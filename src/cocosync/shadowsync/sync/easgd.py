"""Elastic averaging SGD (Zhang et al. 2015) against a central copy: the DSL program `easgd_program`
(programs/sync.py), compiled to one generated loop, on the same runtime as the collective algorithms.

    d         = alpha * (x_local - x_center)
    x_local  <- x_local  - d
    x_center <- x_center + d

No collective: each trainer talks only to the centre, lock-free, whenever it likes (Hogwild on the centre). On one
machine the centre is a tensor in shared memory and the trainer runs the program on its live replica and the centre
(each element read once and written once, in one pass: an update a worker makes meanwhile to an element is kept
unless it lands between that element's read and write). Across machines the centre is a `RemoteCenter` (sharded
over the sync servers, see center.py): each server runs the same program on its range of the trainer's snapshot
and sends the moved point back, which the trainer writes back as a delta (keeping its workers' updates).
"""

from __future__ import annotations

import torch

from cocosync.shadowsync.config import SyncConfig
from cocosync.shadowsync.sync.base import SyncAlgorithm
from cocosync.shadowsync.sync.center import RemoteCenter, easgd_step

__all__ = ["EASGD"]


class EASGD(SyncAlgorithm):
    name = "easgd"

    def __init__(self, flat: torch.Tensor, cfg: SyncConfig, *, center: torch.Tensor | RemoteCenter, trainers: int = 1):
        """`trainers`: the job's T, which sets alpha unless cfg.alpha is set (`SyncConfig.alpha_for`)."""
        super().__init__(flat, cfg)
        self.alpha = cfg.alpha_for(trainers)
        if isinstance(center, RemoteCenter):
            if center.numel != flat.numel():
                raise ValueError(f"EASGD remote center has {center.numel} elements, the dense buffer {flat.numel()}")
        elif center.shape != flat.shape or center.dtype != flat.dtype:
            raise ValueError(f"EASGD center {tuple(center.shape)}/{center.dtype} does not match the dense "
                             f"buffer {tuple(flat.shape)}/{flat.dtype}")
        else:
            self._step = easgd_step(flat.numel(), flat.dtype)
        self.center = center

    def _sync(self, active: bool) -> int:
        if isinstance(self.center, RemoteCenter):
            snapshot = self.flat.clone()
            moved = self.center.exchange(snapshot, self.alpha)  # x - d (it sends copies of the ranges)
            self.flat.add_(moved.sub_(snapshot))  # delta write-back
        else:
            self._step(x=self.flat, c=self.center, alpha=self.alpha)
        return int(active)
