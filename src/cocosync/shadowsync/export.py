"""A trained model out of the job: `export_model` writes the model as its factory builds it, with its full tables, as
a plain PyTorch state_dict and the run's config (the factory, the data's schema: how raw rows become features);
`load_model` builds it again without any of the job, and `Predictor` scores raw rows (a file, or rows in memory)
with the same hashing and dense transforms as training."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from cocosync.shadowsync.checkpoint import load_weights, read_meta, resolve
from cocosync.shadowsync.config import ConfigError, DataConfig, TrainConfig, config_from_dict, config_to_dict
from cocosync.shadowsync.data.criteo import CriteoReader
from cocosync.shadowsync.data.sources import build_configs, tabular_schema
from cocosync.shadowsync.data.tabular import TabularReader, column_names, data_format
from cocosync.shadowsync.job.eval_curve import BestModel
from cocosync.shadowsync.job.run_model import Scorer, scorer

__all__ = ["EXPORT_FILE", "export_model", "load_model", "Predictor", "predictor_of_checkpoint"]

EXPORT_FILE = "model.pt"
_FORMAT = 1


def _checkpoint_scorer(checkpoint: str | os.PathLike) -> tuple[Scorer, TrainConfig, DataConfig, dict]:
    path = resolve(checkpoint)
    meta = read_meta(path)
    cfg = config_from_dict(meta["config"])
    data, model_cfg = build_configs(cfg)
    best = BestModel(cfg, data, model_cfg, [], None, {})  # (as `cocosync eval` loads a checkpoint)
    table, flat = load_weights(path, meta, dim=best.scorer.run.plan.width, dense_params=best.flat.flat.numel())
    return best.load(flat, table), cfg, data, meta


class Predictor:
    """A trained model and the schema its rows are read with: `predict_file(path)` and `predict_rows(rows)` give
    click probabilities."""

    def __init__(self, model: Scorer, cfg: TrainConfig, data: DataConfig):
        self.scorer, self.cfg, self.data = model, cfg, data
        self.model = model.model  # the user's module, its tables full
        self.scorer.eval()

    @torch.no_grad()
    def _scores(self, batches: Any, labelled: bool) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        for b in batches:
            yield torch.sigmoid(self.scorer(b.dense, b.sparse)).numpy(), b.label.numpy() if labelled else None

    def has_label(self, path: str) -> bool:
        """Whether the file's rows carry the label (Criteo-format rows always do)."""
        schema = tabular_schema(self.data)
        return schema is None or schema.label in column_names(path)

    def batches_of_file(self, path: str, batch_size: int = 4096) -> Any:
        """The file's rows as this model's batches (Parquet/CSV: the label may be missing)."""
        schema = tabular_schema(self.data)
        if schema is None:
            if data_format(path) != "criteo":
                raise ConfigError(f"{path!r}: this model was trained on Criteo-format rows; score a file of that "
                                  "format")
            return CriteoReader(path, self.data, batch_size=batch_size)
        return TabularReader(path, schema, batch_size=batch_size, require_label=False)

    def predict_file(self, path: str, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """(probabilities, labels or None) per batch of the file's rows, in file order."""
        return self._scores(self.batches_of_file(path, batch_size), self.has_label(path))

    def predict_rows(self, rows: Any) -> np.ndarray:
        """Probabilities of raw rows in memory (a pyarrow.Table or {column: values}; Parquet/CSV-trained models)."""
        schema = tabular_schema(self.data)
        if schema is None:
            raise ConfigError("predict_rows takes named columns: this model was trained on Criteo-format rows "
                              "(use predict_file)")
        parts = [p for p, _ in self._scores(TabularReader.of_rows(rows, schema), False)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def predictor_of_checkpoint(checkpoint: str | os.PathLike) -> Predictor:
    """The model of a checkpoint (or a run directory's latest) ready to score."""
    model, cfg, data, _ = _checkpoint_scorer(checkpoint)
    return Predictor(model, cfg, data)


def export_model(checkpoint: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the checkpoint's model to `out`/model.pt: its state_dict (full tables) and the run's config."""
    model, cfg, _, meta = _checkpoint_scorer(checkpoint)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / EXPORT_FILE
    payload = {"format": _FORMAT, "config": config_to_dict(cfg), "examples_seen": int(meta["examples_seen"]),
               "state_dict": {k: v.detach().clone() for k, v in model.model.state_dict().items()}}
    tmp = target.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, target)
    return target


def load_model(path: str | os.PathLike) -> Predictor:
    """An exported model (a directory holding model.pt, or the file): the factory's module with its state_dict."""
    p = Path(path)
    p = p / EXPORT_FILE if p.is_dir() else p
    if not p.is_file():
        raise ConfigError(f"{str(path)!r}: no exported model there (expected {EXPORT_FILE} written by cocosync export)")
    try:
        raw = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (any unreadable file: one line naming it)
        raise ConfigError(f"{str(p)!r}: not an exported model ({type(e).__name__}: {e})") from None
    found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
    if found != _FORMAT:
        raise ConfigError(f"{str(p)!r}: not an exported model of this cocosync (format {found!r}, expected "
                          f"{_FORMAT}: export it again with `cocosync export RUN OUT`)")
    cfg = config_from_dict(raw["config"])
    data, model_cfg = build_configs(cfg)
    model = scorer(cfg, data, model_cfg)
    model.model.load_state_dict(raw["state_dict"])
    return Predictor(model, cfg, data)
