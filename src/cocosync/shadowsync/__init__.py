"""ShadowSync (Zheng et al. 2020): a CTR model (DLRM) trained by Hogwild trainers whose embedding tables live on
parameter servers and whose dense parameters a background "shadow" thread synchronizes. One job, on one machine or
many (a single-machine run is the multi-machine job with one node), by layer:

* `data`: Criteo-format files and the synthetic teacher, the trainers' reader shards (`sources`) and the plan that
  moves unread rows onto another shard count at resume (`plan`);
* `model`: the DLRM, the tables' storage (`shard`: row hash, shards, the row update) and the client of them
  (`embeddings`: this node's shards read in place, other nodes' through the lookup exchange or RPC);
* `sync`: the dense sync algorithms (MA, BMUF, EASGD, DS-Sync; foreground or shadow);
* `job`: the roles of the torchrun ranks, the typed `Job` a rank builds once (`job`), one rank's job (`rank`), the
  trainer, the launcher and monitor of `cocosync train` on one machine, the eval curve;
* `checkpoint` (DCP, the one format, over the parts' state_dicts), `metrics`, every setting (`config`), the errors
  (`errors`) and the CLI (`cli`, its options generated from `config`).
"""

from typing import Any

from cocosync.shadowsync.config import ClusterConfig, DataConfig, ModelConfig, SyncConfig, SynthConfig, TrainConfig
from cocosync.shadowsync.model.inputs import Feature, ModelInputs
from cocosync.shadowsync.model.tables import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
)

__all__ = ["train", "export_model", "load_model", "TrainConfig", "SyncConfig", "ClusterConfig", "DataConfig",
           "ModelConfig", "SynthConfig", "EmbeddingBagCollection", "EmbeddingBagConfig",
           "KeyedJaggedTensor", "KeyedTensor", "JaggedTensor", "ModelInputs", "Feature"]


def __getattr__(name: str) -> Any:
    """`train`, `export_model` and `load_model` import the job (torch.distributed's launcher) when first used, so that
    a process that needs only the config or the table API does not."""
    if name == "train":
        from cocosync.shadowsync.api import train

        return train
    if name in ("export_model", "load_model"):
        from cocosync.shadowsync import export

        return getattr(export, name)
    raise AttributeError(f"module 'cocosync.shadowsync' has no attribute {name!r}")
