"""Collectives over the shared-memory arena (intra-node) and torch.distributed (inter-node).

``ShmCommunicator`` runs all_reduce, reduce_scatter, all_gather, broadcast and reduce among all ranks of the job:

* within a node, through shared memory: every rank reduces its own slice of the vector reading the peers' data
  where it lies (their arena tensor, or the copy they made into a double-buffered workspace), publishes the
  result, and the others copy it out. Reductions go chunk by chunk (cache-sized), in rank order, so every rank
  gets bitwise the same result; bfloat16/float16 accumulate in float32 (a cache-sized float32 scratch, never a
  full-size one).
* across nodes (nnodes > 1): intra-node reduce-scatter in shared memory, then torch.distributed among the ranks
  with the same local rank (gloo on CPU, NCCL on GPU) on the slice, then intra-node all-gather.

Synchronization is by flags in shared memory with a timeout: a dead or stalled peer makes the others raise
`CollectiveTimeout` naming the collective and the missing ranks. Every call validates its inputs across ranks
(dtype, sizes) through a small header in shared memory and raises an error naming the mismatching ranks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from cocosync.reduce_op import ReduceOp
from cocosync.runtime.comm.headers import Header, header, validate
from cocosync.runtime.comm.native import enabled as native_enabled
from cocosync.runtime.comm.native import one_shot as native_one_shot
from cocosync.runtime.comm.native_loops import NATIVE_DTYPES, NATIVE_OPS, NativeLoops
from cocosync.runtime.comm.reduction import (
    REDUCE_OPS,
    SUPPORTED_DTYPES,
    check_dtype,
    check_op,
    element_size,
    reduce_chunk,
    split_bounds,
)
from cocosync.runtime.comm.shm import (
    Arena,
    CollectiveTimeout,
    Segment,
)
from cocosync.runtime.comm.topology import NodeGroups, node_groups
from cocosync.runtime.comm.tuned import tuned

__all__ = ["ShmCommunicator", "Call", "CollectiveTimeout", "SUPPORTED_DTYPES", "REDUCE_OPS", "split_bounds"]

DEFAULT_CHUNK_BYTES = 256 << 10  # fits in L2 next to its inputs
# all_reduce within a node reads every peer's whole vector (one barrier) while (L - 1) x its bytes stay below this:
# small vectors are latency-bound. Measured with the native loops, P=2: three-phase 0.95x-1.11x of one-shot from
# 256 KB to 1 MB, 0.46x-0.76x from 2 MB (`cocosync tune one-shot`, 2 runs: they chose 64 KB); bench collectives at
# 1 MB: 112-126 us three-phase vs 142-145 one-shot (BENCHMARKS.md)
DEFAULT_ONE_SHOT_BYTES = 256 << 10
# The native three-phase all_reduce writes what its peers read with streaming stores from this size, and its result
# from the next (P=2, plain fp32; BENCHMARKS.md "streaming stores"): from 8 MB the workspace is 1.2x faster that way
# (slower at 4 MB, where it stays in the last-level cache); streaming the result too wins from 64 MB (1.1x-1.2x).
STREAM_WS_BYTES = 8 << 20
STREAM_RESULT_BYTES = 64 << 20
STREAM_GATHER_BYTES = 8 << 20  # all_gather's result, copies only: 16 MB 3.06 -> 2.16 ms streamed (bench collectives)


@dataclass(frozen=True, slots=True)
class Call:
    """What every rank of one collective call agreed on (after the header exchange)."""

    name: str
    seq: int
    sources: list[torch.Tensor | None]  # per local rank: flat view of its data in shared memory (None: not shared)
    zero_copy_ranks: tuple[bool, ...]  # per local rank: its data is its own arena tensor (peers read user memory)
    workspace: Segment | None  # this call's workspace (per-rank regions), if any rank copied its data in

    @property
    def zero_copy(self) -> bool:
        """Some rank's peers read its user memory: the call must end on a barrier before returning it."""
        return any(self.zero_copy_ranks)


