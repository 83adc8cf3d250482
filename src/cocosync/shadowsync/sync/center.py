"""EASGD's centre across machines: the centre variable sharded in contiguous ranges over the sync parameter servers,
each range updated by RPC (lock-free, Hogwild on the centre, as the single-node shared-memory centre).

A trainer's exchange sends its snapshot's ranges to their servers in one message each, in parallel; each server
runs EASGD's program (programs/sync.py: d = alpha * (x - c), x -= d, c += d) on its range and answers with the moved
point x - d: the elastic step of both sides in one round trip.

A range whose server was lost with its machine is adopted by a sync server left (`RemoteCenter.adopt`): it serves the
range from then on, starting from the values it is handed (a trainer's replica of that range: the centre is an
elastic average of the replicas), and every trainer's view sends that range there (`RemoteCenter.reroute`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
import torch.distributed.rpc as rpc

from cocosync.shadowsync.model.served import Served

__all__ = ["CenterShard", "RemoteCenter", "serve_center", "served_ranges", "center_bounds", "easgd_step"]


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


def served_ranges() -> dict[int, CenterShard]:
    """The centre's ranges this process serves (a sync server's own, and those it adopted), by index."""
    return dict(_SERVED.items())


def _rpc_adopt(server: int, values: torch.Tensor) -> None:
    _SERVED.serve(server, CenterShard(values, server))


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

    def adopt(self, index: int, values: torch.Tensor, onto: str) -> None:
        """Range `index` (its server lost) is served from now on by the sync server named `onto`, from `values`
        (this range's elements), and this view sends it there (the other trainers' views: `reroute`)."""
        lo, hi = self.bounds[index]
        if values.numel() != hi - lo:
            raise ValueError(f"range {index} of the centre has {hi - lo} elements, not {values.numel()}")
        rpc.rpc_sync(onto, _rpc_adopt, args=(index, values.detach().clone()))
        self.servers[index] = onto

    def reroute(self, index: int, onto: str) -> None:
        """Send range `index` to the sync server named `onto` from now on (it adopted the range)."""
        self.servers[index] = onto

    def values(self) -> torch.Tensor:
        """The whole centre (the final model of an EASGD run)."""
        futures = [rpc.rpc_async(name, _rpc_values, args=(s,)) for s, name in enumerate(self.servers)]
        return torch.cat([f.wait() for f in futures])
