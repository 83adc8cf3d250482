"""Embedding tables in shared memory, shared by every trainer process and updated with lock-free sparse rows.

This is the single-node form of ShadowSync's embedding parameter servers: all tables live in ONE shared
buffer `[sum(rows), dim]` (plus one row-wise Adagrad accumulator per row), created by the parent with
`share_memory_()` before the trainers are spawned. Under torch's default `file_descriptor` sharing strategy
the segment is unlinked as soon as it is created, so no name ever appears in /dev/shm and nothing can be
left behind by a crash or a kill: the memory goes away with the last process holding the descriptor.

Updates are Hogwild: `apply_rows(table, ids, grads)` sums duplicate ids, then applies SGD or row-wise Adagrad
(one accumulator per row: acc += mean(g^2); w -= lr * g / (sqrt(acc) + eps), as FBGEMM's rowwise Adagrad)
with in-place index ops, without locks, from any worker of any trainer. `weight_decay` is row-wise L2 on the rows a
batch touches (g += wd * w before the update: FBGEMM's TBE weight_decay_mode=L2).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["SharedEmbeddings", "rowwise_update", "OPTIMIZERS"]

OPTIMIZERS = ("adagrad", "sgd")


@torch.no_grad()
def rowwise_update(weight: torch.Tensor, accumulator: torch.Tensor, rows: torch.Tensor, g: torch.Tensor,
                   optimizer: str, lr: float, eps: float, weight_decay: float = 0.0) -> None:
    """Apply the gradient rows `g[i]` to the distinct rows `rows[i]` of `weight`, in place and lock-free (Hogwild):
    SGD, or row-wise Adagrad with one accumulator per row (acc += mean(g^2); w -= lr * g / (sqrt(acc) + eps)).
    weight_decay: L2 on the touched rows, g += wd * w first. `g` is consumed (scaled in place). The one definition
    for local tables and parameter-server shards."""
    if weight_decay:
        g.add_(weight.index_select(0, rows), alpha=weight_decay)
    if optimizer == "sgd":
        weight.index_add_(0, rows, g, alpha=-lr)
        return
    accumulator.index_add_(0, rows, g.pow(2).mean(1))
    scale = accumulator.index_select(0, rows).sqrt_().add_(eps).reciprocal_().mul_(-lr)
    weight.index_add_(0, rows, g.mul_(scale.unsqueeze(1)))


class SharedEmbeddings:
    """`len(rows)` tables of `dim` columns, one shared buffer; `tables[t]` is a `[rows[t], dim]` view."""

    def __init__(self, rows: Sequence[int], dim: int, *, optimizer: str = "adagrad", lr: float = 0.05,
                 eps: float = 1e-8, init_std: float = 0.05, seed: int = 0, weight_decay: float = 0.0):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"embedding optimizer={optimizer!r} is invalid: expected one of {OPTIMIZERS}")
        if not rows or any(int(r) < 1 for r in rows) or dim < 1:
            raise ValueError(f"embedding tables need rows >= 1 and dim >= 1, got rows={list(rows)}, dim={dim}")
        if not lr > 0:
            raise ValueError(f"embedding lr={lr!r} is invalid: expected a number > 0")
        self.rows, self.dim = [int(r) for r in rows], int(dim)
        if not weight_decay >= 0:
            raise ValueError(f"embedding weight_decay={weight_decay!r} is invalid: expected a number >= 0")
        self.optimizer, self.lr, self.eps, self.weight_decay = optimizer, float(lr), float(eps), float(weight_decay)
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(sum(self.rows), self.dim, generator=gen).mul_(init_std)
        self.accumulator = torch.zeros(sum(self.rows))
        self._make_views()

    def _make_views(self) -> None:
        self.offsets = [0]
        for r in self.rows[:-1]:
            self.offsets.append(self.offsets[-1] + r)
        self.tables = [self.weight[o:o + r] for o, r in zip(self.offsets, self.rows)]

    # -- sharing ---------------------------------------------------------------------------------------
    def share_memory_(self) -> "SharedEmbeddings":
        """Move the buffers to shared memory (call in the parent, before spawning trainers)."""
        self.weight.share_memory_()
        self.accumulator.share_memory_()
        self._make_views()
        return self

    def is_shared(self) -> bool:
        return self.weight.is_shared() and self.accumulator.is_shared()

    def __getstate__(self) -> dict:
        # tensors pickle through torch's multiprocessing reductions (shared storage, not a copy)
        return {k: getattr(self, k) for k in ("rows", "dim", "optimizer", "lr", "eps", "weight_decay", "weight",
                                              "accumulator")}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._make_views()

    # -- updates ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def apply_rows(self, table: int, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Apply the gradient rows `grads[i]` of rows `ids[i]` of `table` (ids may repeat: they are summed).
        Table 0 with ids offset by `offsets[t]` addresses any row of the whole buffer."""
        if ids.numel() == 0:
            return
        uniq, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        g = torch.zeros(uniq.numel(), self.dim, dtype=self.weight.dtype).index_add_(
            0, inverse, grads.reshape(-1, self.dim).to(self.weight.dtype))
        rowwise_update(self.weight, self.accumulator, uniq + self.offsets[table], g, self.optimizer, self.lr, self.eps,
                       self.weight_decay)

    def apply_grads(self, grads: list[torch.Tensor]) -> None:
        """Apply one autograd gradient per table (sparse COO or dense) in a single fused row update."""
        ids, values = [], []
        for t, g in enumerate(grads):
            if g is None:
                continue
            if g.is_sparse:
                i, v = g._indices()[0], g._values()
            else:
                i = g.abs().sum(1).nonzero().squeeze(1)
                v = g.index_select(0, i)
            ids.append(i + self.offsets[t])
            values.append(v)
        if ids:
            self.apply_rows(0, torch.cat(ids), torch.cat(values))

    def apply_grad(self, table: int, grad: torch.Tensor) -> None:
        """Apply an autograd gradient of `tables[table]`: a sparse COO tensor (nn.Embedding(sparse=True)) or
        a dense one (only its non-zero rows are touched)."""
        if grad.is_sparse:
            self.apply_rows(table, grad._indices()[0], grad._values())
        else:
            nz = grad.abs().sum(1).nonzero().squeeze(1)
            self.apply_rows(table, nz, grad.index_select(0, nz))

    # -- checkpoint ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"rows": self.rows, "dim": self.dim, "optimizer": self.optimizer, "lr": self.lr,
                "weight": self.weight.detach().clone(), "accumulator": self.accumulator.detach().clone()}

    @classmethod
    def from_state_dict(cls, state: dict) -> "SharedEmbeddings":
        emb = cls(state["rows"], state["dim"], optimizer=state["optimizer"], lr=state["lr"], init_std=0.0)
        emb.weight.copy_(state["weight"])
        emb.accumulator.copy_(state["accumulator"])
        return emb
