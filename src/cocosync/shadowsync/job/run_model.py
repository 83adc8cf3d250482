"""A run's model: the factory of `TrainConfig.model_factory` built for the data's inputs, its tables planned
(model/sharding.py) and, for training, swapped for the job's stores; for scoring, the same model with the full tables
and a dense state loaded. The batches' categorical features are put in the tables' order here (`features`)."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn

from cocosync.shadowsync.config import ConfigError, DataConfig, ModelConfig, TrainConfig
from cocosync.shadowsync.data.sources import model_inputs
from cocosync.shadowsync.model.factory import build_model
from cocosync.shadowsync.model.inputs import ModelInputs
from cocosync.shadowsync.model.sharding import TablePlan, load_tables, shard_model, table_weights
from cocosync.shadowsync.model.tables import KeyedJaggedTensor, tables_on_meta
from cocosync.shadowsync.sync import FlatParams

__all__ = ["RunModel", "run_model", "dense_parameters", "Scorer", "scorer"]


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters outside the model's tables, in module order (what the sync averages; one flat vector)."""
    tables = {id(w) for w in table_weights(model).values()}
    return [p for p in model.parameters() if id(p) not in tables and p.requires_grad]


@dataclass(frozen=True)  # (not slots: the cached keys)
class RunModel:
    """The model of a run (`sharded`: its collections swapped for the job's stores), its tables' plan, its inputs."""

    model: nn.Module
    plan: TablePlan
    inputs: ModelInputs

    def dense_parameters(self) -> list[nn.Parameter]:
        return dense_parameters(self.model)

    @functools.cached_property
    def _data_keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.inputs.features)

    def features(self, sparse: torch.Tensor | KeyedJaggedTensor) -> KeyedJaggedTensor:
        """A batch's categorical features ([B, F] ids in the data's order, or a KeyedJaggedTensor) in the order of
        the model's tables."""
        kjt = KeyedJaggedTensor.from_dense(self._data_keys, sparse) if isinstance(sparse, torch.Tensor) else sparse
        want = self.plan.features
        if kjt.keys() == want:
            return kjt
        if kjt.is_dense():
            index = [kjt.keys().index(f) for f in want]
            return KeyedJaggedTensor.from_dense(want, kjt.dense_ids()[:, index])
        parts = [kjt[f] for f in want]
        return KeyedJaggedTensor(want, torch.cat([p.values for p in parts]), torch.cat([p.lengths for p in parts]),
                                 stride=kjt.stride())


def run_model(cfg: TrainConfig, data: DataConfig, model_cfg: ModelConfig, *, sharded: bool = True) -> RunModel:
    """The run's model for its data, checked against the data (every table feature present, enough rows)."""
    inputs = model_inputs(cfg, data, model_cfg)
    with tables_on_meta() if sharded else contextlib.nullcontext():  # the stores hold the rows, not the model
        model = build_model(cfg.model_factory, inputs)
    plan = TablePlan.of(model)
    known = {f.name: f for f in inputs.features}
    for t in plan.tables:
        for name in t.features:
            if name not in known:
                raise ConfigError(f"model={cfg.model_factory!r}: table {t.name!r} serves feature {name!r}, which the "
                                  f"data does not have; its categorical features are {list(known)}")
            if t.rows < known[name].rows:
                raise ConfigError(f"model={cfg.model_factory!r}: table {t.name!r} has {t.rows:,} rows, but feature "
                                  f"{name!r} takes ids in [0, {known[name].rows:,}) (its rows from the data); give "
                                  f"the table at least {known[name].rows:,} rows, or fewer rows to the feature "
                                  "(--table-size)")
    if sharded:
        model, _ = shard_model(model)
    return RunModel(model, plan, inputs)


class Scorer(nn.Module):
    """A trained model as written (its own tables, full), scoring batches: forward(dense, sparse) -> logits."""

    def __init__(self, run: RunModel):
        super().__init__()
        self.run = run
        self.model = run.model

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor | KeyedJaggedTensor) -> torch.Tensor:
        return self.model(dense, self.run.features(sparse)).view(-1)


def scorer(cfg: TrainConfig, data: DataConfig, model_cfg: ModelConfig, flat: torch.Tensor | None = None,
           table: torch.Tensor | None = None) -> Scorer:
    """The run's model as written with the dense parameters `flat` and the whole row space `table` loaded."""
    run = run_model(cfg, data, model_cfg, sharded=False)
    if flat is not None:
        FlatParams(run.dense_parameters()).flat.copy_(flat)
    if table is not None:
        load_tables(run.model, run.plan, table)
    return Scorer(run)
