"""A shared-memory arena for the ranks of one node, and the flags that synchronize them.

Segments are files in /dev/shm named ``cocosync-<job>-n<node>-a<arena>-s<segment>``, created by local rank 0 with
O_CREAT|O_EXCL and mode 0o600, mapped by every local rank, and **unlinked as soon as every local rank has mapped
them**: the mappings stay valid, and nothing is left in /dev/shm whatever happens later (exceptions, SIGKILL).
Before that point an atexit hook and the error paths unlink them too.

Every allocation is collective over the local ranks (all of them call ``empty``/``shared_empty`` in the same
order with the same sizes), like torch.distributed calls:

* ``arena.empty(shape, dtype)``: a tensor per rank, in a segment with one region per local rank; the
  collectives find the peers' tensors at the same offset (zero-copy).
* ``arena.shared_empty(shape, dtype)``: one tensor per node, the same memory on every local rank (a Replicated
  tensor stored once per node).

Synchronization: each local rank owns a 128-byte slot of int64 counters in a control segment; it writes only its
own slot and polls the others' (no atomics needed). Waiting spins briefly, then yields and sleeps, and raises
`CollectiveTimeout` (naming the operation, the call's sequence number and the missing ranks) after the timeout or
as soon as a peer process is seen dead.
"""

from __future__ import annotations

import atexit
import errno
import glob
import itertools
import mmap
import os
import stat
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from cocosync.runtime.comm.topology import NodeGroups, node_groups

__all__ = ["Arena", "ArenaFull", "CollectiveTimeout", "Flags", "default_timeout", "pid_alive", "SHM_DIR", "SHM_PREFIX",
           "shm_space", "sweep_stale_segments", "leftover_segments", "create_named", "map_named", "unlink_named",
           "remove_named", "leave_collectives"]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "cocosync-"
TIMEOUT_ENV = "COCOSYNC_COLLECTIVE_TIMEOUT"
_SLOT = 40  # int64 words per local rank in the control segment (320 bytes: no false sharing of polled words)
_F_SEQ, _F_ATTACH, _F_PID, _F_LEFT, _F_HDR = 0, 1, 2, 3, 4  # slot fields; then two headers (collective metadata)
HEADER_WORDS = 14  # per header; header k%2 goes with barrier k (a peer may already write the next call's header)
#: the control words' layout, public for the native loops (runtime/comm/native) that read and write them directly
SLOT_WORDS, SEQ_FIELD, HEADER_FIELD = _SLOT, _F_SEQ, _F_HDR
_ALIGN = 4096

_pending: set[str] = set()  # segment paths created or attached by this process and not yet unlinked
_pending_lock = threading.Lock()
_arena_ids: dict[str, itertools.count] = {}  # per job id: a subgroup's arenas are numbered among its members
_all_flags: weakref.WeakSet = weakref.WeakSet()  # every Flags of this process (leave_collectives)


class CollectiveTimeout(RuntimeError):
    """Peers did not arrive at a collective within the timeout (or died): names the collective and the ranks."""


def default_timeout() -> float:
    """Seconds a collective waits for its peers: $COCOSYNC_COLLECTIVE_TIMEOUT, else 60."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return 60.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be > 0")
    return value


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    with _pending_lock:
        _pending.discard(path)


@atexit.register
def unlink_pending() -> None:
    """Unlink the segments this process created or attached and that are still named (a peer never mapped them).
    Runs at exit; call it too before os._exit or a fatal signal, which skip atexit hooks."""
    for path in list(_pending):
        _unlink(path)


def parent_pid(pid: int) -> int | None:
    """The parent of process `pid` (/proc), None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def is_descendant(pid: int, ancestor: int | None = None) -> bool:
    """Whether process `pid` descends from `ancestor` (default: this process): a child, a child's child, ..."""
    ancestor = os.getpid() if ancestor is None else ancestor
    seen = 0
    while pid > 1 and seen < 64:
        parent = parent_pid(pid)
        if parent is None:
            return False
        if parent == ancestor:
            return True
        pid, seen = parent, seen + 1
    return False


def pid_alive(pid: int) -> bool:
    """False when the process is gone or a zombie (killed, not yet reaped by its parent)."""
    if pid <= 0:  # not published yet
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True