class ShmCommunicator(NativeLoops):
    """Collectives among all ranks of the job, through shared memory within a node.

    Args:
        groups: topology and process groups (``node_groups()`` by default: needs torch.distributed initialized
            when there is more than one rank).
        arena: the shared-memory arena to use (a new one by default). Tensors allocated with ``arena.empty`` are
            reduced in place without copies.
        timeout: seconds to wait for peers before raising CollectiveTimeout (default $COCOSYNC_COLLECTIVE_TIMEOUT or
        60).
        chunk_bytes: bytes reduced at a time (cache blocking).
        one_shot_bytes: a single-node all_reduce whose (local ranks - 1) x bytes are at most this runs one-shot:
            every rank reduces the whole vector from all ranks' copies, behind one barrier (0: never). Default:
            measured on this machine by `cocosync tune one-shot` (runtime/comm/tuned.py), else 256 KB.

    All ranks must call the same collectives in the same order (as with torch.distributed), and one thread at a
    time per rank (e.g. only the CommThread while an overlap is in flight). Mismatched calls are detected through
    the shared header and raise an error naming the ranks; a dead or stalled peer raises CollectiveTimeout.
    """

    def __init__(self, groups: NodeGroups | None = None, *, arena: Arena | None = None,
                 timeout: float | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 one_shot_bytes: int | None = None, native: bool | None = None):
        # built (once per machine) or loaded before any barrier, so no peer waits on a compiling rank
        self._native = native_one_shot() if native is not False and (native or native_enabled()) else None
        self.groups = groups or node_groups()
        self.arena = arena or Arena(self.groups, timeout=timeout)
        if timeout is not None:
            self.arena.flags.timeout = float(timeout)
        self.flags = self.arena.flags
        topo = self.groups.topo
        self.topo = topo
        self.local_size, self.local_rank = topo.local_world_size, topo.local_rank
        self.world, self.rank, self.nnodes = topo.world_size, topo.rank, topo.nnodes
        if chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 4096")
        self.chunk_bytes = int(chunk_bytes)
        if one_shot_bytes is None:  # measured on this machine by `cocosync tune one-shot`, else the default
            one_shot_bytes = tuned("one_shot_bytes", self.local_size, DEFAULT_ONE_SHOT_BYTES)
        if one_shot_bytes < 0:
            raise ValueError(f"one_shot_bytes={one_shot_bytes} must be >= 0 (0 disables one-shot all_reduce)")
        self.one_shot_bytes = int(one_shot_bytes)
        self._workspaces: list[Segment | None] = [None, None]
        self._calls = 0
        self._acc: torch.Tensor | None = None
        self._one_shot = None  # the native loop bound to this communicator's control words (made on first use)
        self.stream_ws_bytes, self.stream_result_bytes = STREAM_WS_BYTES, STREAM_RESULT_BYTES
        self.stream_gather_bytes = STREAM_GATHER_BYTES

    # ------------------------------------------------------------------ public collectives

    def all_reduce(self, t: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce `t` over all ranks, in place (returns t), or into `out` (returns out; t is not modified).
        op: sum, mean, max, min."""
        name = "all_reduce"
        if (out is None and self._native is not None and isinstance(t, torch.Tensor) and op in NATIVE_OPS
                and t.dtype in NATIVE_DTYPES
                and self.nnodes == 1 and self.world > 1 and t.is_contiguous()
                and t.numel() * t.element_size() * (self.local_size - 1) <= self.one_shot_bytes
                and self._native_one_shot(name, t, t, op)):
            return t  # the common small in-place call, with the fewest Python steps
        check_dtype(name, t)
        op = check_op(name, op)
        if out is not None:
            self._check_out(name, out, t.shape, t.dtype)
        if self.world == 1:
            return t if out is None else out.copy_(t)
        x, writeback = self._flat(t)
        if self.nnodes == 1 and x.numel() * x.element_size() * (self.local_size - 1) <= self.one_shot_bytes:
            return self._all_reduce_one_shot(name, t, x, op, out)
        if out is not None:
            t = out.copy_(t)
            x, writeback = self._flat(t)
        if not (self._native is not None and self.nnodes == 1 and self._native_three_phase(name, x, op)):
            ranges = [[b] for b in split_bounds(x.numel(), self.local_size)]
            self._all_reduce_three_phase(name, x, ranges, op)
        if writeback:
            t.copy_(x.view(t.shape))
        return t

    def reduce_scatter(self, t: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce `t` (first dimension divisible by the world size) over all ranks and return this rank's slice
        ``t.chunk(world_size)[rank]`` of the result (in `out` if given). `t` is not modified."""
        name = "reduce_scatter"
        check_dtype(name, t)
        op = check_op(name, op)
        if t.dim() == 0 or t.shape[0] % self.world:
            raise ValueError(f"{name}: first dimension of shape {tuple(t.shape)} is not divisible by the world "
                             f"size {self.world}")
        out_shape = (t.shape[0] // self.world, *t.shape[1:])
        out = self._check_out(name, out, out_shape, t.dtype)
        x, _ = self._flat(t)
        c = x.numel() // self.world
        if self.world == 1:
            out.copy_(t)
            return out
        # local rank l reduces the global slices (node b, local l) for every node b
        ranges = [[((b * self.local_size + peer) * c, (b * self.local_size + peer + 1) * c) for b in range(self.nnodes)]
                  for peer in range(self.local_size)]
        mine = out.view(-1) if self.nnodes == 1 and out.is_contiguous() else torch.empty(
            self.nnodes * c, dtype=t.dtype if self.nnodes == 1 else torch.float32)
        ws_stream = self.streams(x.numel() * x.element_size())[0]
        call = self.begin_call(name, x, op=op,
                               fill=lambda region: self.copy_ranges(region, x, self.others(ranges), ws_stream))
        self.reduce_ranges(call, ranges[self.local_rank], op, x, mine,
                           scale=self.scale(op) if self.nnodes == 1 else None)
        self.end_call(call)
        if self.nnodes > 1:
            piece = torch.empty(c, dtype=torch.float32)
            self._inter_reduce_scatter(mine.view(self.nnodes, c), piece, op)
            mine = piece
        if mine.data_ptr() != out.data_ptr():
            out.copy_(mine.view(out_shape))
        return out

    def all_gather(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate every rank's `t` along the first dimension, in rank order (into `out` if given)."""
        name = "all_gather"
        check_dtype(name, t)
        out_shape = (t.shape[0] * self.world, *t.shape[1:]) if t.dim() else (self.world,)
        out = self._check_out(name, out, out_shape, t.dtype)
        if self.world == 1:
            out.copy_(t.view(out_shape))
            return out
        y, writeback = self._flat(out)
        c = t.numel()
        if self.nnodes == 1:  # peers read this rank's slice where it is (zero-copy when t is an arena tensor)
            src = t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)
            ws_stream, y_stream = self.streams(y.numel() * y.element_size(), self.stream_gather_bytes)
            call = self.begin_call(name, src, fill=lambda region: self.copy(region, src, ws_stream))
            for peer in range(self.local_size):
                self.copy(y[peer * c:(peer + 1) * c], src if peer == self.local_rank else call.sources[peer], y_stream)
            self.end_call(call)
            if writeback:
                out.copy_(y.view(out_shape))
            return out
        ranges = [[((b * self.local_size + peer) * c, (b * self.local_size + peer + 1) * c) for b in range(self.nnodes)]
                  for peer in range(self.local_size)]
        src = t.reshape(-1)
        if self.nnodes > 1:  # gather the pieces of this local rank from every node first (inter-node)
            gathered = torch.empty(self.nnodes * c, dtype=t.dtype)
            self._inter_all_gather(gathered, src.contiguous())
            for b, (s, e) in enumerate(ranges[self.local_rank]):
                y[s:e].copy_(gathered[b * c:(b + 1) * c])
            src_ranges = y
        else:
            y[ranges[self.local_rank][0][0]:ranges[self.local_rank][0][1]].copy_(src)
            src_ranges = y
        call = self.begin_call(name, y, numel=c, fill=lambda region: self.copy_ranges(region, src_ranges,
                                                                                  [ranges[self.local_rank]]),
                           data=src_ranges)
        self._gather_ranges(call, ranges, y)
        self.end_call(call)
        if writeback:
            out.copy_(y.view(out_shape))
        return out

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Copy `t` of global rank `root` into `t` on every rank (in place); returns t."""
        name = "broadcast"
        check_dtype(name, t)
        self._check_root(name, root)
        if self.world == 1:
            return t
        x, writeback = self._flat(t)
        root_node, root_local = divmod(root, self.local_size)
        if self.topo.node == root_node:
            am_root = self.local_rank == root_local
            call = self.begin_call(name, x, root=root, fill=(lambda region: region.copy_(x)) if am_root else None)
            if not am_root:
                x.copy_(call.sources[root_local])
            self.end_call(call)
        if self.nnodes > 1:
            ranges = [[b] for b in split_bounds(x.numel(), self.local_size)]
            s, e = ranges[self.local_rank][0]
            piece = x[s:e]
            if e > s:
                self._across(dist.broadcast(piece, group_src=root_node, group=self.groups.inter,  # group rank = node
                                            async_op=True))
            if self.topo.node != root_node:
                call = self.begin_call(name + " (intra all-gather)", x, root=root,
                                   fill=lambda region: self.copy_ranges(region, x, [ranges[self.local_rank]]))
                self._gather_ranges(call, ranges, x)
                self.end_call(call)
        if writeback:
            t.copy_(x.view(t.shape))
        return t

    def reduce(self, t: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, root: int = 0) -> torch.Tensor:
        """Reduce `t` over all ranks into `t` on global rank `root` (other ranks' `t` is left as it was)."""
        name = "reduce"
        check_dtype(name, t)
        op = check_op(name, op)
        self._check_root(name, root)
        if self.world == 1:
            return t
        x, writeback = self._flat(t)
        root_node, root_local = divmod(root, self.local_size)
        ranges = [[b] for b in split_bounds(x.numel(), self.local_size)]
        s, e = ranges[self.local_rank][0]
        call = self.begin_call(name, x, op=op, root=root,
                           fill=lambda region: self.copy_ranges(region, x, self.others(ranges)), always_ws=True)
        own_region = self.ws_view(call.workspace, self.local_rank, x.numel(), x.dtype)
        if self.nnodes == 1:
            self.reduce_ranges(call, ranges[self.local_rank], op, x, own_region[s:e], scale=self.scale(op))
        else:
            mine = torch.empty(e - s, dtype=torch.float32)
            self.reduce_ranges(call, ranges[self.local_rank], op, x, mine)
            if e > s:
                self._across(dist.reduce(mine, group_dst=root_node, op=op.dist_op, group=self.groups.inter,
                                         async_op=True))
            if self.topo.node == root_node:
                if op is ReduceOp.MEAN:
                    mine.div_(self.world)
                own_region[s:e].copy_(mine)
        self.flags.barrier(name + " (reduced slices published)")
        if self.topo.node == root_node and self.local_rank == root_local:
            for peer in range(self.local_size):
                ls, le = ranges[peer][0]
                x[ls:le].copy_(self.ws_view(call.workspace, peer, x.numel(), x.dtype)[ls:le])
        self.end_call(call, skip_barrier=True)  # the root read workspaces only
        if writeback and self.rank == root:
            t.copy_(x.view(t.shape))
        return t

    def barrier(self) -> None:
        """All ranks of this node (and, with several nodes, of the job) reach this point."""
        self.flags.barrier("barrier")
        if self.nnodes > 1:
            self._across(dist.barrier(group=self.groups.inter, async_op=True))
            self.flags.barrier("barrier")

    # ------------------------------------------------------------------ the call surface
    # (what every collective here, and the fused collectives of fused.py, are built from: a call begins with the
    # header exchange, reduces ranges of the sources chunk by chunk, publishes, and ends)

    def _flat(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """A flat contiguous view of t (or a contiguous copy that must be written back)."""
        if t.is_contiguous():
            return t.view(-1), False
        return t.contiguous().view(-1), True

    def _check_out(self, name: str, out: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if out is None:
            return torch.empty(shape, dtype=dtype)
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
            raise ValueError(f"{name}: out has shape {tuple(out.shape)} and dtype {out.dtype}, expected "
                             f"{tuple(shape)} and {dtype}")
        return out

    def _check_root(self, name: str, root: int) -> None:
        if not 0 <= root < self.world:
            raise ValueError(f"{name}: root={root} is not a rank in [0, {self.world})")

    def others(self, ranges: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
        return [r for peer, r in enumerate(ranges) if peer != self.local_rank]

    def scale(self, op: ReduceOp) -> float | None:
        return 1.0 / self.world if op is ReduceOp.MEAN else None

    def copy_ranges(self, dst: torch.Tensor, src: torch.Tensor, range_lists: list[list[tuple[int, int]]],
                    stream: bool = False) -> None:
        for rl in range_lists:
            for s, e in rl:
                self.copy(dst[s:e], src[s:e], stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: bool) -> None:
        """dst.copy_(src), with streaming stores (native) when `stream` and both are contiguous of one dtype."""
        if (stream and self._native is not None and dst.dtype == src.dtype and dst.is_contiguous()
                and src.is_contiguous() and dst.shape == src.shape):
            self._native.stream_copy(dst, src)
        else:
            dst.copy_(src)

    def streams(self, nbytes: int, result_from: int | None = None) -> tuple[bool, bool]:
        """(write the workspace with streaming stores, write the result so) for a collective of nbytes."""
        return nbytes >= self.stream_ws_bytes, nbytes >= (self.stream_result_bytes if result_from is None
                                                           else result_from)

    def ws_view(self, workspace: Segment | None, peer: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        assert workspace is not None
        return workspace.region(peer)[: numel * element_size(dtype)].view(dtype)

    def _ensure_ws(self, parity: int, nbytes: int) -> Segment:
        workspace = self._workspaces[parity]
        if workspace is None or workspace.region_bytes < nbytes:
            if workspace is not None:
                self.arena.release(workspace)
            cap = max(nbytes, 2 * workspace.region_bytes if workspace is not None else 0, 1 << 16)
            workspace = self._workspaces[parity] = self.arena.workspace(cap)
        return workspace

    def begin_call(self, name: str, x: torch.Tensor, *, op: ReduceOp | str = ReduceOp.SUM, root: int = -1,
                   numel: int | None = None, fill: Callable[[torch.Tensor], None] | None = None,
                   data: torch.Tensor | None = None, always_ws: bool = False, zero_copy: bool = True,
                   tag: int = 0) -> Call:
        """Header exchange + first barrier. `fill(ws_view)` copies this rank's data into its workspace region
        (called only when the data is not already an arena tensor, or always with zero_copy=False); `data` is what
        peers read (x by default). `tag`: the caller's signature of the call (e.g. a hash of its hyperparameters);
        ranks whose tags differ raise TagMismatch at once."""
        data = x if data is None else data
        parity = self._calls % 2
        self._calls += 1
        nbytes = x.numel() * x.element_size()
        where = self.arena.locate(data) if zero_copy else None
        if where is not None and where[2]:
            raise ValueError(f"{name}: the tensor is node-shared (Arena.shared_empty: one copy for all local ranks); "
                             "collectives take per-rank tensors (Arena.empty or ordinary tensors)")
        zc = where is not None
        seg, off = (where[0], where[1]) if zc else (-1, -1)
        workspace = self._workspaces[parity]
        fits = workspace is not None and workspace.region_bytes >= nbytes
        if fill is not None and not zc and fits:
            fill(self.ws_view(workspace, self.local_rank, x.numel(), x.dtype))
        self.flags.set_header(header(name, x.dtype, x.numel() if numel is None else numel, op, root, seg, off,
                                     (self.chunk_bytes, self.one_shot_bytes), tag))
        seq = self.flags.barrier(name)
        hdrs = [Header(*h[:len(Header._fields)]) for h in self.flags.headers(seq)]
        validate(name, seq, hdrs, self.local_rank, self.groups.local_ranks_global)
        need_ws = always_ws or any(h.segment < 0 for h in hdrs)
        if need_ws and not fits:  # same decision on every rank: the headers agree
            workspace = self._ensure_ws(parity, nbytes)
            if fill is not None and not zc:
                fill(self.ws_view(workspace, self.local_rank, x.numel(), x.dtype))
            self.flags.barrier(name + " (workspace grown)")
        if not need_ws and not fits:
            workspace = None
        return self._call(name, seq, hdrs, x, data, workspace)

    def _call(self, name: str, seq: int, hdrs: list[Header], x: torch.Tensor, data: torch.Tensor,
              workspace: Segment | None) -> Call:
        """The Call after the header exchange: each peer's data where it is (its arena tensor, or its workspace
        region), this rank's own `data`."""
        sources: list[torch.Tensor | None] = []
        for peer in range(self.local_size):
            if peer == self.local_rank:
                sources.append(data)
            elif hdrs[peer].segment >= 0:
                sources.append(self.arena.view(hdrs[peer].segment, peer, hdrs[peer].offset, (data.numel(),), x.dtype))
            else:
                sources.append(self.ws_view(workspace, peer, x.numel(), x.dtype))
        return Call(name=name, seq=seq, sources=sources, zero_copy_ranks=tuple(h.segment >= 0 for h in hdrs),
                    workspace=workspace)

    def end_call(self, call: Call, skip_barrier: bool = False) -> None:
        # peers read this rank's own memory (zero-copy): wait until they are done before returning it to the user.
        # Workspace copies need no barrier: the next call uses the other workspace, and the call after it starts
        # with a barrier that every peer can only pass once it has finished this one.
        if call.zero_copy and not skip_barrier:
            self.flags.barrier(call.name + " (done)")

    def acc_buf(self, numel: int) -> torch.Tensor:
        if self._acc is None or self._acc.numel() < numel:
            self._acc = torch.empty(numel, dtype=torch.float32)
        return self._acc[:numel]

    def reduce_ranges(self, call: Call, ranges: list[tuple[int, int]], op: ReduceOp, own: torch.Tensor,
                      dst: torch.Tensor, scale: float | None = None, publish: torch.Tensor | None = None) -> None:
        """Reduce this rank's `ranges` over the sources, chunk by chunk, into the packed `dst` (ranges end to end).
        own: this rank's flat data (read for its own contribution). publish: also copy each result chunk there
        (at the same offsets as the ranges)."""
        srcs = self.sources(call, own)
        step = max(1, self.chunk_bytes // own.element_size())
        pos = 0
        for s, e in ranges:
            for a in range(s, e, step):
                b = min(a + step, e)
                d = dst[pos + a - s:pos + b - s]
                reduce_chunk(d, [src[a:b] for src in srcs], op, self.acc_buf, scale)
                if publish is not None:
                    publish[a:b].copy_(d)
            pos += e - s

    def sources(self, call: Call, own: torch.Tensor) -> list[torch.Tensor]:
        """Every local rank's flat data in rank order (this rank's as `own`)."""
        return [own if peer == self.local_rank else call.sources[peer] for peer in range(self.local_size)]

    def _gather_ranges(self, call: Call, ranges: list[list[tuple[int, int]]], y: torch.Tensor) -> None:
        """Copy every peer's ranges from where it published them into y."""
        for peer in range(self.local_size):
            if peer == self.local_rank:
                continue
            src = call.sources[peer]
            for s, e in ranges[peer]:
                y[s:e].copy_(src[s:e])

    def _all_reduce_three_phase(self, name: str, x: torch.Tensor, ranges: list[list[tuple[int, int]]],
                                op: ReduceOp, call: Call | None = None) -> None:
        """Intra reduce-scatter (+ inter all-reduce of the slice) + intra all-gather, in place on flat x (`call`:
        the header exchange already done, by the native loop)."""
        s, e = ranges[self.local_rank][0]
        if call is None:
            call = self.begin_call(name, x, op=op, data=x,
                                   fill=lambda region: self.copy_ranges(region, x, self.others(ranges)))
        # an arena x: peers read the result in place; else it is published in this rank's workspace region
        publish = None
        if self.arena.locate(x) is None and call.workspace is not None:
            publish = self.ws_view(call.workspace, self.local_rank, x.numel(), x.dtype)
        if self.nnodes == 1:
            self.reduce_ranges(call, ranges[self.local_rank], op, x, x[s:e], scale=self.scale(op), publish=publish)
        else:
            self.reduce_slice_across_nodes(call, ranges[self.local_rank], op, x)
            if publish is not None:
                publish[s:e].copy_(x[s:e])
        self.flags.barrier(name + " (reduced slices published)")
        self._gather_ranges(call, ranges, x)
        self.end_call(call)

    def reduce_slice_across_nodes(self, call: Call, mine: list[tuple[int, int]], op: ReduceOp,
                                  x: torch.Tensor) -> None:
        """x[s:e] (this rank's one range) = the reduction over every rank of the job: over the node's ranks here,
        then across nodes through torch.distributed among the ranks with this local rank, in float32 (16-bit sums
        are rounded once, at the end)."""
        s, e = mine[0]
        part = torch.empty(e - s, dtype=torch.float32) if x.dtype != torch.float32 else x[s:e]
        self.reduce_ranges(call, mine, op, x, part)
        if e > s:
            self._across(dist.all_reduce(part, op=op.dist_op, group=self.groups.inter, async_op=True))
            if op is ReduceOp.MEAN:
                part.div_(self.world)
            if part.data_ptr() != x.data_ptr() + s * x.element_size():
                x[s:e].copy_(part)

    def _all_reduce_one_shot(self, name: str, t: torch.Tensor, x: torch.Tensor, op: ReduceOp,
                             out: torch.Tensor | None) -> torch.Tensor:
        """One barrier, then every rank reduces the whole vector from all ranks' workspace copies, in rank order (the
        same bits on every rank). Each rank reads L times the data: for small vectors, where the barriers of the
        three-phase algorithm cost more than the reads. Arena tensors are copied too: then nobody reads x, so the
        result can go straight into it and no closing barrier is needed (the workspaces alternate by call)."""
        target = t if out is None else out
        if self._native is not None and self._native_one_shot(name, x, target, op):
            return target
        call = self.begin_call(name, x, op=op, fill=lambda region: region.copy_(x), zero_copy=False)
        dst = target.view(-1) if target.is_contiguous() else x if out is None else torch.empty_like(x)
        self.reduce_ranges(call, [(0, x.numel())], op, x, dst, scale=self.scale(op))
        if dst.data_ptr() != target.data_ptr():
            target.copy_(dst.view(target.shape))
        return target

    def _inter_reduce_scatter(self, blocks: torch.Tensor, out: torch.Tensor, op: ReduceOp) -> None:
        """Reduce (nnodes, c) blocks across nodes; node b gets block b (torch.distributed, inter group)."""
        dop = op.dist_op
        try:  # (blocking: gloo runs a reduce-scatter when it is waited for, so `_across` could not poll it)
            reduce_scatter_single(out, blocks.contiguous().view(-1), op=dop, group=self.groups.inter)
        except (RuntimeError, NotImplementedError):  # backends without reduce_scatter: all_reduce then keep our block
            full = blocks.contiguous().clone()
            self._across(dist.all_reduce(full, op=dop, group=self.groups.inter, async_op=True))
            out.copy_(full[self.topo.node])
        if op is ReduceOp.MEAN:
            out.div_(self.world)

    def _inter_all_gather(self, out: torch.Tensor, t: torch.Tensor) -> None:
        try:
            self._across(all_gather_single(out, t, group=self.groups.inter, async_op=True))
        except CollectiveTimeout:
            raise
        except (RuntimeError, NotImplementedError):
            parts = list(out.view(self.nnodes, -1).unbind(0))
            self._across(dist.all_gather(parts, t, group=self.groups.inter, async_op=True))

    def _across(self, work: dist.Work) -> None:
        """Wait for a collective among the nodes (`work`: async, on the inter group). It also ends, with a
        CollectiveTimeout, once this rank leaves its collectives (`leave_collectives`, from any thread): a peer on
        another node may have left the collective for new groups (its own node's peer died), and gloo would wait for
        it until the group's timeout. The wait blocks on the work's future (no spinning: the cores are the workers'),
        looking at this rank's flags every ACROSS_LOOK_S. Only for work that runs on its own (gloo's reduce-scatter
        runs when waited for: its future stays pending until then)."""
        done = threading.Event()
        work.get_future().add_done_callback(lambda _f: done.set())
        while not done.wait(ACROSS_LOOK_S):
            if self.flags.broken is not None:
                raise CollectiveTimeout(f"a collective across nodes on global rank {self.rank} was given up: this "
                                        f"rank left its collectives ({self.flags.broken})")
        work.wait()  # (its error, if it failed)


#: seconds between two looks at whether this rank left its collectives while a collective across nodes runs
#: (`ShmCommunicator._across`)
ACROSS_LOOK_S = 0.1

#: torch.distributed's single-tensor reduce-scatter / all-gather (the names changed across torch versions)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
