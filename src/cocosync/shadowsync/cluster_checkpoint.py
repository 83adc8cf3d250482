"""Checkpoints of a multi-machine ShadowSync job with torch.distributed.checkpoint (DCP).

Every rank saves its own part in one collective `dcp.save`: an embedding server its shard (weights, row-wise Adagrad
accumulator, row versions), a sync server its range of EASGD's centre, a trainer its dense replica, dense Adagrad
accumulator, BMUF state and reader positions. Trainer 0 adds `meta.json` (config, topology, examples seen). A
checkpoint is a directory `checkpoints/seen-<examples>` under the run's output; `checkpoints/latest` names the last
complete one (replaced atomically after every rank has written), so a crash while saving leaves the previous one.

Loading is collective too. On the same topology every rank reads back its own keys (exact resume). With another
number of embedding or sync servers each new server reads every old shard and keeps the rows the new row hash gives
it (a read amplification of the old server count, paid once at resume). With another number of trainers (or
workers) the unread rows of every old reader shard are planned onto the new shards (data_plan.py: every example
still read once), and every new trainer starts from the average of the old dense replicas and Adagrad
accumulators (what one model-averaging round would give them; BMUF's global state is the same on every trainer and
is taken from trainer 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from cocosync.shadowsync.param_server import RowHash, Shard
from cocosync.shadowsync.sync.center import center_bounds
from cocosync.shadowsync.train_config import ConfigError, TrainConfig, config_to_dict, resume_value

__all__ = ["CheckpointParts", "save_job", "load_job", "resolve", "read_meta", "check_resumable", "resharded_trainers",
           "read_positions"]

RESUME_KEYS = ("data", "examples", "seed", "batch_size", "model", "data_options", "embedding_optimizer")


@dataclass
class CheckpointParts:
    """What this rank owns: its embedding shard (server), centre range (sync server) or trainer state."""

    kind: str
    index: int
    shard: Shard | None = None
    center: torch.Tensor | None = None  # this sync server's range of the centre
    trainer: Any = None  # the Trainer (dense replica, accumulator, sync state, reader positions)
    trainer_state: dict | None = None  # a snapshot of it to save (Trainer.checkpoint_state)


def _trainer_tensors(trainer: Any, t: int) -> dict[str, torch.Tensor]:
    """The trainer's live tensors to load into, and buffers for its sync state (`_load_sync` hands them over)."""
    out = {f"trainer.{t}.flat": trainer.flat.flat, f"trainer.{t}.accumulator": trainer.accumulator,
           f"trainer.{t}.positions": trainer.state.positions[t]}
    out.update({f"trainer.{t}.{k}": torch.empty_like(v) for k, v in trainer.sync.state().items()})
    return out


def _load_sync(trainer: Any, loaded: dict[str, torch.Tensor], t: int) -> None:
    """Trainer t's sync state (BMUF's global model, start point and block momentum) from `loaded` into its sync
    algorithm (the class's tensors, or the compiled program's slices)."""
    prefix, names = f"trainer.{t}.", set(trainer.sync.state())  # (state(): collective across machines)
    trainer.sync.load_state({k[len(prefix):]: v for k, v in loaded.items()
                             if k.startswith(prefix) and k[len(prefix):] in names})


def _state_dict(parts: CheckpointParts) -> dict[str, torch.Tensor]:
    i = parts.index
    if parts.kind == "embedding":
        s = parts.shard
        return {f"emb.{i}.weight": s.weight, f"emb.{i}.accumulator": s.accumulator, f"emb.{i}.versions": s.versions}
    if parts.kind == "sync":
        return {f"center.{i}": parts.center}
    if parts.trainer_state is not None:
        return {f"trainer.{i}.{k}": v for k, v in parts.trainer_state.items()}
    return _trainer_tensors(parts.trainer, i)


