"""A single-machine run's checkpoint.pt: written atomically (periodically with --checkpoint-every, and at the end),
read safely: torch.load with weights_only=True (tensors, containers and plain values only), so a crafted file cannot
run code; anything else is refused with a message naming the file.

It holds the model for scoring (`dense`: EASGD's centre or trainer 0's replica, and the embedding tables), and what an
exact resume needs: each trainer's replica, dense Adagrad accumulator and BMUF state (`trainers`), the embedding
tables' row-wise Adagrad accumulator and every worker shard's reader position."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import torch

from cocosync.shadowsync.train_config import ConfigError, TrainConfig, config_to_dict, resume_value

__all__ = ["CheckpointError", "read_checkpoint", "write_checkpoint", "check_resumable", "REQUIRED_KEYS"]

REQUIRED_KEYS = ("config", "dense", "embeddings", "positions")


class CheckpointError(ConfigError):
    """A checkpoint file is missing, empty, not a cocosync checkpoint, or holds something other than data."""


def read_checkpoint(path: str | os.PathLike) -> dict:
    """The checkpoint dict written by `cocosync train` (<out_dir>/checkpoint.pt), or CheckpointError."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"no checkpoint at {str(p)!r} (a run writes <out_dir>/checkpoint.pt)")
    if p.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {str(p)!r} is empty (0 bytes): the run that wrote it was cut off")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refuses globals it does not know: it never calls them
        found = re.search(r"(?:unsupported )?GLOBAL ([\w.]+)", str(e), re.IGNORECASE)
        if found is None:
            raise CheckpointError(f"cannot read checkpoint {str(p)!r}: not a torch checkpoint or corrupt") from None
        raise CheckpointError(f"refused to load {str(p)!r}: it holds an object ({found.group(1)}) that loading would "
                              "have to call; a cocosync checkpoint holds only tensors and plain values") from None
    except Exception as e:  # torch raises RuntimeError, EOFError, struct.error, ... for a damaged file
        raise CheckpointError(f"cannot read checkpoint {str(p)!r}: not a torch checkpoint or corrupt "
                              f"({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(ckpt, dict) or any(k not in ckpt for k in REQUIRED_KEYS):
        keys = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"{str(p)!r} is not a cocosync checkpoint: expected the keys {list(REQUIRED_KEYS)}, "
                              f"found {keys}")
    return ckpt


def write_checkpoint(path: Path, ckpt: dict) -> None:
    """torch.save to a temporary name, then rename: a reader (or a resume after a kill) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(ckpt, tmp)
    os.replace(tmp, path)


RESUME_KEYS = ("data", "examples", "trainers", "workers", "seed", "batch_size", "model", "data_options")


def check_resumable(ckpt: dict, cfg: TrainConfig, path: Path) -> None:
    """ConfigError naming the first setting that differs from the checkpoint's: reader positions only mean something
    for the same data, budget and shards. The sync algorithm may change (a new one starts its state from the
    checkpoint's model)."""
    old, new = ckpt["config"], config_to_dict(cfg)
    for key in RESUME_KEYS:
        if resume_value(old, key) != resume_value(new, key):
            raise ConfigError(f"cannot resume {str(path)!r}: it was trained with {key}={old[key]!r}, this run has "
                              f"{key}={new[key]!r} (the reader positions only mean something for the same data and "
                              "shards)")
    if ckpt["embeddings"]["optimizer"] != cfg.embedding_optimizer:
        raise ConfigError(f"cannot resume {str(path)!r}: embedding_optimizer {ckpt['embeddings']['optimizer']!r} "
                          f"!= {cfg.embedding_optimizer!r}")
