"""make_sync: the sync algorithm a SyncConfig names (kept apart from base.py, which the algorithms import)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cocosync.shadowsync.config import SyncConfig
from cocosync.shadowsync.sync.base import DenseGroup, NoSync, SyncAlgorithm
from cocosync.shadowsync.sync.bmuf import BMUF
from cocosync.shadowsync.sync.compiled import CompiledSync, NotOnOneMachine
from cocosync.shadowsync.sync.dssync import DSSync
from cocosync.shadowsync.sync.easgd import EASGD
from cocosync.shadowsync.sync.ma import ModelAveraging

__all__ = ["make_sync", "changes_nothing_alone"]


def changes_nothing_alone(cfg: SyncConfig) -> bool:
    """Whether the algorithm leaves a lone trainer's replica as it is: MA and DS-Sync average one replica; BMUF with
    block momentum 0 (its default at T=1) and block lr 1 moves the global model onto it. (Run anyway, a background
    round would rewrite the replica with its rounding, at times set by a thread: not reproducible.) EASGD's
    elastic pull towards its centre is a real change."""
    if cfg.method in ("ma", "dssync"):
        return True
    return cfg.method == "bmuf" and cfg.momentum_for(1) == 0.0 and cfg.block_lr == 1.0


def make_sync(flat: torch.Tensor, cfg: SyncConfig, *, center: torch.Tensor | None = None,
              group: dist.ProcessGroup | DenseGroup | None = None, trainers: int | None = None) -> SyncAlgorithm:
    """The algorithm named by cfg.method (mode-independent: shadow vs foreground is the caller's loop); with
    `trainers` = 1, NoSync where the algorithm would change nothing (a T=1 run is then reproducible)."""
    if cfg.method == "none" or (trainers == 1 and changes_nothing_alone(cfg)):
        return NoSync(flat, cfg)
    if cfg.method == "easgd":
        if center is None:
            raise ValueError("EASGD needs the shared central copy (center=...)")
        return EASGD(flat, cfg, center=center, trainers=trainers or 1)
    if cfg.method in ("ma", "bmuf"):
        plain = cfg.compiled and not isinstance(group, DenseGroup) and dist.is_initialized()
        if plain and dist.get_world_size(group) > 1:
            try:  # the compiled program on shared memory (sync/compiled.py)
                return CompiledSync(flat, cfg, group)
            except NotOnOneMachine:  # every trainer finds the same: they all fall back
                pass
        return (BMUF if cfg.method == "bmuf" else ModelAveraging)(flat, cfg, group=group)
    if cfg.method == "dssync":
        return DSSync(flat, cfg, group=group)
    raise ValueError(f"unknown sync method {cfg.method!r}")

