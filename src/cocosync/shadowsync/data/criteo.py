"""Streaming reader of the Criteo Kaggle display-advertising format, vectorized with numpy.

Format: one example per line, tab-separated: label (0/1), `num_dense` integer features, `num_sparse`
categorical features (Criteo: 13 and 26; categoricals are hex strings). Empty fields are missing.

* Integers become log(1 + max(x, 0)) (missing -> 0).
* Categoricals are hashed (8-byte blocks through splitmix64, see `hash_tokens`) into [1, table_size); a missing
  categorical is bucket 0.
* Malformed lines (wrong field count, label not 0/1, non-integer integer field) are skipped, counted in
  `.bad_lines`, the first few kept in `.bad_examples` as (line_no, reason) with 1-based line numbers, and
  summarized in a logged warning; past `DataConfig.max_bad_fraction` the reader raises `CriteoFormatError`.
* Sharding, `split="lines"`: interleaved: shard (i, T) owns the file lines whose 0-based index l (over all paths,
  bad lines included) has l % T == i, so the T shards partition the lines exactly (every reader scans every byte;
  works for .gz). `split="bytes"`: shard (i, T) reads only byte range i of T of each file, aligned to line starts
  (data/ranges.py): the shards partition the lines and each reads ~1/T of the bytes (plain files only).
* Synthetic files carry each line's true click probability in a sidecar `<path minus .gz>.prob.npy`
  (float32, one entry per line); when present it fills `Batch.prob`.

Parsing works on ~4 MB chunks: every step is a numpy pass over bytes or fields, none a Python loop per row.
"""

from __future__ import annotations

import gzip
import logging
import os
import re
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from cocosync.shadowsync.config import DataConfig
from cocosync.shadowsync.data.ranges import byte_range, lines_before, range_chunks

__all__ = ["Batch", "CriteoReader", "CriteoFormatError", "hash_tokens", "prob_sidecar_path", "log_transform"]

log = logging.getLogger("cocosync.shadowsync.data")

_MAX_BAD_EXAMPLES = 10
_MIN_LINES_BEFORE_RAISE = 1000
_INT_RE = re.compile(r"-?[0-9]{1,18}")


class CriteoFormatError(ValueError):
    """Too many malformed lines: probably not a Criteo-format file (the message shows the first ones)."""


@dataclass(slots=True)
class Batch:
    """One batch of examples. `prob` is the true click probability when the data set knows it (synthetic)."""

    dense: torch.Tensor  # float32 [B, num_dense], log-transformed
    sparse: torch.Tensor  # int64 [B, num_sparse], bucket ids in [0, table_size)
    label: torch.Tensor  # float32 [B], 0 or 1
    prob: torch.Tensor | None = None  # float32 [B] or None

    def __len__(self) -> int:
        return int(self.label.shape[0])


def log_transform(values: np.ndarray) -> np.ndarray:
    """The dense-feature transform: log(1 + max(x, 0)) as float32."""
    return np.log1p(np.maximum(values, 0).astype(np.float32))


def _words(buf: np.ndarray) -> np.ndarray:
    """words[i] = the 8 bytes buf[i:i+8] as a little-endian uint64 (zero past the end); one gather reads
    8 bytes of a token."""
    padded = np.concatenate([buf, np.zeros(8, dtype=np.uint8)])
    return np.ndarray(shape=(len(buf) + 1,), dtype="<u8", buffer=padded, strides=(1,))


