"""DLRM (Naumov et al. 2019), a built-in model: bottom MLP on the dense features, one table per categorical feature
(an EmbeddingBagCollection), pairwise dot interaction of the bottom MLP's output and every pooled vector, top MLP, one
logit. Every table has the width `embedding_dim`, which is also the bottom MLP's output width."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from cocosync.shadowsync.model.inputs import ModelInputs
from cocosync.shadowsync.model.tables import EmbeddingBagCollection, KeyedJaggedTensor

__all__ = ["DLRM", "mlp", "output_bias"]


def mlp(widths: Sequence[int], *, last_relu: bool) -> nn.Sequential:
    """Linear layers of `widths` with a ReLU after each (after the last too when `last_relu`)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


@torch.no_grad()
def output_bias(layer: nn.Linear, init_ctr: float | None) -> None:
    """Start the output at logit(init_ctr): step 0 predicts a plausible click rate."""
    if init_ctr is not None:
        layer.bias.fill_(math.log(init_ctr / (1 - init_ctr)))


class DLRM(nn.Module):
    """forward(dense float32 [B, num_dense], features KeyedJaggedTensor) -> logits [B]."""

    def __init__(self, inputs: ModelInputs):
        super().__init__()
        cfg = inputs.config
        dim = cfg.embedding_dim
        if cfg.bottom_mlp[-1] != dim:
            raise ValueError(f"DLRM: bottom_mlp={cfg.bottom_mlp!r} must end in embedding_dim={dim} (its output is "
                             "dotted with the embeddings)")
        self.bottom = mlp((inputs.num_dense, *cfg.bottom_mlp), last_relu=True)
        n = len(inputs.features) + 1
        self.num_interactions = n * (n - 1) // 2
        self.top = mlp((dim + self.num_interactions, *cfg.top_mlp, 1), last_relu=False)
        output_bias(self.top[-1], cfg.init_ctr)
        self.embeddings = EmbeddingBagCollection(inputs.tables(dim), init_std=cfg.embedding_init_std)
        rows, cols = torch.triu_indices(n, n, offset=1)
        # the pairs as positions in the flattened [n, n] products: index_select's backward is one index_add_, where
        # indexing [:, rows, cols] ran index_put_ with accumulate element by element (fwd+bwd 538 vs 937 us at
        # B=256, n=27, dim=16; the same bits)
        self.register_buffer("_pairs", rows * n + cols, persistent=False)
        self.dim = dim

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = self.embeddings(features).values().view(dense.shape[0], -1, self.dim)  # [B, F, dim]
        t = torch.cat([x.unsqueeze(1), pooled], dim=1)
        z = torch.bmm(t, t.transpose(1, 2)).flatten(1).index_select(1, self._pairs)  # [B, pairs]
        return self.top(torch.cat([x, z], dim=1)).squeeze(1)
