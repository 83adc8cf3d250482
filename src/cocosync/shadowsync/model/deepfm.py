"""DeepFM (Guo et al. 2017), a built-in model: a factorization machine over the features' vectors (their pairwise
dot products, summed: 0.5 * ((sum v)^2 - sum v^2)), a linear term over the dense features, and a deep MLP over the
dense features and every vector, added into one logit."""

from __future__ import annotations

import torch
from torch import nn

from cocosync.shadowsync.model.dlrm import mlp, output_bias
from cocosync.shadowsync.model.inputs import ModelInputs
from cocosync.shadowsync.model.tables import EmbeddingBagCollection, KeyedJaggedTensor

__all__ = ["DeepFM"]


class DeepFM(nn.Module):
    """forward(dense [B, num_dense], features KeyedJaggedTensor) -> logits [B]."""

    def __init__(self, inputs: ModelInputs):
        super().__init__()
        cfg = inputs.config
        self.dim = cfg.embedding_dim
        self.linear = nn.Linear(inputs.num_dense, 1)
        output_bias(self.linear, cfg.init_ctr)
        self.deep = mlp((inputs.num_dense + self.dim * len(inputs.features), *cfg.top_mlp, 1), last_relu=False)
        with torch.no_grad():
            self.deep[-1].bias.zero_()
        self.embeddings = EmbeddingBagCollection(inputs.tables(self.dim), init_std=cfg.embedding_init_std)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        flat = self.embeddings(features).values()
        v = flat.view(dense.shape[0], -1, self.dim)
        fm = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1, keepdim=True)
        return (self.linear(dense) + fm + self.deep(torch.cat([dense, flat], dim=1))).squeeze(1)