_MASKS = np.array([(1 << (8 * r)) - 1 for r in range(8)] + [(1 << 64) - 1], dtype=np.uint64)
_HASH_SEED = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer (a bijection of uint64 that spreads every input bit)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_tokens(
    buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, sizes, words: np.ndarray | None = None
) -> np.ndarray:
    """Bucket ids of byte tokens buf[starts:starts+lengths]: 1 + H(token) % (size - 1); empty -> 0.

    H hashes the token 8 bytes at a time: h = mix(h ^ block) per little-endian, zero-padded block, then
    mix(h ^ length), with splitmix64's `mix`. `starts`, `lengths` are int arrays of one shape; `sizes`
    broadcasts against them; `words` is `_words(buf)` when the caller already has it.
    """
    words = _words(buf) if words is None else words
    h = np.full(starts.shape, _HASH_SEED, dtype=np.uint64)
    for b in range(-(-int(lengths.max(initial=0)) // 8)):
        r = np.clip(lengths - 8 * b, 0, 8)
        block = words[np.minimum(starts + 8 * b, len(words) - 1)] & _MASKS[r]
        h = _mix(h ^ block) if b == 0 else np.where(r > 0, _mix(h ^ block), h)
    h = _mix(h ^ lengths.astype(np.uint64))
    buckets = (h % (np.asarray(sizes, dtype=np.uint64) - np.uint64(1))).astype(np.int64) + 1
    return np.where(lengths > 0, buckets, 0)


def prob_sidecar_path(path: str) -> str:
    """Where the true-probability sidecar of a data file lives: `data.tsv(.gz)` -> `data.tsv.prob.npy`."""
    return (path[:-3] if path.endswith(".gz") else path) + ".prob.npy"


_U = np.uint64
_ZEROS = _U(0x3030303030303030)


def _parse_ints(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, words: np.ndarray | None = None):
    """Vectorized decimal parse with optional leading '-'. Returns (values int64, ok bool); empty -> 0, ok.

    Up to 8 digits are parsed 8 bytes at a time in one uint64 (SWAR: right-align, pad with '0', check every
    byte is a digit, then combine digit pairs, quads, octets); longer numbers take a per-digit loop.
    """
    words = _words(buf) if words is None else words
    first = buf[np.minimum(starts, len(buf) - 1)]
    neg = (first == ord("-")) & (lengths > 0)
    pos, n = starts + neg, lengths - neg
    short = np.minimum(n, 8)
    w = words[np.minimum(pos, len(words) - 1)] & _MASKS[short]
    pad = (8 - np.maximum(short, 1)).astype(np.uint64) * _U(8)
    v = (w << pad) | (_ZEROS & _MASKS[8 - np.maximum(short, 1)])
    ok = ((v & _U(0xF0F0F0F0F0F0F0F0)) == _ZEROS) & (((v + _U(0x0606060606060606)) & _U(0xF0F0F0F0F0F0F0F0)) == _ZEROS)
    d = v - _ZEROS
    d = d * _U(10) + (d >> _U(8))
    d = (d & _U(0x00FF00FF00FF00FF)) * _U(100) + ((d >> _U(16)) & _U(0x00FF00FF00FF00FF))
    d = (d & _U(0x0000FFFF0000FFFF)) * _U(10000) + ((d >> _U(32)) & _U(0x0000FFFF0000FFFF))
    value = np.where(n > 0, (d & _U(0xFFFFFFFF)).astype(np.int64), 0)
    ok = (ok | (n == 0)) & ~(neg & (n == 0))
    long = n > 8
    if long.any():
        value[long], ok[long] = _parse_long_ints(buf, pos[long], n[long])
    return np.where(neg, -value, value), ok


def _parse_long_ints(buf: np.ndarray, pos: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Digit-by-digit parse of unsigned decimals of more than 8 digits (more than 18 is an error)."""
    last = len(buf) - 1
    value = np.zeros(pos.shape, dtype=np.int64)
    ok = n <= 18
    for j in range(int(min(n.max(initial=0), 18))):
        active = n > j
        digit = buf[np.minimum(pos + j, last)].astype(np.int64) - 48
        ok &= ~active | ((digit >= 0) & (digit <= 9))
        value = np.where(active, value * 10 + digit, value)
    return value, ok


class CriteoReader:
    """Iterate `Batch`es of one shard of Criteo-format file(s), in file order.

    `skip_rows` skips this shard's first valid examples (resume: pass a previous `.position`);
    `max_rows` caps the examples delivered after skipping. `.position` = valid examples consumed by this
    shard so far, skipped ones included. Iterating again restarts from the beginning (and resets counts).
    """

    def __init__(
        self,
        path_or_paths: str | os.PathLike | Sequence[str | os.PathLike],
        config: DataConfig,
        *,
        shard: tuple[int, int] = (0, 1),
        batch_size: int | None = None,
        skip_rows: int = 0,
        max_rows: int | None = None,
        drop_last: bool = False,
        with_prob: bool | None = None,
        chunk_bytes: int = 1 << 22,
        split: str = "lines",
    ) -> None:
        paths = [path_or_paths] if isinstance(path_or_paths, (str, os.PathLike)) else list(path_or_paths)
        if not paths:
            raise ValueError("CriteoReader: no paths given")
        self.paths = [os.fspath(p) for p in paths]
        for p in self.paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"CriteoReader: no such data file: {p!r}")
        index, count = shard
        if not (isinstance(count, int) and count >= 1 and isinstance(index, int) and 0 <= index < count):
            raise ValueError(f"CriteoReader: shard={shard!r}: expected (index, count) with 0 <= index < count")
        if split not in ("lines", "bytes"):
            raise ValueError(f"CriteoReader: split={split!r}: expected 'lines' or 'bytes'")
        compressed = [p for p in self.paths if p.endswith(".gz")]
        if split == "bytes" and compressed:
            raise ValueError(f"CriteoReader: split='bytes' needs files it can seek in; {compressed[0]!r} is gzip "
                             "(decompress it, or use split='lines')")
        self.split = split
        self.config, self.shard = config, (index, count)
        self.batch_size = config.batch_size if batch_size is None else batch_size
        if self.batch_size < 1:
            raise ValueError(f"CriteoReader: batch_size={self.batch_size!r}: expected a positive integer")
        if skip_rows < 0 or (max_rows is not None and max_rows < 0):
            raise ValueError(f"CriteoReader: skip_rows={skip_rows!r}, max_rows={max_rows!r}: expected >= 0")
        self.skip_rows, self.max_rows, self.drop_last = skip_rows, max_rows, drop_last
        sidecars = [prob_sidecar_path(p) for p in self.paths]
        has_all = all(os.path.isfile(s) for s in sidecars)
        if with_prob and not has_all:
            missing = [s for s in sidecars if not os.path.isfile(s)]
            raise FileNotFoundError(f"CriteoReader: with_prob=True but no probability sidecar {missing[0]!r}")
        self.with_prob = has_all if with_prob is None else with_prob
        self.chunk_bytes = chunk_bytes
        self._sizes = np.asarray(config.table_sizes, dtype=np.int64)
        self._fields = 1 + config.num_dense + config.num_sparse
        self._reset()

    def _reset(self) -> None:
        self.bytes_read = 0  # of the files, by this shard
        self.position = 0  # valid examples of this shard consumed (skipped included)
        self.lines = 0  # lines of this shard seen (bad included)
        self.bad_lines = 0
        self.bad_examples: list[tuple[int, str]] = []

    # ---------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Batch]:
        self._reset()
        pending: list[tuple[np.ndarray, ...]] = []
        n_pending = 0
        delivered = 0
        global_line = 0
        for path in self.paths:
            prob = np.load(prob_sidecar_path(path), mmap_mode="r") if self.with_prob else None
            for chunk, first_line in (self._range_chunks(path) if self.split == "bytes" else self._chunks(path)):
                parsed = self._parse_chunk(chunk, path, first_line, global_line, prob)
                global_line += parsed[-1]
                cols = parsed[:-1]
                n = len(cols[0])
                skip = min(n, max(0, self.skip_rows - self.position))
                if self.max_rows is not None:
                    n = min(n, skip + self.max_rows - delivered - n_pending)
                self.position += skip
                if n > skip:
                    pending.append(tuple(c[skip:n] for c in cols))
                    n_pending += n - skip
                while n_pending >= self.batch_size:
                    batch, pending, n_pending = self._take(pending, n_pending, self.batch_size)
                    delivered += len(batch)
                    self.position += len(batch)
                    yield batch
                if self.max_rows is not None and delivered + n_pending >= self.max_rows:
                    break
            else:
                continue
            break
        if n_pending and not self.drop_last:
            batch, pending, n_pending = self._take(pending, n_pending, n_pending)
            self.position += len(batch)
            yield batch
        self._log_summary()

    def _take(self, pending, n_pending, k):
        cols = [np.concatenate(parts) if len(pending) > 1 else parts[0] for parts in zip(*pending)]
        head, tail = [c[:k] for c in cols], [c[k:] for c in cols]
        dense, sparse, label, prob = head
        batch = Batch(
            torch.from_numpy(np.ascontiguousarray(dense)),
            torch.from_numpy(np.ascontiguousarray(sparse)),
            torch.from_numpy(np.ascontiguousarray(label)),
            torch.from_numpy(np.ascontiguousarray(prob)) if self.with_prob else None,
        )
        rest = n_pending - k
        return batch, ([tuple(tail)] if rest else []), rest

    def _range_chunks(self, path: str) -> Iterator[tuple[bytes, Callable[[], int]]]:
        """The shard's byte range of `path` as chunks of whole lines, each with the 1-based number of its first
        line as a function: counting the lines before the range reads the file up to it, done only where a
        probability sidecar or a malformed line needs a line number."""
        lo, hi = byte_range(path, *self.shard)
        start: list[int] = []  # the line number of the range's first line, once counted
        first: int | None = None  # the range's first line's offset
        lines = 0
        for chunk, offset in range_chunks(path, lo, hi, self.chunk_bytes):
            first = offset if first is None else first

            def number(k: int = lines, at: int = first) -> int:
                if not start:
                    start.append(lines_before(path, at) + 1)
                return start[0] + k
            self.bytes_read += len(chunk)
            yield chunk, number
            lines += chunk.count(b"\n")

    def _chunks(self, path: str) -> Iterator[tuple[bytes, Callable[[], int]]]:
        """Yield (bytes of whole lines ending in b'\\n', the 1-based number of the chunk's first line, as a
        function)."""
        opener = gzip.open if path.endswith(".gz") else open
        line_no, rest = 1, b""
        with opener(path, "rb") as f:
            while True:
                try:
                    block = f.read(self.chunk_bytes)
                except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # (click would show an EOFError as 'Aborted!')
                    raise CriteoFormatError(f"{path}: a truncated or damaged gzip file ({e}; {line_no - 1:,} lines "
                                            "read before it)") from None
                if not block:
                    break
                block = rest + block
                cut = block.rfind(b"\n") + 1
                if cut == 0:
                    rest = block
                    continue
                chunk, rest = block[:cut], block[cut:]
                self.bytes_read += len(chunk)
                yield chunk, (lambda n=line_no: n)
                line_no += chunk.count(b"\n")
        if rest:
            yield rest + b"\n", (lambda n=line_no: n)

    # ---------------------------------------------------------------- parsing
    def _parse_chunk(self, chunk: bytes, path: str, first_line: Callable[[], int], global_line: int, prob):
        """Parse the shard's lines of one chunk (`first_line()`: the 1-based number of its first line, asked only
        where a sidecar or a malformed line needs it). Returns (dense, sparse, label, prob, lines_in_chunk)."""
        buf = np.frombuffer(chunk, dtype=np.uint8)
        is_nl = buf == 10
        nl = np.flatnonzero(is_nl)
        n_lines = len(nl)
        line_start = np.empty(n_lines, dtype=np.int64)
        line_start[0] = 0
        line_start[1:] = nl[:-1] + 1
        line_end = nl.copy()  # exclusive; strip a '\r' before '\n'
        cr = (line_end > line_start) & (buf[np.maximum(line_end - 1, 0)] == 13)
        line_end[cr] -= 1
        seps = np.flatnonzero(is_nl | (buf == 9))
        seps_nl = is_nl[seps]
        line_of_sep = np.cumsum(seps_nl) - seps_nl
        fields_per_line = np.bincount(line_of_sep, minlength=n_lines)
        index, count = self.shard
        if self.split == "bytes":  # the chunk holds this shard's range only
            mine = np.ones(n_lines, dtype=bool)
        else:
            mine = (np.arange(global_line, global_line + n_lines) % count) == index
        good = mine & (fields_per_line == self._fields)

        rows = np.flatnonzero(good)
        ends = seps[good[line_of_sep]].reshape(-1, self._fields)
        ends[:, -1] = line_end[rows]
        starts = np.empty_like(ends)
        starts[:, 0] = line_start[rows]
        starts[:, 1:] = ends[:, :-1] + 1
        lengths = ends - starts

        label_byte = buf[np.minimum(starts[:, 0], len(buf) - 1)]
        ok = (lengths[:, 0] == 1) & ((label_byte == 48) | (label_byte == 49))
        nd = self.config.num_dense
        words = _words(buf)
        ints, ints_ok = _parse_ints(buf, starts[:, 1 : 1 + nd], lengths[:, 1 : 1 + nd], words)
        ok &= ints_ok.all(axis=1)
        sparse = hash_tokens(buf, starts[:, 1 + nd :], lengths[:, 1 + nd :], self._sizes, words)

        bad = mine.copy()
        bad[rows[ok]] = False
        n_bad = int(bad.sum())
        self.lines += int(mine.sum())
        if n_bad:
            self._record_bad(chunk, line_start, line_end, np.flatnonzero(bad), path, first_line)
        self._check_bad_fraction(path)
        rows, ints, sparse, label_byte = rows[ok], ints[ok], sparse[ok], label_byte[ok]
        if prob is not None:
            idx = (first_line() - 1) + rows  # 0-based line index within this file
            if len(idx) and idx[-1] >= len(prob):
                raise CriteoFormatError(
                    f"{path}: probability sidecar {prob_sidecar_path(path)!r} has {len(prob)} entries "
                    f"but the data has at least {idx[-1] + 1} lines"
                )
            p = np.asarray(prob[idx], dtype=np.float32)
        else:
            p = np.empty(0, dtype=np.float32)
        label = (label_byte == 49).astype(np.float32)
        return log_transform(ints), sparse, label, p, n_lines

    def _record_bad(self, chunk, line_start, line_end, bad_idx, path, first_line) -> None:
        self.bad_lines += len(bad_idx)
        for i in bad_idx[: max(0, _MAX_BAD_EXAMPLES - len(self.bad_examples))]:
            text = chunk[line_start[i] : line_end[i]].decode("utf-8", errors="replace")
            self.bad_examples.append((first_line() + int(i), f"{os.path.basename(path)}: {self._explain(text)}"))

    def _explain(self, text: str) -> str:
        fields = text.split("\t")
        if len(fields) != self._fields:
            return f"expected {self._fields} tab-separated fields, found {len(fields)}: {text[:60]!r}"
        if fields[0] not in ("0", "1"):
            return f"label {fields[0]!r} is not 0 or 1"
        for k, v in enumerate(fields[1 : 1 + self.config.num_dense], start=1):
            if v and not _INT_RE.fullmatch(v):
                return f"integer feature I{k}={v[:30]!r} is not an integer (at most 18 digits)"
        return "malformed line"

    def _check_bad_fraction(self, path: str) -> None:
        limit = self.config.max_bad_fraction
        if self.lines >= _MIN_LINES_BEFORE_RAISE and self.bad_lines > limit * self.lines and limit < 1.0:
            raise CriteoFormatError(
                f"{path}: {self.bad_lines} of {self.lines} lines are malformed (more than "
                f"max_bad_fraction={limit}); is this a Criteo-format file? First: {self._examples_text()}"
            )

    def _examples_text(self) -> str:
        return "; ".join(f"line {n}: {r}" for n, r in self.bad_examples[:3])

    def _log_summary(self) -> None:
        if self.bad_lines:
            log.warning(
                "%s: skipped %d malformed line(s) of %d (shard %d/%d). First: %s",
                ", ".join(self.paths), self.bad_lines, self.lines, *self.shard, self._examples_text(),
            )
