"""Which rows each reader shard reads when a job resumes on another number of trainers.

A job's S = T x W reader shards are normally the data source's own shards (shard s of S: its block of synthetic
rows, its byte range or every S-th line of a file) read from the start. A checkpoint records how far each one got
(its reader position: a prefix of its rows). Resumed with another trainer count T', the rows nobody has read yet
are the unread tail of every old shard; a *plan* lists them as segments of the original (base) sharding,
(base shard, first row in it, rows), concatenated in shard order and cut into S' = T' x W near-equal contiguous
parts. Every example of the budget is then read exactly once across the two runs. The plan goes into the
checkpoint's meta.json, so a later resume (same count: positions index into the plan; another count: planned again
from it) composes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = ["Segment", "DataPlan", "base_plan", "unread", "split_plan", "replan", "PlannedSource"]

Segment = tuple[int, int, int]  # (base shard, first row within it, rows)


@dataclass(frozen=True)
class DataPlan:
    """Shard s of the job reads `shards[s]`, segments of the data source's `base_shards` shards; `examples_before`
    examples were read before the plan was made (the job's count of examples seen starts there)."""

    base_shards: int
    shards: list[list[Segment]]
    examples_before: int

    def as_json(self) -> dict[str, Any]:
        return {"base_shards": self.base_shards, "shards": [[list(g) for g in s] for s in self.shards],
                "examples_before": self.examples_before}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DataPlan":
        return cls(int(d["base_shards"]), [[tuple(int(x) for x in g) for g in s] for s in d["shards"]],
                   int(d["examples_before"]))


def replan(old: DataPlan | None, old_shards: int, positions: list[int], new_shards: int,
           shard_rows: Callable[[int, int], int], seen: int) -> DataPlan:
    """The plan of a job resumed with `new_shards` reader shards from one with `old_shards` (read through `old`, or
    the source's own sharding) whose shards stopped at `positions` after `seen` examples in all.
    `shard_rows(s, S)`: rows of the source's shard s of S."""
    if old is None:
        old = DataPlan(old_shards, base_plan(old_shards, lambda s: shard_rows(s, old_shards)), 0)
    return DataPlan(old.base_shards, split_plan(unread(old.shards, positions), new_shards), seen)


def base_plan(shards: int, shard_rows: Callable[[int], int]) -> list[list[Segment]]:
    """The plan of an ordinary run: shard s reads base shard s from its first row."""
    return [[(s, 0, shard_rows(s))] for s in range(shards)]


def unread(plan: list[list[Segment]], positions: list[int]) -> list[Segment]:
    """The segments of `plan` past each shard's reader position, in shard order."""
    if len(positions) != len(plan):
        raise ValueError(f"{len(positions)} reader positions for a plan of {len(plan)} shards")
    out: list[Segment] = []
    for segments, pos in zip(plan, positions):
        skip = int(pos)
        for base, first, rows in segments:
            if skip >= rows:
                skip -= rows
                continue
            out.append((base, first + skip, rows - skip))
            skip = 0
    return out


def split_plan(segments: list[Segment], shards: int) -> list[list[Segment]]:
    """`segments` cut into `shards` contiguous parts whose row counts differ by at most one."""
    total = sum(r for _, _, r in segments)
    bounds = [k * total // shards for k in range(shards + 1)]
    plan: list[list[Segment]] = [[] for _ in range(shards)]
    at = 0  # rows before the current segment
    for base, first, rows in segments:
        lo, hi = at, at + rows
        for k in range(shards):
            a, b = max(lo, bounds[k]), min(hi, bounds[k + 1])
            if a < b:
                plan[k].append((base, first + a - lo, b - a))
        at = hi
    return plan


def _take(batches: Iterator[Any], rows: int) -> Iterator[Any]:
    """The first `rows` rows of `batches` (the last batch cut)."""
    if rows <= 0:
        return
    for b in batches:
        if len(b) >= rows:
            yield b if len(b) == rows else type(b)(b.dense[:rows], b.sparse[:rows], b.label[:rows],
                                                    None if b.prob is None else b.prob[:rows])
            return
        rows -= len(b)
        yield b


class PlannedSource:
    """A data source read through a plan: shard s of the job reads its segments of `base`'s `base_shards` shards
    (`base`: InMemorySource, FileSource or Epochs; shard numbering of the plan, not of the base)."""

    def __init__(self, base: Any, base_shards: int, plan: list[list[Segment]]):
        self.base, self.base_shards, self.plan = base, base_shards, plan

    def shard_rows(self, shard: int, shards: int) -> int:
        self._check(shards)
        return sum(r for _, _, r in self.plan[shard])

    def batches(self, shard: int, shards: int, batch_size: int, start: int = 0) -> Iterator[Any]:
        self._check(shards)
        for base, first, rows in unread([self.plan[shard]], [start]):
            yield from _take(self.base.batches(base, self.base_shards, batch_size, first), rows)

    def share_memory_(self) -> "PlannedSource":
        if hasattr(self.base, "share_memory_"):
            self.base.share_memory_()
        return self

    def _check(self, shards: int) -> None:
        if shards != len(self.plan):
            raise ValueError(f"a plan of {len(self.plan)} shards read as {shards} shards")
