"""The eval NE curve of a run (dlrm's --test-freq) and, on one machine, its best-eval model.

Trainer 0 scores its own replica (with the shared tables, or rows from the servers) on the held-out set every
`--eval-every` examples while the workers keep training, and reports an `eval` record (examples, NE, AUC,
calibration). On one machine it also keeps the model of the lowest eval NE so far as <out>/best.pt: after several
passes a model overfits (train NE keeps falling while eval NE rises), and the checkpoint to keep is the best one,
not the last. best.pt holds the weights (dense replica, tables) in checkpoint.pt's format, so `cocosync eval` scores
it; it is not a resume point (no optimizer or sync state)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch

from cocosync.shadowsync.checkpoint import write_checkpoint
from cocosync.shadowsync.embeddings import SharedEmbeddings
from cocosync.shadowsync.metrics import evaluate
from cocosync.shadowsync.sources import build_configs
from cocosync.shadowsync.state import build_model
from cocosync.shadowsync.train_config import TrainConfig, config_to_dict

__all__ = ["score", "describe", "BestModelCurve", "BEST_NAME", "previous_best"]

BEST_NAME = "best.pt"


def score(model: torch.nn.Module, batches: list, seen: int) -> dict:
    """One point of the eval curve: `model` on the held-out `batches` after `seen` examples of the run."""
    ev = evaluate(model, batches)
    return {"event": "eval", "examples": seen, "eval_ne": ev["ne"], "auc": ev["auc"],
            "calibration": ev["calibration"]}


def previous_best(out: Path) -> float:
    """The eval NE of <out>/best.pt (a resumed run keeps an earlier session's best), inf when there is none."""
    path = out / BEST_NAME
    if not path.is_file():
        return math.inf
    try:
        return float(torch.load(path, map_location="cpu", weights_only=True)["eval"]["eval_ne"])
    except Exception:  # noqa: BLE001 - unreadable: the next eval replaces it
        return math.inf


def describe(rec: dict) -> str:
    best = " (best so far: kept as best.pt)" if rec.get("best") else ""
    return (f"eval at ~{rec['examples']:,} examples: NE {rec['eval_ne']:.4f}, AUC {rec['auc']:.4f}, "
            f"calibration {rec['calibration']:.3f}{best}")


class BestModelCurve:
    """Trainer 0's `on_eval` on one machine: copy the model (its dense replica and the shared tables, which Hogwild
    workers keep updating), score the copy, keep it as best.pt when its NE is the lowest so far, and report the
    record through `send`."""

    def __init__(self, cfg: TrainConfig, state: Any, batches: list, send: Callable[[dict], None]):
        self.cfg, self.state, self.batches, self.send = cfg, state, batches, send
        self.path = Path(cfg.out_dir) / BEST_NAME if cfg.checkpoint else None
        self.best = previous_best(Path(cfg.out_dir))
        self.trainer: Any = None  # set once the Trainer exists (it takes this callable at construction)
        self.copy: Any = None  # the scored model: a DLRM over tables of its own
        self.tables: SharedEmbeddings | None = None

    def _snapshot(self) -> tuple[dict, torch.Tensor]:
        dense = {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()
                 if not k.startswith("embeddings.")}
        if self.copy is None:
            data, model_cfg = build_configs(self.cfg)
            self.tables = SharedEmbeddings.from_state_dict(self.state.embeddings.state_dict())
            self.copy = build_model(data, model_cfg, self.tables)
        else:
            self.tables.weight.copy_(self.state.embeddings.weight)
        self.copy.load_state_dict(dense, strict=False)
        return dense, self.state.positions.clone()

    def __call__(self, examples: int) -> None:
        dense, positions = self._snapshot()
        rec = score(self.copy, self.batches, int(positions.sum()))  # the run's examples, resumed included
        if self.path is not None and rec["eval_ne"] < self.best:
            self.best = rec["eval_ne"]
            write_checkpoint(self.path, {"config": config_to_dict(self.cfg), "name": "best eval", "dense": dense,
                                         "embeddings": self.tables.state_dict(), "positions": positions, "eval": rec})
            rec["best"] = True
        self.send({"kind": "eval", **rec})
