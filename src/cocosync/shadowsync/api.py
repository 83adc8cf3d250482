"""ShadowSync from Python: `train(model_factory, data, config)` runs the job of `cocosync train` on this machine for
your model (a factory every rank can import, or a built-in's name) and your data file, and returns its result;
`load_model(path)` gives an exported model back (export.py)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from cocosync.shadowsync.config import ClusterConfig, TrainConfig
from cocosync.shadowsync.job.launch import RunResult, run_training
from cocosync.shadowsync.model.factory import Factory, factory_spec

__all__ = ["train"]


def train(model_factory: Factory | str = "dlrm", data: str | os.PathLike = "synthetic",
          config: TrainConfig | None = None, *, cluster: ClusterConfig | None = None, **kw: Any) -> RunResult:
    """Train the model `model_factory` builds (`factory(inputs: ModelInputs) -> nn.Module`, defined at the top level
    of a module or script; or 'dlrm', 'dcn', 'deepfm') on `data` (a Parquet/CSV/Criteo file, or 'synthetic') with
    the settings of `config` (TrainConfig; default: its defaults). `kw`: run_training's (resume, checkpoint_every,
    stop_after, eval_every, console)."""
    cfg = dataclasses.replace(config or TrainConfig(), model_factory=factory_spec(model_factory), data=os.fspath(data))
    return run_training(cfg, cluster=cluster, **kw)
