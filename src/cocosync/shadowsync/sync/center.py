"""EASGD's centre across machines: the centre variable sharded in contiguous ranges over the sync parameter servers,
each range updated by RPC (lock-free, Hogwild on the centre, as the single-node shared-memory centre).

A trainer's exchange sends its snapshot's ranges to their servers in one message each, in parallel; each server
runs EASGD's program (programs/sync.py: d = alpha * (x - c), x -= d, c += d) on its range and answers with the moved
point x - d: the elastic step of both sides in one round trip.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
import torch.distributed.rpc as rpc

from cocosync.shadowsync.model.served import Served

__all__ = ["CenterShard", "RemoteCenter", "serve_center", "center_bounds", "easgd_step"]


@lru_cache(maxsize=8)
def easgd_step(numel: int, dtype: torch.dtype) -> Callable[..., dict[str, torch.Tensor]]:
    """EASGD's program for vectors of `numel`, compiled for this process alone (it has no collective):
    `step(x=..., c=..., alpha=...)` moves both in place."""
    from cocosync.lower import lower
    from cocosync.programs.sync import easgd_program
    from cocosync.runtime.executor import compile_plan

    return compile_plan(lower(easgd_program(numel, dtype)))


def center_bounds(numel: int, servers: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal ranges of a flat vector of `numel` elements over `servers`."""
    return [(s * numel // servers, (s + 1) * numel // servers) for s in range(servers)]


class CenterShard:
    """Range `index` of the centre (`center_bounds`), held by a sync server."""

    def __init__(self, values: torch.Tensor, index: int = 0):
        self.values = values.detach().clone()
        self.index = index
        self._step = easgd_step(self.values.numel(), self.values.dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The range's live values, keyed by its index (a checkpoint holds every range under one name)."""
        return {str(self.index): self.values}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state[str(self.index)] is not self.values:
            self.values.copy_(state[str(self.index)])

    @torch.no_grad()
    def exchange(self, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """x - alpha * (x - c) (x is this call's own copy, moved in place), the centre moved towards x as much."""
        self._step(x=x, c=self.values, alpha=alpha)
        return x


_SERVED: Served[CenterShard] = Served("sync server", "an exchange")  # the centre ranges this process serves


def serve_center(server: int, shard: CenterShard) -> None:
    _SERVED.serve(server, shard)


def _rpc_exchange(server: int, x: torch.Tensor, alpha: float) -> torch.Tensor:
    return _SERVED[server].exchange(x, alpha)


def _rpc_values(server: int) -> torch.Tensor:
    return _SERVED[server].values.clone()


class RemoteCenter:
    """The trainer's view of the sharded centre (`servers`: RPC worker names, in range order)."""

    def __init__(self, numel: int, servers: list[str]):
        if not servers:
            raise ValueError("EASGD across machines needs at least one sync server (--sync-servers)")
        self.numel, self.servers = numel, list(servers)
        self.bounds = center_bounds(numel, len(servers))

    def exchange(self, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """x - alpha * (x - centre), the centre moved by as much towards x; one parallel round trip to every
        server."""
        futures = [rpc.rpc_async(name, _rpc_exchange, args=(s, x[lo:hi].clone(), float(alpha)))
                   for s, (name, (lo, hi)) in enumerate(zip(self.servers, self.bounds))]
        return torch.cat([f.wait() for f in futures])

    def values(self) -> torch.Tensor:
        """The whole centre (the final model of an EASGD run)."""
        futures = [rpc.rpc_async(name, _rpc_values, args=(s,)) for s, name in enumerate(self.servers)]
        return torch.cat([f.wait() for f in futures])