def save_job(parts: CheckpointParts, root: Path, meta: dict | None, *, writer: int) -> Path:
    """Collective: every rank writes its part into root/checkpoints/seen-<N>; the writer (the rank holding `meta`:
    trainer 0) then points root/checkpoints/latest at it."""
    seen = [int(meta["examples_seen"]) if meta else -1]
    dist.broadcast_object_list(seen, src=writer)
    path = root / "checkpoints" / f"seen-{seen[0]}"
    dcp.save(_state_dict(parts), checkpoint_id=str(path))
    dist.barrier()  # every rank's files are written before `latest` points here
    if meta is not None:
        (path / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        tmp = root / "checkpoints" / "latest.tmp"
        tmp.write_text(path.name + "\n")
        os.replace(tmp, root / "checkpoints" / "latest")
    return path


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory from what a user names: the checkpoint itself, or a run directory (its latest)."""
    p = Path(path)
    if (p / "meta.json").is_file():
        return p
    latest = p / "checkpoints" / "latest"
    if latest.is_file():
        cand = p / "checkpoints" / latest.read_text().strip()
        if (cand / "meta.json").is_file():
            return cand
    raise ConfigError(f"resume={str(p)!r}: no checkpoint there (expected a directory with meta.json, or a run "
                      "directory with checkpoints/latest)")


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"resume={str(path)!r}: unreadable meta.json: {e}") from None


def check_resumable(meta: dict, cfg: TrainConfig, path: Path) -> None:
    """ConfigError naming the first setting that differs from the checkpoint's (reader positions and tables only
    mean something for the same data, budget and model)."""
    old, new = meta["config"], config_to_dict(cfg)
    for key in RESUME_KEYS:
        if resume_value(old, key) != resume_value(new, key):
            raise ConfigError(f"cannot resume {str(path)!r}: it was trained with {key}={old[key]!r}, this job has "
                              f"{key}={new[key]!r}")


def resharded_trainers(meta: dict, trainers: int, workers: int) -> bool:
    """Whether the job's reader shards differ from the checkpoint's (another trainer or worker count)."""
    return (meta["trainers"], meta["workers"]) != (trainers, workers)


def read_positions(path: Path, meta: dict) -> list[int]:
    """Every old reader shard's position, in shard order (trainer t's worker w is shard t * W + w). Collective."""
    T, W = meta["trainers"], meta["workers"]
    state = {f"trainer.{t}.positions": torch.zeros(W, dtype=torch.int64) for t in range(T)}
    dcp.load(state, checkpoint_id=str(path))
    return [int(p) for t in range(T) for p in state[f"trainer.{t}.positions"]]


def load_job(parts: CheckpointParts, path: Path, meta: dict, *, rowhash: RowHash, centre_numel: int,
             sync_servers: int, trainers: int) -> None:
    """Collective: fill this rank's part from the checkpoint (resharding servers or trainers when their count
    changed)."""
    S_old, C_old = meta["embedding_servers"], meta["sync_servers"]
    if parts.kind == "trainer" and resharded_trainers(meta, trainers, len(parts.trainer.state.positions[0])):
        _load_averaged_trainer(parts, path, meta)
        return
    if parts.kind == "embedding" and S_old != rowhash.servers:
        _load_resharded_shard(parts, path, meta, rowhash)
        return
    if parts.kind == "sync" and C_old != sync_servers:
        old = {f"center.{i}": torch.empty(hi - lo) for i, (lo, hi) in enumerate(center_bounds(centre_numel, C_old))}
        dcp.load(old, checkpoint_id=str(path))
        lo, hi = center_bounds(centre_numel, sync_servers)[parts.index]
        parts.center.copy_(torch.cat([old[f"center.{i}"] for i in range(C_old)])[lo:hi])
        return
    state = _state_dict(dataclasses.replace(parts, trainer_state=None))
    dcp.load(state, checkpoint_id=str(path))
    if parts.kind == "trainer":
        _load_sync(parts.trainer, state, parts.index)


def _load_resharded_shard(parts: CheckpointParts, path: Path, meta: dict, rowhash: RowHash) -> None:
    S_old, s_new, shard = meta["embedding_servers"], parts.index, parts.shard
    old_hash = RowHash(rowhash.total_rows, S_old)
    dim = shard.weight.shape[1]
    old = {}
    for s in range(S_old):
        n = old_hash.shard_rows(s)
        old.update({f"emb.{s}.weight": torch.empty(n, dim), f"emb.{s}.accumulator": torch.empty(n),
                    f"emb.{s}.versions": torch.empty(n, dtype=torch.int64)})
    dcp.load(old, checkpoint_id=str(path))
    for s in range(S_old):
        g = s + S_old * torch.arange(old_hash.shard_rows(s))  # the global rows of old shard s
        mine = g % rowhash.servers == s_new
        local = g[mine] // rowhash.servers
        shard.weight[local] = old[f"emb.{s}.weight"][mine]
        shard.accumulator[local] = old[f"emb.{s}.accumulator"][mine]
        shard.versions[local] = old[f"emb.{s}.versions"][mine]


def _load_averaged_trainer(parts: CheckpointParts, path: Path, meta: dict) -> None:
    """A trainer of a job with another trainer count: the mean of the old replicas and accumulators, BMUF's state
    from old trainer 0; its reader positions stay 0 (the data plan starts its shards afresh)."""
    trainer, T = parts.trainer, meta["trainers"]
    flat, acc = trainer.flat.flat, trainer.accumulator
    old = {}
    for t in range(T):
        old |= {f"trainer.{t}.flat": torch.empty_like(flat), f"trainer.{t}.accumulator": torch.empty_like(acc)}
    old |= {k: v for k, v in _trainer_tensors(trainer, 0).items() if ".bmuf." in k}
    dcp.load(old, checkpoint_id=str(path))
    flat.copy_(torch.stack([old[f"trainer.{t}.flat"] for t in range(T)]).mean(0))
    acc.copy_(torch.stack([old[f"trainer.{t}.accumulator"] for t in range(T)]).mean(0))
    _load_sync(trainer, old, 0)
