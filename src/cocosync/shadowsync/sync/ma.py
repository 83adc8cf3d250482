"""Model averaging: x <- mean over trainers of x (one all_reduce, divided by T)."""

from __future__ import annotations

from cocosync.shadowsync.sync.base import SyncAlgorithm

__all__ = ["ModelAveraging"]


class ModelAveraging(SyncAlgorithm):
    name = "ma"
    collective = True

    def _sync(self, active: bool) -> int:
        snapshot = self.flat.clone()
        mean, n_active = self._mean_and_active(snapshot, active)
        self.flat.add_(mean.sub_(snapshot))  # delta write-back: keeps updates made during the all_reduce
        return n_active
