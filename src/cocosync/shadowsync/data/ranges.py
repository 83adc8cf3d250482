"""Byte ranges of a text file aligned to line starts: how S readers split one file without any of them reading the
others' parts (Hadoop's TextInputFormat rule). Range i of S is [i * size // S, (i + 1) * size // S); a line
belongs to the range holding its first byte, so a reader starts at the first line start at or after its `lo`
(byte lo - 1 is a newline, or lo is 0) and stops after the line holding byte hi - 1. The ranges partition the
lines exactly; a range no line starts in is empty."""

from __future__ import annotations

import os
from typing import BinaryIO, Iterator

import numpy as np

__all__ = ["byte_range", "range_chunks", "lines_before", "range_lines", "even_share", "filled_shares"]


def byte_range(path: str, index: int, count: int) -> tuple[int, int]:
    size = os.path.getsize(path)
    return index * size // count, (index + 1) * size // count


def _first_line_start(f: BinaryIO, lo: int) -> int:
    if lo == 0:
        return 0
    f.seek(lo - 1)
    if f.read(1) == b"\n":
        return lo
    f.readline()  # lo is inside a line that started in the previous range: skip its rest
    return f.tell()


def range_chunks(path: str, lo: int, hi: int, chunk_bytes: int) -> Iterator[tuple[bytes, int]]:
    """(bytes of whole lines, each ending in b'\\n', file offset of the first) for the lines starting in [lo, hi);
    a final line without its newline gets one. Reads from the first line start at or after lo up to the end of
    the line holding byte hi - 1, nothing else."""
    with open(path, "rb") as f:
        base = _first_line_start(f, lo)  # offset of the next line to yield
        f.seek(base)
        rest = b""
        while base < hi:
            block = f.read(chunk_bytes)
            if not block:
                if rest:
                    yield rest + b"\n", base
                return
            block = rest + block
            cut = block.rfind(b"\n") + 1
            if cut == 0:
                rest = block
                continue
            if base + cut > hi:  # the block passes the range's end: stop after the line holding byte hi - 1
                end = block.find(b"\n", hi - base - 1) + 1
                yield block[:end], base
                return
            yield block[:cut], base
            base, rest = base + cut, block[cut:]


def lines_before(path: str, offset: int, block: int = 1 << 24) -> int:
    """Newlines in the file's first `offset` bytes: the 0-based line number of the line starting at `offset`
    (read only where a per-line sidecar or an error message needs it)."""
    n = 0
    with open(path, "rb") as f:
        left = offset
        while left > 0:
            buf = f.read(min(block, left))
            if not buf:
                break
            n += int(np.count_nonzero(np.frombuffer(buf, dtype=np.uint8) == 10))
            left -= len(buf)
    return n


def even_share(total: int, shards: int, shard: int) -> int:
    """Shard `shard`'s share of `total` rows split as evenly as can be: the first `total % shards` shards take one
    more (shard s of interleaved lines, or of contiguous rows from `even_start`, then reads exactly the first `total`
    rows)."""
    return total // shards + (shard < total % shards)


def even_start(total: int, shards: int, shard: int) -> int:
    """The first row of shard `shard`'s contiguous share (`even_share`)."""
    return shard * (total // shards) + min(shard, total % shards)


def filled_shares(total: int, capacity: list[int]) -> list[int]:
    """`total` rows shared as evenly as can be among readers that hold `capacity` rows each (byte ranges holding
    different line counts): a reader holding fewer than its share gives the rest to the others. Sums to
    min(total, sum(capacity))."""
    left, shares = min(total, sum(capacity)), [0] * len(capacity)
    order = sorted(range(len(capacity)), key=lambda i: (capacity[i], i))
    for k, i in enumerate(order):  # the smallest first: each takes its even share of what is left, or all it has
        shares[i] = min(capacity[i], left // (len(order) - k))
        left -= shares[i]
    return shares


def range_lines(paths: list[str], count: int, block: int = 1 << 24) -> list[int]:
    """Lines starting in each of the `count` byte ranges of every file in `paths`, summed over the files: the lines
    each of `count` readers of the split reads (a final line without its newline counted). One pass over the files,
    newlines found by numpy (memory bandwidth, not parsing)."""
    counts = np.zeros(count, dtype=np.int64)
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        los = np.array([byte_range(path, i, count)[0] for i in range(count)], dtype=np.int64)
        with open(path, "rb") as f:
            at = 0
            starts = np.zeros(1, dtype=np.int64)  # the first line starts at byte 0
            while buf := f.read(block):
                found = np.flatnonzero(np.frombuffer(buf, dtype=np.uint8) == 10).astype(np.int64) + at + 1
                starts = np.concatenate([starts, found[found < size]]) if at == 0 else found[found < size]
                # a line belongs to the last range whose start is at or before its first byte (an empty range
                # shares its start with the next one)
                counts += np.bincount(np.searchsorted(los, starts, side="right") - 1, minlength=count)
                at += len(buf)
    return [int(c) for c in counts]
