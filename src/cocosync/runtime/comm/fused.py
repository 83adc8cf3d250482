"""Fused collectives: reduce-scatter -> computation -> all-gather as one operation.

``fused_all_reduce(comm, t, fn)`` is CoCoNeT's FusedAllReduce: each rank reduces its slice of `t` chunk by chunk
and, while the reduced chunk is still in cache, calls ``fn(offset, reduced_chunk, out_chunk)``, which writes the
chunk's result into ``out_chunk`` (e.g. the Adam update of the parameters' slice); the all-gather then reads the
results where ``fn`` wrote them. Zero-copy when `out` lives in the arena; with a node-shared `out`
(``Arena.shared_empty``, a Replicated tensor stored once per node) there is no all-gather at all within a node.
With ``fn_sources=True`` fn gets every rank's chunk instead and sums it itself inside its own loop: the reduced
values are never written to memory and read back (the compiled optimizer steps do this within a node).
"""

from __future__ import annotations

from typing import Callable

import torch

from cocosync.reduce_op import ReduceOp
from cocosync.runtime.comm.collectives import Call, ShmCommunicator
from cocosync.runtime.comm.reduction import check_dtype, check_op, reduce_chunk, split_bounds

__all__ = ["fused_all_reduce", "reduce_and_apply", "gather_slices", "slice_bounds", "owned_slice", "node_shared"]

ChunkFn = Callable[[int, torch.Tensor, torch.Tensor], None]


def slice_bounds(comm: ShmCommunicator, numel: int) -> tuple[int, int]:
    """[start, stop) of the flat slice this rank reduces (and passes to `fn`) in a fused all-reduce of `numel`
    elements. With several nodes, the ranks with the same local rank share a slice."""
    return split_bounds(numel, comm.local_size)[comm.local_rank]


