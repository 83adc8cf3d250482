"""Byte ranges of a text file aligned to line starts: how S readers split one file without any of them reading the
others' parts (Hadoop's TextInputFormat rule). Range i of S is [i * size // S, (i + 1) * size // S); a line
belongs to the range holding its first byte, so a reader starts at the first line start at or after its `lo`
(byte lo - 1 is a newline, or lo is 0) and stops after the line holding byte hi - 1. The ranges partition the
lines exactly; a range no line starts in is empty."""

from __future__ import annotations

import os
from typing import BinaryIO, Iterator

import numpy as np

__all__ = ["byte_range", "range_chunks", "lines_before"]


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
