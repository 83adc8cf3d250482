"""What a ShadowSync run shares among its trainer processes, and how it is built: the embedding tables, the EASGD
centre, the reader positions and counters, the common dense starting point (all shared-memory tensors created by
the launcher before it spawns the trainers), and the model a trainer builds around them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cocosync.shadowsync.config import DataConfig, ModelConfig
from cocosync.shadowsync.embeddings import SharedEmbeddings
from cocosync.shadowsync.model import DLRM
from cocosync.shadowsync.sync import FlatParams
from cocosync.shadowsync.train_config import TrainConfig

__all__ = ["SharedState", "new_embeddings", "build_model", "build_shared_state"]


@dataclass
class SharedState:
    """What the parent shares with every trainer (all shared-memory tensors, created before spawning)."""

    embeddings: SharedEmbeddings | None  # None: the tables live on parameter servers (multi-node)
    center: torch.Tensor | None  # EASGD central copy of the dense parameters
    positions: torch.Tensor  # int64 [T, W]: rows consumed by each worker shard (the reader position)
    iterations: torch.Tensor  # int64 [T]: worker iterations of each trainer
    syncs: torch.Tensor  # int64 [T]: syncs of each trainer
    stop: torch.Tensor  # int32 [1]: set by the parent (Ctrl-C, failure) -> trainers finish now
    go: torch.Tensor  # int32 [1]: set by the parent once every trainer is built -> all start together
    init_dense: torch.Tensor  # the common starting point of every dense replica (fresh init or a checkpoint)
    heartbeat: torch.Tensor  # float64 [T]: time.monotonic() of each trainer's last heartbeat (0: not started)
    done: torch.Tensor  # int32 [T]: set once every worker of a trainer has finished (it reaches no more marks)
    released: torch.Tensor  # int64 [1]: the last checkpoint mark the launcher has written (or let pass)

    @classmethod
    def create(cls, cfg: TrainConfig, embeddings: SharedEmbeddings, init_flat: torch.Tensor) -> "SharedState":
        T, W = cfg.trainers, cfg.workers
        center = init_flat.clone().share_memory_() if cfg.sync.method == "easgd" else None
        return cls(embeddings.share_memory_(), center, torch.zeros(T, W, dtype=torch.int64).share_memory_(),
                   torch.zeros(T, dtype=torch.int64).share_memory_(), torch.zeros(T, dtype=torch.int64).share_memory_(),
                   torch.zeros(1, dtype=torch.int32).share_memory_(), torch.zeros(1, dtype=torch.int32).share_memory_(),
                   init_flat.clone().share_memory_(), torch.zeros(T, dtype=torch.float64).share_memory_(),
                   torch.zeros(T, dtype=torch.int32).share_memory_(), torch.zeros(1, dtype=torch.int64).share_memory_())

    @classmethod
    def private(cls, cfg: TrainConfig, init_flat: torch.Tensor) -> "SharedState":
        """The counters of one trainer process of a multi-node job (nothing shared: its peers are other processes
        of other launchers, reached through torch.distributed)."""
        T, W = cfg.trainers, cfg.workers
        return cls(None, None, torch.zeros(T, W, dtype=torch.int64), torch.zeros(T, dtype=torch.int64),
                   torch.zeros(T, dtype=torch.int64), torch.zeros(1, dtype=torch.int32),
                   torch.ones(1, dtype=torch.int32), init_flat.clone(), torch.zeros(T, dtype=torch.float64),
                   torch.zeros(T, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))


def new_embeddings(cfg: TrainConfig, data: DataConfig, model: ModelConfig) -> SharedEmbeddings:
    """The embedding tables of a run (shared by every trainer), freshly initialized."""
    return SharedEmbeddings(data.table_sizes, model.embedding_dim, optimizer=cfg.embedding_optimizer,
                            lr=cfg.embedding_lr, init_std=model.embedding_init_std, seed=model.seed,
                            weight_decay=cfg.embedding_weight_decay)


def build_model(data: DataConfig, model: ModelConfig, embeddings: SharedEmbeddings) -> DLRM:
    """A DLRM whose embedding bags read the shared tables (sparse gradients)."""
    return DLRM(model, data, embedding_weights=embeddings.tables, sparse=True)


def build_shared_state(cfg: TrainConfig, data: DataConfig, model_cfg: ModelConfig,
                       checkpoint: dict | None = None) -> tuple[DLRM, FlatParams, SharedState]:
    """The launcher's model (for the final evaluation), its flat dense parameters and the shared state, fresh or
    from a checkpoint's weights and reader positions."""
    embeddings = new_embeddings(cfg, data, model_cfg)
    if checkpoint is not None:
        embeddings.weight.copy_(checkpoint["embeddings"]["weight"])
        embeddings.accumulator.copy_(checkpoint["embeddings"]["accumulator"])
    model = build_model(data, model_cfg, embeddings)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["dense"], strict=False)
    flat = FlatParams(model.dense_parameters())
    state = SharedState.create(cfg, embeddings, flat.flat)
    if checkpoint is not None:
        state.positions.copy_(checkpoint["positions"])
    return model, flat, state