def fused_all_reduce(comm: ShmCommunicator, t: torch.Tensor, fn: ChunkFn, *, out: torch.Tensor | None = None,
                     op: ReduceOp | str = ReduceOp.SUM, gather: bool = True, fn_bytes: int = 0,
                     fn_sources: bool = False, tag: int = 0) -> torch.Tensor:
    """Reduce `t` over all ranks; on this rank's slice call ``fn(offset, reduced_chunk, out_chunk)`` chunk by chunk;
    then (if `gather`) all-gather the results so every rank's `out` holds all of them.

    Args:
        t: contiguous per-rank tensor (an ``Arena.empty`` tensor avoids the copy-in). Its slice is overwritten by
            the reduced values; other elements are left as they were.
        fn: ``fn(offset, reduced, out_chunk)``: `offset` is the flat element offset of the chunk, `reduced` the
            reduced values (mean already divided for op="mean"), `out_chunk` the view of `out` at that offset,
            holding its current values (e.g. the parameters): fn must write the chunk's result there.
        out: where the results go (same numel and dtype as `t`; default `t` itself). A node-shared arena tensor is
            updated in place by each rank for its slice, with no all-gather within the node.
        gather: False keeps only this rank's slice updated (the "sliced" use, e.g. a sharded optimizer).
        fn_bytes: call fn on up to this many bytes of consecutive reduced chunks at once (default: one chunk,
            `comm.chunk_bytes`): fewer calls for a compiled kernel whose every call has a fixed cost.
        fn_sources: fn reduces too, in the same pass as its computation: its second argument is a list, either
            every local rank's chunk in rank order (to be reduced with `op`: sum them in that order, then scale by
            1/world for "mean"), or the reduced chunk alone (a list of one: when the data crosses nodes or `out`
            is a plain tensor). t's slice is then left as it was. Saves writing the reduced values and reading
            them back.
        tag: the caller's signature of this call (e.g. a hash of its hyperparameters), compared across the ranks
            of the node in the call's header at no extra cost: ranks with different tags raise TagMismatch at once.
    Returns:
        out.
    """
    name = "fused_all_reduce"
    check_dtype(name, t)
    op = check_op(name, op)
    if not t.is_contiguous():
        raise ValueError(f"{name}: t must be contiguous (got strides {t.stride()})")
    out = t if out is None else out
    if out.numel() != t.numel() or out.dtype != t.dtype or not out.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous with t's numel and dtype: got {out.numel()} x {out.dtype}, "
                         f"expected {t.numel()} x {t.dtype}")
    x, y = t.view(-1), out.view(-1)
    ranges = [[b] for b in split_bounds(x.numel(), comm.local_size)]
    if comm.world == 1:
        step = max(1, max(comm.chunk_bytes, fn_bytes) // x.element_size())
        for a in range(0, x.numel(), step):
            fn(a, [x[a:a + step]] if fn_sources else x[a:a + step], y[a:a + step])
        return out
    _fused_flat(comm, name, x, y, ranges, op, fn, gather=gather, fn_bytes=fn_bytes, fn_sources=fn_sources, tag=tag)
    return out


def _fused_flat(comm: ShmCommunicator, name: str, x: torch.Tensor, y: torch.Tensor,
                ranges: list[list[tuple[int, int]]], op: ReduceOp, fn: Callable, *, gather: bool, fn_bytes: int,
                fn_sources: bool, tag: int) -> None:
    """Intra reduce-scatter (+ inter all-reduce of the slice) + fn on this rank's chunks + intra all-gather of y,
    on flat x, through the communicator's call surface. fn_sources: fn gets a list: every rank's chunk to reduce
    itself (within a node, with an arena or node-shared y), else the reduced chunk alone (a list of one)."""
    me = comm.local_rank
    s, e = ranges[me][0]
    where = comm.arena.locate(y)
    shared_out = where is not None and where[2]  # one copy per node: each rank writes its slice, no all-gather
    arena_out = where is not None and not where[2]  # peers read the results where fn wrote them
    call = comm.begin_call(name, x, op=op, fill=lambda region: comm.copy_ranges(region, x, comm.others(ranges)),
                           data=x, always_ws=where is None, tag=tag)
    # a plain y: results are published in this rank's workspace region for the peers to copy
    publish = None if where is not None else comm.ws_view(call.workspace, me, x.numel(), x.dtype)
    sources = fn_sources and comm.nnodes == 1 and publish is None
    if fn_sources and not sources:  # reduce here; fn gets the reduced chunk as a list of one
        fn = (lambda f: lambda o, r, out: f(o, [r], out))(fn)
    if comm.nnodes == 1:
        _reduce_apply_ranges(comm, call, ranges[me], op, x, x[s:e], comm.scale(op), publish, fn, y, fn_bytes,
                             sources)
    else:
        comm.reduce_slice_across_nodes(call, ranges[me], op, x)
        step = max(1, max(comm.chunk_bytes, fn_bytes) // x.element_size())
        for a in range(s, e, step):
            b = min(a + step, e)
            fn(a, x[a:b], y[a:b])
        if publish is not None:
            publish[s:e].copy_(y[s:e])
    if not gather:
        comm.end_call(call)
        return
    if shared_out:  # every rank wrote its slice in place; wait for all of them
        comm.flags.barrier(name + " (slices written)")
        return
    comm.flags.barrier(name + " (reduced slices published)")
    for peer in range(comm.local_size):
        if peer == me:
            continue
        ls, le = ranges[peer][0]
        if arena_out:
            assert where is not None
            y[ls:le].copy_(comm.arena.view(where[0], peer, where[1], (y.numel(),), y.dtype)[ls:le])
        else:
            y[ls:le].copy_(comm.ws_view(call.workspace, peer, x.numel(), x.dtype)[ls:le])
    if arena_out:
        comm.flags.barrier(name + " (done)")
    else:
        comm.end_call(call)


def _reduce_apply_ranges(comm: ShmCommunicator, call: Call, ranges: list[tuple[int, int]], op: ReduceOp,
                         own: torch.Tensor, dst: torch.Tensor, scale: float | None, publish: torch.Tensor | None,
                         fn: Callable, fn_out: torch.Tensor, fn_bytes: int, fn_sources: bool) -> None:
    """Reduce this rank's `ranges` chunk by chunk into the packed `dst` and call fn(offset, reduced, out_chunk)
    while the chunks are in cache, writing into fn_out (then published from there); with fn_bytes > chunk_bytes,
    fn gets several consecutive reduced chunks at once (fewer calls of a kernel with a fixed cost per call).
    fn_sources: fn does the reduction itself: it gets the list of every rank's chunk (rank order) instead of the
    reduced chunk, and nothing is written to `dst` (one pass over the sources, no reduced copy)."""
    srcs = comm.sources(call, own)
    step = max(1, comm.chunk_bytes // own.element_size())
    fn_step = max(step, fn_bytes // own.element_size())
    if fn_sources:
        assert publish is None
        for s, e in ranges:
            for a in range(s, e, fn_step):
                b = min(a + fn_step, e)
                fn(a, [src[a:b] for src in srcs], fn_out[a:b])
        return
    pos = 0
    for s, e in ranges:
        pending = s  # start of the reduced chunks not yet passed to fn
        for a in range(s, e, step):
            b = min(a + step, e)
            reduce_chunk(dst[pos + a - s:pos + b - s], [src[a:b] for src in srcs], op, comm.acc_buf, scale)
            if b - pending < fn_step and b < e:
                continue
            oc = fn_out[pending:b]
            fn(pending, dst[pos + pending - s:pos + b - s], oc)
            if publish is not None and publish.data_ptr() != fn_out.data_ptr():
                publish[pending:b].copy_(oc)
            pending = b
        pos += e - s


def node_shared(comm: ShmCommunicator, t: torch.Tensor) -> bool:
    """Whether `t` is a node-shared arena tensor (``Arena.shared_empty``: one copy per node)."""
    where = comm.arena.locate(t)
    return where is not None and where[2]


def owned_slice(comm: ShmCommunicator, numel: int) -> tuple[int, int]:
    """[start, stop) of the flat slice this rank computes in `reduce_and_apply`: on one node its `slice_bounds`;
    across nodes its 1/P in rank order (the DSL's Sliced order), so numel must divide by the world size."""
    if comm.nnodes == 1:
        return slice_bounds(comm, numel)
    if numel % comm.world:
        raise ValueError(f"owned_slice: {numel} elements do not split evenly over {comm.world} ranks on "
                         f"{comm.nnodes} nodes")
    c = numel // comm.world
    return comm.rank * c, (comm.rank + 1) * c


def reduce_and_apply(comm: ShmCommunicator, t: torch.Tensor, fn: ChunkFn, *, out: torch.Tensor | None = None,
                     op: ReduceOp | str = ReduceOp.SUM, gather: bool = True, fn_bytes: int = 0,
                     fn_sources: bool = False, tag: int = 0) -> torch.Tensor:
    """Reduce `t` over all ranks, call `fn(offset, reduced, out_chunk)` on this rank's `owned_slice`, then (if
    `gather`) all-gather `out`; the reduced values are left in t's slice, as `fused_all_reduce` does (unless fn
    did the reduction: fn_sources).

    One node: `fused_all_reduce` (fn on each chunk while it is in cache). Across nodes: the hierarchical
    reduce_scatter (shared memory, then torch.distributed among the ranks with this local rank), fn on this rank's
    1/P, and the hierarchical all_gather: every rank computes a different slice, so the sliced state of a DSL
    program (Sliced over all P ranks) lines up, and partial sums over slices count each element once.
    fn_sources: as in `fused_all_reduce` (across nodes fn always gets the reduced chunk, as a list of one)."""
    if comm.nnodes == 1:
        return fused_all_reduce(comm, t, fn, out=out, op=op, gather=gather, fn_bytes=fn_bytes, fn_sources=fn_sources,
                                tag=tag)
    out = t if out is None else out
    x, y = t.view(-1), out.view(-1)
    start, stop = owned_slice(comm, x.numel())
    x[start:stop].copy_(comm.reduce_scatter(x, op))
    step = max(1, max(comm.chunk_bytes, fn_bytes) // x.element_size())
    for a in range(start, stop, step):
        b = min(stop, a + step)
        fn(a, [x[a:b]] if fn_sources else x[a:b], y[a:b])
    if gather:
        gather_slices(comm, y)
    return out


def gather_slices(comm: ShmCommunicator, out: torch.Tensor) -> None:
    """Each rank has written its slice (`owned_slice`) of the flat `out`; afterwards every rank's `out` holds all
    of them: the all-gather half of a fused all-reduce, for steps that compute their slice in several phases.
    A node-shared `out` (``Arena.shared_empty``) only waits for the peers' writes; an arena `out` is read in place.
    Across nodes: the hierarchical all_gather (a node-shared `out` is refused: every local rank would write it)."""
    y = out.view(-1)
    if comm.world == 1:
        return
    shared = node_shared(comm, y)
    if comm.nnodes > 1:
        if shared:
            raise ValueError("gather_slices: a node-shared out across nodes (each local rank would write all of it)")
        s, e = owned_slice(comm, y.numel())
        comm.all_gather(y[s:e].clone(), out=y)
        return
    if shared:
        comm.flags.barrier("gather_slices (slices written)")
        return
    s, e = slice_bounds(comm, y.numel())
    if y.numel() % comm.world:
        raise ValueError(f"gather_slices: {y.numel()} elements do not split evenly over {comm.world} ranks")
    comm.all_gather(y[s:e], out=y)