class Flags:
    """The per-local-rank int64 slots of a control segment: counters, pids and collective headers."""

    def __init__(self, words: np.ndarray, local_rank: int, global_ranks: list[int], timeout: float):
        self.words = words  # (L, _SLOT) int64 view of shared memory
        self.local_rank = local_rank
        self.global_ranks = global_ranks
        self.timeout = timeout
        self.seq = int(words[local_rank, _F_SEQ])
        self.broken: str | None = None
        _all_flags.add(self)

    @property
    def size(self) -> int:
        return self.words.shape[0]

    def publish(self, field: int, value: int) -> None:
        self.words[self.local_rank, field] = value

    def _hdr_slice(self, seq: int) -> slice:
        start = _F_HDR + (seq % 2) * HEADER_WORDS
        return slice(start, start + HEADER_WORDS)

    def headers(self, seq: int) -> list[list[int]]:
        """Every local rank's header of barrier number `seq`, as lists of ints (one copy out of shared memory)."""
        return self.words[:, self._hdr_slice(seq)].tolist()

    def set_header(self, values: list[int]) -> None:
        """Publish this rank's header for the next barrier."""
        if len(values) > HEADER_WORDS:
            raise ValueError(f"a header holds at most {HEADER_WORDS} words, got {len(values)}")
        hdr = self.words[self.local_rank, self._hdr_slice(self.seq + 1)]
        hdr[:] = 0
        hdr[: len(values)] = values

    def barrier(self, what: str, timeout: float | None = None) -> int:
        """Announce arrival at the next sequence number and wait for every local rank to reach it."""
        self._check_usable(what)
        self.seq += 1
        self.words[self.local_rank, _F_SEQ] = self.seq
        self.wait(_F_SEQ, self.seq, what, timeout)
        return self.seq

    def wait(self, field: int, target: int, what: str, timeout: float | None = None, call: int | None = None) -> None:
        """Wait until every local rank's `field` is >= target; CollectiveTimeout on timeout or a dead peer."""
        col = self.words[:, field]
        if col.min() >= target:
            return
        timeout = self.timeout if timeout is None else timeout
        start = time.monotonic()
        next_check = start + 0.2
        spins = 0
        while True:
            if col.min() >= target:
                return
            spins += 1
            if spins < 64:
                continue
            if spins < 1024:
                os.sched_yield()  # 2 cores shared by several ranks: let the peer run
            else:  # the peer is descheduled or busy: sleep, in steps short enough to notice it soon
                time.sleep(min(2e-4, 1e-6 * (spins - 1024) + 2e-5))
            if spins % 32 == 0:
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + 0.2
                    missing = [lr for lr in range(self.size) if col[lr] < target]
                    if not missing:
                        return
                    dead = [lr for lr in missing if not pid_alive(int(self.words[lr, _F_PID]))
                            or self.words[lr, _F_LEFT]]
                    if dead or now - start > timeout:
                        self._fail(what, self.seq if call is None and field != _F_SEQ else target,
                                   missing, dead, now - start)

    def leave(self, why: str) -> None:
        """This rank takes no further part in these flags' collectives (a collective of it failed, `why`): a peer
        waiting for it fails at its next check instead of at its timeout."""
        self.words[self.local_rank, _F_LEFT] = 1
        self.broken = self.broken or why

    def _describe(self, lrs: list[int]) -> str:
        return ", ".join(f"local rank {lr} (global rank {self.global_ranks[lr]}, pid {int(self.words[lr, _F_PID])})"
                         for lr in lrs)

    def _fail(self, what: str, target: int, missing: list[int], dead: list[int], waited: float) -> None:
        if dead:
            msg = (f"{what} (call #{target}) on global rank {self.global_ranks[self.local_rank]}: peer process exited "
                   f"or left after an error: {self._describe(dead)}; still missing: {self._describe(missing)}")
        else:
            msg = (f"{what} (call #{target}) timed out after {waited:.1f}s on global rank "
                   f"{self.global_ranks[self.local_rank]}: did not arrive: {self._describe(missing)} "
                   f"(timeout from ${TIMEOUT_ENV} or the timeout argument)")
        self.broken = msg
        raise CollectiveTimeout(msg)

    def _check_usable(self, what: str) -> None:
        if self.broken is not None:
            raise CollectiveTimeout(f"{what}: this communicator is unusable after an earlier failure: {self.broken}")


