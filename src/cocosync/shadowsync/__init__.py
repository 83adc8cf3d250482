"""ShadowSync (Zheng et al. 2020): a CTR model (DLRM) trained by Hogwild trainers whose embedding tables live on
parameter servers and whose dense parameters a background "shadow" thread synchronizes. One job, on one machine or
many (a single-machine run is the multi-machine job with one node), by layer:

* `data`: Criteo-format files and the synthetic teacher, the trainers' reader shards (`sources`) and the plan that
  moves unread rows onto another shard count at resume (`plan`);
* `model`: the DLRM and the embedding stores behind one client (`embeddings`: row-hash shards, this node's read in
  place, other nodes' over RPC);
* `sync`: the dense sync algorithms (MA, BMUF, EASGD, DS-Sync; foreground or shadow);
* `job`: the roles of the torchrun ranks, one rank's job (`rank`), the trainer, the launcher and monitor of
  `cocosync train` on one machine, the eval curve;
* `checkpoint` (DCP, the one format), `metrics`, the configs (`config`, `train_config`) and the CLI (`cli`).
"""

from cocosync.shadowsync.config import DataConfig, ModelConfig, SynthConfig

__all__ = ["DataConfig", "ModelConfig", "SynthConfig"]
