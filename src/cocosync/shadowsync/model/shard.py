"""The storage of the embedding tables: the row hash that places rows on servers, a server's shard of rows
(weights, row-wise Adagrad accumulators, versions) and the one row update. It imports nothing of the job but the
names of its settings (config.OPTIMIZERS): every store (a node's shards, the replicated hot rows, the servers behind
a transport) is built on it.

Sharding is by **row hash**: global row g (tables concatenated) lives on server g % S at local row g // S. Every
server holds about 1/S of every table, so bytes and lookup load balance whatever the table sizes and however skewed
the ids (table-wise placement would put a 10M-row table and its hot rows on one server; contiguous ranges would put
each table's low, frequent ids together). Updates are row-wise Adagrad or SGD, Hogwild (lock-free). Each row carries
a version (its update count): a push reports how many updates its rows received between their fetch and its
gradient (the staleness of asynchronous lookups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from cocosync.runtime.comm.native import one_shot as native_module
from cocosync.shadowsync.config import OPTIMIZERS

__all__ = ["RowHash", "Shard", "initial_rows", "rowwise_update"]

@torch.no_grad()
def rowwise_update(weight: torch.Tensor, accumulator: torch.Tensor, rows: torch.Tensor, g: torch.Tensor,
                   optimizer: str, lr: float, eps: float, weight_decay: float = 0.0) -> None:
    """Apply the gradient rows `g[i]` to the distinct rows `rows[i]` of `weight`, in place and lock-free (Hogwild):
    SGD, or row-wise Adagrad with one accumulator per row (acc += mean(g^2); w -= lr * g / (sqrt(acc) + eps)).
    weight_decay: L2 on the touched rows, g += wd * w first. `g` is consumed (scaled in place). The one
    definition of the row update: Adagrad on float32 tables is one C++ pass over the rows where the native module is
    built (runtime/comm/native/embedding_rows.cpp), the torch operations below otherwise (its reference)."""
    if optimizer == "adagrad" and _native_rows(weight, accumulator, rows, g):
        native_module().rowwise_adagrad(weight, accumulator, rows, g, lr, eps, weight_decay)
        return
    if weight_decay:
        g.add_(weight.index_select(0, rows), alpha=weight_decay)
    if optimizer == "sgd":
        weight.index_add_(0, rows, g, alpha=-lr)
        return
    accumulator.index_add_(0, rows, g.pow(2).mean(1))
    scale = accumulator.index_select(0, rows).sqrt_().add_(eps).reciprocal_().mul_(-lr)
    weight.index_add_(0, rows, g.mul_(scale.unsqueeze(1)))


def _native_rows(weight: torch.Tensor, accumulator: torch.Tensor, rows: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether the native row update takes these tensors (float32, contiguous, int64 rows) and is built."""
    return (weight.dtype == accumulator.dtype == g.dtype == torch.float32 and rows.dtype == torch.int64
            and weight.is_contiguous() and accumulator.is_contiguous() and g.is_contiguous() and rows.is_contiguous()
            and native_module() is not None)


@dataclass(frozen=True)
class RowHash:
    """Global row g -> (server g % servers, local row g // servers)."""

    total_rows: int
    servers: int

    def __post_init__(self) -> None:
        if self.servers < 1 or self.total_rows < 1:
            raise ValueError(f"RowHash needs servers >= 1 and rows >= 1, got servers={self.servers}, "
                             f"rows={self.total_rows}")

    def shard_rows(self, server: int) -> int:
        """Rows held by `server`."""
        return (self.total_rows - server + self.servers - 1) // self.servers


def initial_rows(rows: Sequence[int], dim: int, *, init_std: float, seed: int, rowhash: RowHash,
                 server: int) -> torch.Tensor:
    """The initial rows of one server's shard: its rows of the tables drawn N(0, init_std) from `seed` as one
    [sum(rows), dim] tensor, so a job starts from the same tables whatever its server count."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(sum(rows), dim, generator=gen).mul_(init_std)
    return full[server::rowhash.servers].clone()


class Shard:
    """One server's rows: weight [n, dim], row-wise Adagrad accumulator [n], versions [n] (update counts)."""

    def __init__(self, weight: torch.Tensor, accumulator: torch.Tensor, versions: torch.Tensor, *, optimizer: str,
                 lr: float, eps: float = 1e-8, weight_decay: float = 0.0):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"embedding optimizer={optimizer!r} is invalid: expected one of {OPTIMIZERS}")
        self.weight, self.accumulator, self.versions = weight, accumulator, versions
        self.optimizer, self.lr, self.eps, self.weight_decay = optimizer, float(lr), float(eps), float(weight_decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The shard's live tensors (a checkpoint saves them, and loads into them in place)."""
        return {"weight": self.weight, "accumulator": self.accumulator, "versions": self.versions}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for key, live in self.state_dict().items():
            if state[key] is not live:
                live.copy_(state[key])

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [len(ids), dim], their versions): a copy, taken without locks."""
        return self.weight.index_select(0, ids), self.versions.index_select(0, ids)

    @torch.no_grad()
    def apply(self, ids: torch.Tensor, grads: torch.Tensor, fetched: torch.Tensor) -> int:
        """Apply gradient rows to the distinct local rows `ids` (Hogwild); returns the summed staleness: updates the
        rows received since `fetched` (their versions when the trainer read them)."""
        return int(self.apply_rows(ids, grads, fetched).sum())

    @torch.no_grad()
    def apply_rows(self, ids: torch.Tensor, grads: torch.Tensor, fetched: torch.Tensor) -> torch.Tensor:
        """`apply`, with the staleness of each row. Rows may repeat (several trainers' pushes applied at once): each
        occurrence adds its gradient, as Hogwild threads would."""
        stale = self.versions.index_select(0, ids) - fetched
        rowwise_update(self.weight, self.accumulator, ids, grads.to(self.weight.dtype).clone(), self.optimizer,
                       self.lr, self.eps, self.weight_decay)
        self.versions.index_add_(0, ids, torch.ones_like(ids))
        return stale
