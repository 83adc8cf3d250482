"""`opt.state` of a DistributedOptimizer: torch.optim's per-parameter mapping over the sliced (ZeRO-1) state.

Each rank holds one contiguous slice of every state buffer (the flat layout of FlatParams), so a parameter's
`exp_avg` lives partly on this rank, partly on others. `opt.state[p]` is a dict with torch.optim's keys whose
tensors are **views of this rank's part** of the parameter's state, flat (1-D; empty where the parameter lies
wholly in other ranks' slices): writing into them changes the optimizer, as with torch. `state_dict()` has the full
tensors in the parameters' shapes. As with torch.optim the mapping is empty before the first step, which is what
torch.distributed.checkpoint's `get_state_dict` tests before running its initialising step (with our state it
would otherwise take a real step: the moments decay and the step count moves).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["SlicedState"]


class SlicedState(Mapping):
    """opt.state: parameter -> {"step": tensor, <torch.optim state key>: this rank's 1-D view of it}."""

    def __init__(self, opt: Any):
        self._opt = opt

    def __getitem__(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        for gi, u in enumerate(self._opt._updates):
            for i, q in enumerate(u.flat.params):
                if q is p and self._steps(gi)[i]:  # no state before its first step, as torch.optim
                    return self._entry(u, i, int(self._steps(gi)[i]))
        raise KeyError(p)

    def _steps(self, gi: int) -> Any:
        return self._opt._presence.steps[gi]

    def _stepped(self) -> list[torch.Tensor]:
        return [p for gi, u in enumerate(self._opt._updates) for p, t in zip(u.flat.params, self._steps(gi)) if t]

    def _entry(self, u: Any, i: int, step: int) -> dict[str, torch.Tensor]:
        start, n = u.slice.start, u.slice.stop - u.slice.start
        lo, hi = u.flat.offsets[i], u.flat.offsets[i + 1]
        a, b = min(max(lo - start, 0), n), min(max(hi - start, 0), n)  # the parameter's range within this slice
        keys = {**self._opt.state_names, "master": "master"}
        entry: dict[str, torch.Tensor] = {"step": torch.tensor(float(step))}
        for name, t in u.local_state.items():
            entry[keys[name]] = t[a:b]
        return entry

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._stepped())

    def __len__(self) -> int:
        return len(self._stepped())

    def __contains__(self, p: object) -> bool:
        return any(q is p for q in self._stepped())

    def __repr__(self) -> str:
        return f"SlicedState({len(self)} parameters, step {self._opt.steps}, this rank's slices)"
