"""The tests' reference tables: one plain [sum(rows), dim] tensor updated by `rowwise_update` row by row, which the
sharded tables (ShardedEmbeddings over Shards, local or remote) must equal."""

from __future__ import annotations

import torch

from cocosync.shadowsync.model.shard import rowwise_update


class ReferenceTables:
    def __init__(self, rows: list[int], dim: int, *, seed: int, optimizer: str = "adagrad", lr: float = 0.05,
                 init_std: float = 0.05):
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(sum(rows), dim, generator=gen).mul_(init_std)  # initial_rows's draw
        self.accumulator = torch.zeros(sum(rows))
        self.optimizer, self.lr, self.dim = optimizer, lr, dim
        offsets = [0, *torch.tensor(rows).cumsum(0)[:-1].tolist()]
        self.tables = [self.weight[o:o + r] for o, r in zip(offsets, rows)]

    def apply_rows(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Gradient rows of global rows `ids` (duplicates summed), as one Hogwild update."""
        uniq, inverse = torch.unique(ids, return_inverse=True)
        g = torch.zeros(uniq.numel(), self.dim).index_add_(0, inverse, grads)
        rowwise_update(self.weight, self.accumulator, uniq, g, self.optimizer, self.lr, 1e-8)
