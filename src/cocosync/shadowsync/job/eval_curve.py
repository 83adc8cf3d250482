"""The eval NE curve of a run (dlrm's --test-freq) and its best-eval model.

Trainer 0 snapshots its dense replica and the tables (its node's shards copied in place, other nodes' shards
fetched whole), scores the snapshot on the held-out set every `--eval-every` examples while the workers keep
training, and logs an `eval` record (examples, NE, AUC, calibration). The snapshot of the lowest eval NE so far is
kept as <out>/checkpoints/best: after several passes a model overfits (train NE keeps falling while eval NE rises),
and the model to keep is the best one, not the last. `cocosync eval` scores it; it is not a resume point."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import torch

from cocosync.shadowsync.checkpoint import BEST, save_best
from cocosync.shadowsync.config import DataConfig, ModelConfig, TrainConfig
from cocosync.shadowsync.job.run_model import Scorer, scorer
from cocosync.shadowsync.metrics import evaluate
from cocosync.shadowsync.model.sharding import load_tables
from cocosync.shadowsync.sync import FlatParams

__all__ = ["score", "describe", "previous_best", "BestModel", "score_checkpoint"]


def score(model: torch.nn.Module, batches: list, seen: int) -> dict:
    """One point of the eval curve: `model` on the held-out `batches` after `seen` examples of the run."""
    ev = evaluate(model, batches)
    return {"event": "eval", "examples": seen, "eval_ne": ev["ne"], "auc": ev["auc"],
            "calibration": ev["calibration"]}


def previous_best(out: Path) -> float:
    """The eval NE of <out>/checkpoints/best (a resumed run keeps the best of the run it resumed), inf when none."""
    try:
        return float(json.loads((out / "checkpoints" / BEST / "meta.json").read_text())["eval"]["eval_ne"])
    except (OSError, ValueError, KeyError, TypeError):  # none, or unreadable: the next eval replaces it
        return math.inf


def describe(rec: dict) -> str:
    best = " (best so far: kept as checkpoints/best)" if rec.get("best") else ""
    return (f"eval at ~{rec['examples']:,} examples: NE {rec['eval_ne']:.4f}, AUC {rec['auc']:.4f}, "
            f"calibration {rec['calibration']:.3f}{best}")


class BestModel:
    """Scores snapshots of (dense parameters, tables) and keeps the best as checkpoints/best (when `out` is set)."""

    def __init__(self, cfg: TrainConfig, data: DataConfig, model_cfg: ModelConfig, batches: list, out: Path | None,
                 meta: dict):
        self.scorer = scorer(cfg, data, model_cfg)
        self.flat = FlatParams(self.scorer.run.dense_parameters())
        self.batches, self.out, self.meta = batches, out, meta
        self.best = previous_best(out) if out is not None else math.inf

    def load(self, flat: torch.Tensor, table: torch.Tensor) -> Scorer:
        """The model with this snapshot's dense parameters and tables."""
        self.flat.flat.copy_(flat)
        load_tables(self.scorer.model, self.scorer.run.plan, table)
        return self.scorer

    def score(self, flat: torch.Tensor, table: torch.Tensor, seen: int) -> dict:
        """The eval record of this snapshot, with best=True when it was kept as the best model."""
        rec = score(self.load(flat, table), self.batches, seen)
        self.keep(rec, flat, table)
        return rec

    def keep(self, rec: dict, flat: torch.Tensor, table: torch.Tensor) -> None:
        if self.out is not None and rec["eval_ne"] < self.best:
            self.best = rec["eval_ne"]
            save_best(self.out, {**self.meta, "examples_seen": rec["examples"], "eval": rec}, table, flat)
            rec["best"] = True


def score_checkpoint(checkpoint: str | os.PathLike, data: str | None = None, examples: int | None = None) -> dict:
    """A checkpoint of `cocosync train` (a checkpoint or run directory) scored on its run's held-out set, or on the
    Criteo-format file `data`: NE, AUC, calibration (and Bayes NE on synthetic data), its name and examples trained.
    ConfigError (CheckpointError) names the checkpoint when it cannot be read."""
    from cocosync.shadowsync.checkpoint import load_weights, read_meta, resolve
    from cocosync.shadowsync.config import config_from_dict
    from cocosync.shadowsync.data.sources import build_configs, eval_batches

    path = resolve(checkpoint)
    meta = read_meta(path)
    cfg = config_from_dict(meta["config"])
    data_cfg, model_cfg = build_configs(cfg)
    if examples is not None:
        data_cfg = dataclasses.replace(data_cfg, eval_rows=examples)
    if data is not None:
        data_cfg = dataclasses.replace(data_cfg, eval_path=data, eval_rows=examples or data_cfg.eval_rows)
    best = BestModel(cfg, data_cfg, model_cfg, [], None, {})
    table, dense = load_weights(path, meta, dim=best.scorer.run.plan.width, dense_params=best.flat.flat.numel())
    ev = evaluate(best.load(dense, table), eval_batches(cfg, data_cfg))
    ev["excess_ne"] = ev["ne"] - ev["bayes_ne"] if math.isfinite(ev["bayes_ne"]) else float("nan")
    name = "best eval" if meta.get("best") else f"{cfg.sync.algorithm} T={meta['trainers']}"
    return {"name": name, **ev, "trained_examples": int(meta["examples_seen"]), "path": str(path)}
