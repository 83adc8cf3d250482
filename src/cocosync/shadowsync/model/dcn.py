"""DCN-v2 (Wang et al. 2021) as TorchRec's DLRM_DCN, a built-in model: the bottom MLP's output and every pooled
vector concatenated, a low-rank cross network over them (x_{l+1} = x_0 * (W_l V_l x_l + b_l) + x_l), top MLP."""

from __future__ import annotations

import torch
from torch import nn

from cocosync.shadowsync.model.dlrm import mlp, output_bias
from cocosync.shadowsync.model.inputs import ModelInputs
from cocosync.shadowsync.model.tables import EmbeddingBagCollection, KeyedJaggedTensor

__all__ = ["DCN", "LowRankCrossNet"]


class LowRankCrossNet(nn.Module):
    """`layers` cross layers of rank `rank` over `width` inputs (TorchRec's LowRankCrossNet)."""

    def __init__(self, width: int, layers: int = 3, rank: int = 16):
        super().__init__()
        self.V = nn.ModuleList(nn.Linear(width, rank, bias=False) for _ in range(layers))
        self.W = nn.ModuleList(nn.Linear(rank, width) for _ in range(layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for v, w in zip(self.V, self.W):
            x = x0 * w(v(x)) + x
        return x


class DCN(nn.Module):
    """forward(dense [B, num_dense], features KeyedJaggedTensor) -> logits [B]."""

    def __init__(self, inputs: ModelInputs, *, cross_layers: int = 3, rank: int = 16):
        super().__init__()
        cfg = inputs.config
        dim = cfg.embedding_dim
        self.bottom = mlp((inputs.num_dense, *cfg.bottom_mlp), last_relu=True)
        width = cfg.bottom_mlp[-1] + dim * len(inputs.features)
        self.cross = LowRankCrossNet(width, cross_layers, rank)
        self.top = mlp((width, *cfg.top_mlp, 1), last_relu=False)
        output_bias(self.top[-1], cfg.init_ctr)
        self.embeddings = EmbeddingBagCollection(inputs.tables(dim), init_std=cfg.embedding_init_std)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        x = torch.cat([self.bottom(dense), self.embeddings(features).values()], dim=1)
        return self.top(self.cross(x)).squeeze(1)