@dataclass(eq=False)
class Segment:
    """One mapped file: `regions` per-rank regions of `region_bytes` each (1 region if node-shared)."""

    index: int
    buf: torch.Tensor  # uint8 over the whole mapping
    region_bytes: int
    shared: bool

    @property
    def base(self) -> int:
        return self.buf.data_ptr()

    def region(self, local_rank: int) -> torch.Tensor:
        r = 0 if self.shared else local_rank
        return self.buf[r * self.region_bytes:(r + 1) * self.region_bytes]


def _round_up(n: int, align: int = _ALIGN) -> int:
    return max(align, (n + align - 1) // align * align)


class Arena:
    """Shared memory of the ranks of one node. Construction and allocations are collective over the local ranks.

    Args:
        groups: NodeGroups (topology + job id); defaults to ``node_groups()`` (torchrun environment).
        timeout: seconds to wait for peers (default ``default_timeout()``).
    """

    def __init__(self, groups: NodeGroups | None = None, *, timeout: float | None = None):
        self.groups = groups or node_groups()
        topo = self.groups.topo
        self.local_rank, self.local_size = topo.local_rank, topo.local_world_size
        self.timeout = default_timeout() if timeout is None else float(timeout)
        arena_id = next(_arena_ids.setdefault(self.groups.job_id, itertools.count()))
        self._name = f"{SHM_PREFIX}{self.groups.job_id}-n{topo.node}-a{arena_id}"
        self._segments: list[Segment] = []
        self._views: dict[tuple, torch.Tensor] = {}  # Arena.view results: collectives ask for the same ones per call
        self._nseg = 0
        if self.local_rank == 0:
            sweep_stale_segments()
        ctrl_bytes = _round_up(self.local_size * _SLOT * 8)
        path = f"{SHM_DIR}/{self._name}-ctl"
        buf = self._map(path, ctrl_bytes, "arena creation (control segment)")
        try:
            words = buf.numpy().view(np.int64)[: self.local_size * _SLOT].reshape(self.local_size, _SLOT)
            self._ctrl_buf = buf
            self.flags = Flags(words, self.local_rank, self.groups.local_ranks_global, self.timeout)
            words[self.local_rank, _F_PID] = os.getpid()
            words[self.local_rank, _F_ATTACH] = 1
        except BaseException:
            _unlink(path)
            raise
        self._finish_attach(path, 1, "arena creation (control segment)")

    # ---- segment creation: local rank 0 creates, the others map, everyone unlinks once all have mapped ----

    def _map(self, path: str, nbytes: int, what: str) -> torch.Tensor:
        # every local rank checks (they see the same /dev/shm): all fail at once instead of the peers waiting
        # for a segment that cannot be created, and nothing faults (SIGBUS) later on first touch
        free, total = shm_space()
        if nbytes > free:
            raise ArenaFull(f"{what}: a shared-memory segment of {format_size(nbytes)} does not fit in {SHM_DIR} "
                            f"({format_size(free)} free of {format_size(total)}); free space there, give the "
                            "container more shared memory (docker --shm-size), or make the model or its buckets "
                            "smaller")
        if self.local_rank == 0:
            fd = _create(path, nbytes, what)
        else:
            fd = self._open_when_ready(path, nbytes, what)
            with _pending_lock:
                _pending.add(path)
        return _mmap(fd, nbytes, path)

    def _open_when_ready(self, path: str, nbytes: int, what: str) -> int:
        return _open_when_ready(path, nbytes, self.timeout,
                                f"{what}: local rank 0 (global rank {self.groups.local_ranks_global[0]}) did not "
                                f"create {path} (size {nbytes}) within {self.timeout:.1f}s")

    def _finish_attach(self, path: str, count: int, what: str) -> None:
        try:
            self.flags.wait(_F_ATTACH, count, what)
        except BaseException:
            _unlink(path)
            raise
        _unlink(path)  # every local rank has mapped it: the name is no longer needed

    def _new_segment(self, region_bytes: int, shared: bool, what: str) -> Segment:
        self.flags._check_usable(what)
        region_bytes = _round_up(region_bytes)
        total = region_bytes * (1 if shared else self.local_size)
        index = self._nseg
        self._nseg += 1
        path = f"{SHM_DIR}/{self._name}-s{index}"
        buf = self._map(path, total, what)
        try:
            self.flags.publish(_F_ATTACH, index + 2)
        except BaseException:
            _unlink(path)
            raise
        self._finish_attach(path, index + 2, what)
        seg = Segment(index=index, buf=buf, region_bytes=region_bytes, shared=shared)
        self._segments.append(seg)
        return seg

    # ---- public allocation API ----

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A per-rank tensor in shared memory (collective: every local rank calls it with the same shape/dtype).

        Each rank gets its own tensor; peers can read it (`peers`), so collectives on it are zero-copy.
        """
        shape = torch.Size([shape] if isinstance(shape, int) else shape)
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        seg = self._new_segment(nbytes, shared=False, what=f"Arena.empty({tuple(shape)}, {dtype})")
        return seg.region(self.local_rank)[:nbytes].view(dtype).view(shape)

    def shared_empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One tensor per node: every local rank gets a view of the same memory (collective call)."""
        shape = torch.Size([shape] if isinstance(shape, int) else shape)
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        seg = self._new_segment(nbytes, shared=True, what=f"Arena.shared_empty({tuple(shape)}, {dtype})")
        return seg.buf[:nbytes].view(dtype).view(shape)

    def workspace(self, region_bytes: int) -> Segment:
        """A new per-rank segment for a communicator's scratch space (collective)."""
        return self._new_segment(region_bytes, shared=False, what=f"workspace of {region_bytes} bytes")

    def release(self, seg: Segment) -> None:
        """Forget a segment (its memory is unmapped once no tensor views it). Local, not collective."""
        self._segments = [s for s in self._segments if s is not seg]
        self._views = {k: v for k, v in self._views.items() if k[0] != seg.index}

    def view(self, seg_index: int, local_rank: int, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """The tensor of `shape`/`dtype` at byte `offset` of local rank `local_rank`'s region of a segment."""
        key = (seg_index, local_rank, offset, tuple(shape), dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        seg = next((s for s in self._segments if s.index == seg_index), None)
        if seg is None:
            raise ValueError(f"segment {seg_index} is not mapped in {self!r}")
        shape = torch.Size(shape)
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > seg.region_bytes:
            raise ValueError(f"view of {nbytes} bytes at offset {offset} overflows segment {seg_index} "
                             f"(region of {seg.region_bytes} bytes)")
        if len(self._views) >= 256:
            self._views.clear()
        view = self._views[key] = seg.region(local_rank)[offset:offset + nbytes].view(dtype).view(shape)
        return view

    def locate(self, t: torch.Tensor) -> tuple[int, int, bool] | None:
        """(segment index, byte offset in this rank's region, node-shared?) when `t` is a contiguous tensor that
        lies in this arena (in this rank's region, or in a node-shared segment); else None."""
        if not t.is_contiguous() or t.device.type != "cpu":
            return None
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        for seg in self._segments:
            base = seg.base + (0 if seg.shared else self.local_rank * seg.region_bytes)
            if base <= ptr and ptr + nbytes <= base + seg.region_bytes:
                return seg.index, ptr - base, seg.shared
        return None

    def peer_view(self, t: torch.Tensor, local_rank: int, where: tuple[int, int, bool] | None = None) -> torch.Tensor:
        """The tensor at the same place as `t` in local rank `local_rank`'s region (t must be in the arena)."""
        where = where or self.locate(t)
        if where is None:
            raise ValueError("tensor is not in this arena (allocate it with Arena.empty)")
        seg = next(s for s in self._segments if s.index == where[0])
        nbytes = t.numel() * t.element_size()
        return seg.region(local_rank)[where[1]:where[1] + nbytes].view(t.dtype).view(t.shape)

    def __repr__(self) -> str:
        return (f"Arena({self._name}, local rank {self.local_rank}/{self.local_size}, "
                f"{len(self._segments)} segments)")


def leave_collectives(why: str) -> None:
    """This process takes no further part in the collectives of any arena it has now (its sync failed and is made
    again on new groups): peers waiting for it in one of them fail within 0.2 s, not at the timeout."""
    for flags in list(_all_flags):
        flags.leave(why)


def _open_when_ready(path: str, nbytes: int, timeout: float, missing: str) -> int:
    """A descriptor of segment `path` once its creator has sized it to `nbytes` (refused unless it is this user's
    and owner-only); `missing`: the CollectiveTimeout's message after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    delay = 1e-4
    while True:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
                os.close(fd)
                raise PermissionError(f"{path} is not owner-only or not ours (uid {st.st_uid}, mode "
                                      f"{oct(stat.S_IMODE(st.st_mode))}): refusing to map it")
            if st.st_size == nbytes:
                return fd
            os.close(fd)
        if time.monotonic() > deadline:
            _unlink(path)
            raise CollectiveTimeout(missing)
        time.sleep(delay)
        delay = min(delay * 2, 5e-3)


def _create(path: str, nbytes: int, what: str) -> int:
    """A descriptor of the new segment `path` (owner-only, `nbytes` reserved), named until unlinked (at this
    process's exit at the latest); ArenaFull when /dev/shm cannot hold it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    with _pending_lock:
        _pending.add(path)
    try:
        _reserve(fd, nbytes)
    except OSError as e:
        os.close(fd)
        _unlink(path)
        if e.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        free, total = shm_space()
        raise ArenaFull(f"{what}: a shared-memory segment of {format_size(nbytes)} does not fit in {SHM_DIR} "
                        f"({format_size(free)} free of {format_size(total)}, the job's other segments "
                        "counted); free space there, give the container more shared memory "
                        "(docker --shm-size), or make the model or its buckets smaller") from None
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    return fd


def _mmap(fd: int, nbytes: int, path: str) -> torch.Tensor:
    """Map segment `path` through `fd` (closed here) as uint8; unlinked if the mapping fails."""
    try:
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        _unlink(path)
        raise
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)


def create_named(name: str, nbytes: int) -> torch.Tensor:
    """A new segment /dev/shm/cocosync-<name> of `nbytes` (owner-only), mapped: other processes of the node map it
    with `map_named`, and it stays named (unlinked at this process's exit at the latest) until `unlink_named`. For
    memory made after the job's collective set-up, by some of its processes."""
    path = f"{SHM_DIR}/{SHM_PREFIX}{name}"
    return _mmap(_create(path, nbytes, f"segment {name}"), nbytes, path)


def map_named(name: str, nbytes: int, timeout: float) -> torch.Tensor:
    """Map the segment another process of the node made with `create_named` (waiting up to `timeout` seconds for
    it)."""
    path = f"{SHM_DIR}/{SHM_PREFIX}{name}"
    fd = _open_when_ready(path, nbytes, timeout, f"{path} (size {nbytes}) was not created within {timeout:.1f}s")
    with _pending_lock:
        _pending.add(path)
    return _mmap(fd, nbytes, path)


def unlink_named(name: str) -> None:
    """Remove the name of a `create_named` segment (the mappings stay valid)."""
    _unlink(f"{SHM_DIR}/{SHM_PREFIX}{name}")


class ArenaFull(MemoryError):
    """A segment would not fit in /dev/shm; the message gives the sizes."""


def format_size(n: float) -> str:
    """Bytes for a message: MiB below 256 MiB, GiB below 1 TiB, TiB above."""
    if n >= 2**40:
        return f"{n / 2**40:,.2f} TiB"
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _reserve(fd: int, nbytes: int) -> None:
    """Size a new segment and reserve its pages now (posix_fallocate): a segment that /dev/shm cannot hold fails
    here with ENOSPC, where a sparse one (ftruncate alone) would fault with SIGBUS on first touch. Segments checked
    one at a time against free space can each fit and still not fit together."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without fallocate: size it only
            raise
        os.ftruncate(fd, nbytes)


def shm_space() -> tuple[int, int]:
    """(free, total) bytes of the file system behind /dev/shm."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


#: a segment keeps its name only while the local ranks map it (milliseconds, at most the creation timeout); one
#: still named after this long was left by a job killed during that window (SIGKILL skips every cleanup)
STALE_SECONDS = 3600.0


def sweep_stale_segments(older_than: float = STALE_SECONDS) -> list[str]:
    """Remove this user's cocosync segments named in /dev/shm for longer than `older_than` seconds; their names."""
    removed = []
    now = time.time()
    for name in leftover_segments():
        path = f"{SHM_DIR}/{name}"
        try:
            st = os.stat(path)
            if st.st_uid == os.getuid() and now - st.st_mtime > older_than:
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue  # gone meanwhile, or not ours to remove
    return removed


def remove_named(pattern: str) -> list[str]:
    """Remove the named segments /dev/shm/cocosync-<pattern> (a glob pattern); their paths."""
    removed = []
    for path in glob.glob(f"{SHM_DIR}/{SHM_PREFIX}{pattern}"):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:  # (gone meanwhile)
            pass
    return removed


def leftover_segments() -> list[str]:
    """Names of cocosync segments currently in /dev/shm (tests assert this is empty)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX))
    except OSError as e:  # pragma: no cover - no /dev/shm
        if e.errno == errno.ENOENT:
            return []
        raise
