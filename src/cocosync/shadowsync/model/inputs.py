"""What a model factory is given: the data's dense columns and categorical features (each with the table rows the
data needs and whether it holds lists) and the run's model settings. A factory is any callable
`factory(inputs: ModelInputs) -> torch.nn.Module` whose module takes `forward(dense [B, num_dense],
features: KeyedJaggedTensor)` and returns one logit per row."""

from __future__ import annotations

from dataclasses import dataclass

from cocosync.shadowsync.config import ModelConfig
from cocosync.shadowsync.model.tables import EmbeddingBagConfig

__all__ = ["Feature", "ModelInputs"]


@dataclass(frozen=True)
class Feature:
    """A categorical input: its name, the rows its table needs (ids are in [0, rows)), whether a row holds a list."""

    name: str
    rows: int
    multi_valued: bool = False


@dataclass(frozen=True)
class ModelInputs:
    """The inputs of a run's model."""

    dense: tuple[str, ...]
    features: tuple[Feature, ...]
    config: ModelConfig

    @property
    def num_dense(self) -> int:
        return len(self.dense)

    def feature(self, name: str) -> Feature:
        for f in self.features:
            if f.name == name:
                return f
        raise KeyError(f"no categorical feature {name!r}; the data's features are {[f.name for f in self.features]}")

    def tables(self, dim: int, pooling: str = "sum") -> list[EmbeddingBagConfig]:
        """One table per feature, named after it, `dim` wide, of the rows the feature needs."""
        return [EmbeddingBagConfig(f"t_{f.name}", f.rows, dim, (f.name,), pooling) for f in self.features]
