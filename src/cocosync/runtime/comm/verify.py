"""Checking that every rank of a group agrees on something before using it (as DDP's
`_verify_param_shape_across_processes` does): one all_gather_object at construction, and an error naming both
ranks and the first difference instead of a hang or silently different updates."""

from __future__ import annotations

from typing import Any, Mapping

import torch.distributed as dist

__all__ = ["RanksDisagree", "verify_same", "first_difference"]


class RanksDisagree(ValueError):
    """Ranks that must agree do not; the message names both ranks and the first difference."""


def first_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    """(key, a's value, b's value) of the first key (in a's order, then b's) whose values differ, or None."""
    for k in [*a, *(k for k in b if k not in a)]:
        if a.get(k, "<missing>") != b.get(k, "<missing>"):
            return k, a.get(k, "<missing>"), b.get(k, "<missing>")
    return None


def verify_same(what: str, value: Mapping[str, Any], group: dist.ProcessGroup | None = None) -> None:
    """Collective over `group`: raise RanksDisagree on every rank unless all ranks passed equal `value`s."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    values: list[Any] = [None] * size
    dist.all_gather_object(values, dict(value), group=group)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    for i in range(1, size):
        diff = first_difference(values[0], values[i])
        if diff is not None:
            key, a, b = diff
            raise RanksDisagree(f"{what}: ranks disagree on {key}: global rank {ranks[0]} has {a!r}, global rank "
                                f"{ranks[i]} has {b!r}; every rank must build the same model and pass the same "
                                "arguments")
