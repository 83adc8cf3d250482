"""DLRM (Naumov et al. 2019): bottom MLP on dense features, one EmbeddingBag per categorical feature,
pairwise dot interaction of all those vectors, top MLP, one logit.

The embedding tables are apart from the dense part, as ShadowSync needs: `dense_parameters()` are what the
sync algorithms average; `embeddings` (an nn.ModuleList of nn.EmbeddingBag) may wrap externally owned
weight tensors (e.g. in shared memory, updated Hogwild by several trainers) without copying them.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from cocosync.shadowsync.config import DataConfig, ModelConfig

__all__ = ["DLRM", "new_embedding_weights", "ServedModel", "FullTable"]


def new_embedding_weights(model: ModelConfig, data: DataConfig, *, seed: int | None = None) -> list[torch.Tensor]:
    """Freshly initialized embedding tables [size, dim] (float32), N(0, embedding_init_std^2), one per table.
    Deterministic in `seed` (default: model.seed). Put them in shared memory and pass to `DLRM(...)`."""
    g = torch.Generator().manual_seed(model.seed if seed is None else seed)
    return [
        torch.randn(size, model.embedding_dim, generator=g) * model.embedding_init_std
        for size in data.table_sizes
    ]


def _mlp(widths: Sequence[int], *, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """forward(dense float32 [B, num_dense], sparse int64 [B, num_sparse]) -> logits [B]."""

    def __init__(
        self,
        config: ModelConfig,
        data: DataConfig,
        *,
        embedding_weights: Sequence[torch.Tensor] | None = None,
        sparse: bool | None = None,
        external_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.config, self.data = config, data
        self.sparse = config.sparse_gradients if sparse is None else sparse
        g = torch.random.fork_rng(devices=[])
        with g:
            torch.manual_seed(config.seed)
            self.bottom = _mlp((data.num_dense, *config.bottom_mlp), last_relu=True)
            n = data.num_sparse + 1
            self.num_interactions = n * (n - 1) // 2
            self.top = _mlp((config.embedding_dim + self.num_interactions, *config.top_mlp, 1), last_relu=False)
        if config.init_ctr is not None:
            with torch.no_grad():
                self.top[-1].bias.fill_(math.log(config.init_ctr / (1 - config.init_ctr)))
        if external_embeddings:  # the rows come from parameter servers: forward_pooled(dense, vectors)
            self.embeddings = nn.ModuleList()
        else:
            if embedding_weights is None:
                embedding_weights = new_embedding_weights(config, data)
            self._check_weights(embedding_weights)
            self.embeddings = nn.ModuleList(
                nn.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", sparse=self.sparse)
                for w in embedding_weights
            )
        rows, cols = torch.triu_indices(n, n, offset=1)
        # the pairs as positions in the flattened [n, n] products: index_select's backward is one index_add_, where
        # indexing [:, rows, cols] ran index_put_ with accumulate element by element (fwd+bwd 538 vs 937 us at
        # B=256, n=27, dim=16; the same bits)
        self.register_buffer("_pairs", rows * n + cols, persistent=False)

    def _check_weights(self, weights: Sequence[torch.Tensor]) -> None:
        sizes, dim = self.data.table_sizes, self.config.embedding_dim
        if len(weights) != len(sizes):
            raise ValueError(f"DLRM: got {len(weights)} embedding weights, expected one per table ({len(sizes)})")
        for t, (w, size) in enumerate(zip(weights, sizes)):
            if not isinstance(w, torch.Tensor) or tuple(w.shape) != (size, dim) or not w.is_floating_point():
                got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
                raise ValueError(f"DLRM: embedding_weights[{t}] is {got}, expected a float tensor of shape "
                                 f"{(size, dim)}")

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters of the bottom and top MLPs (what ShadowSync synchronizes)."""
        return [*self.bottom.parameters(), *self.top.parameters()]

    def embedding_parameters(self) -> list[nn.Parameter]:
        """The embedding tables' weights, one [table_size, dim] parameter per categorical feature."""
        return [e.weight for e in self.embeddings]

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        if dense.dim() != 2 or dense.shape[1] != self.data.num_dense:
            raise ValueError(f"DLRM: dense has shape {tuple(dense.shape)}, expected [B, {self.data.num_dense}]")
        if sparse.dim() != 2 or sparse.shape[1] != self.data.num_sparse or sparse.shape[0] != dense.shape[0]:
            raise ValueError(
                f"DLRM: sparse has shape {tuple(sparse.shape)}, expected [{dense.shape[0]}, {self.data.num_sparse}]"
            )
        if not self.embeddings:
            raise ValueError("DLRM(external_embeddings=True) has no tables: call forward_pooled(dense, vectors)")
        x = self.bottom(dense)
        vectors = [x] + [emb(sparse[:, t : t + 1]) for t, emb in enumerate(self.embeddings)]
        return self._interact(x, torch.stack(vectors, dim=1))

    def forward_pooled(self, dense: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
        """Logits from the dense features and the already looked-up embedding vectors [B, num_sparse, dim] (one row
        per feature, e.g. fetched from parameter servers)."""
        x = self.bottom(dense)
        return self._interact(x, torch.cat([x.unsqueeze(1), vectors], dim=1))

    def _interact(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """t: [B, 1 + num_sparse, dim], the bottom MLP's output first."""
        z = torch.bmm(t, t.transpose(1, 2)).flatten(1).index_select(1, self._pairs)  # [B, pairs]
        return self.top(torch.cat([x, z], dim=1)).squeeze(1)


class FullTable:
    """Whole tables [rows, dim] in global row order (tables concatenated) with the `lookup` of the parameter servers'
    client: what a checkpoint or a snapshot holds, scored without servers."""

    def __init__(self, weight: torch.Tensor, table_rows: Sequence[int]):
        self.weight = weight
        self.offsets = torch.tensor([0, *torch.tensor(list(table_rows)).cumsum(0)[:-1].tolist()], dtype=torch.int64)

    def lookup(self, sparse: torch.Tensor) -> torch.Tensor:
        return self.weight[sparse + self.offsets]


class ServedModel(nn.Module):
    """forward(dense, sparse) of a DLRM whose rows come from `tables.lookup` (the servers, or a FullTable)."""

    def __init__(self, model: DLRM, tables: object):
        super().__init__()
        self.model, self.tables = model, tables

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.model.forward_pooled(dense, self.tables.lookup(sparse))
