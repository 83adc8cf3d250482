"""Fused collectives (reduce-scatter -> computation -> all-gather as one operation) and chunked overlap.

``fused_all_reduce(comm, t, fn)`` is CoCoNeT's FusedAllReduce: each rank reduces its slice of `t` chunk by chunk
and, while the reduced chunk is still in cache, calls ``fn(offset, reduced_chunk, out_chunk)``, which writes the
chunk's result into ``out_chunk`` (e.g. the Adam update of the parameters' slice); the all-gather then reads the
results where ``fn`` wrote them. Zero-copy when `out` lives in the arena; with a node-shared `out`
(``Arena.shared_empty``, a Replicated tensor stored once per node) there is no all-gather at all within a node.
With ``fn_sources=True`` fn gets every rank's chunk instead and sums it itself inside its own loop: the reduced
values are never written to memory and read back (the compiled optimizer steps do this within a node).

``overlap_chunks(produce, communicate, n)`` pipelines by chunks: chunk i is computed on the calling thread while
chunk i-1 is communicated on a background thread (torch kernels, gloo and the shared-memory copies release the GIL).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from cocosync.runtime.collectives import ShmCommunicator, _check_dtype, _check_op, split_bounds

__all__ = ["fused_all_reduce", "reduce_and_apply", "gather_slices", "slice_bounds", "owned_slice", "node_shared",
           "adam_chunk_update", "AdamSlice", "CommThread", "overlap_chunks"]

ChunkFn = Callable[[int, torch.Tensor, torch.Tensor], None]


def slice_bounds(comm: ShmCommunicator, numel: int) -> tuple[int, int]:
    """[start, stop) of the flat slice this rank reduces (and passes to `fn`) in a fused all-reduce of `numel`
    elements. With several nodes, the ranks with the same local rank share a slice."""
    return split_bounds(numel, comm.L)[comm.me]


def fused_all_reduce(comm: ShmCommunicator, t: torch.Tensor, fn: ChunkFn, *, out: torch.Tensor | None = None,
                     op: str = "sum", gather: bool = True, fn_bytes: int = 0,
                     fn_sources: bool = False) -> torch.Tensor:
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
    Returns:
        out.
    """
    name = "fused_all_reduce"
    _check_dtype(name, t)
    op = _check_op(name, op)
    if not t.is_contiguous():
        raise ValueError(f"{name}: t must be contiguous (got strides {t.stride()})")
    out = t if out is None else out
    if out.numel() != t.numel() or out.dtype != t.dtype or not out.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous with t's numel and dtype: got {out.numel()} x {out.dtype}, "
                         f"expected {t.numel()} x {t.dtype}")
    x, y = t.view(-1), out.view(-1)
    ranges = [[b] for b in split_bounds(x.numel(), comm.L)]
    if comm.world == 1:
        step = max(1, max(comm.chunk_bytes, fn_bytes) // x.element_size())
        for a in range(0, x.numel(), step):
            fn(a, [x[a:a + step]] if fn_sources else x[a:a + step], y[a:a + step])
        return out
    comm._all_reduce_flat(name, x, ranges, op, inter=comm.nnodes > 1, fn=fn, fn_out=y, gather=gather,
                          fn_bytes=fn_bytes, fn_sources=fn_sources)
    return out


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
                     op: str = "sum", gather: bool = True, fn_bytes: int = 0,
                     fn_sources: bool = False) -> torch.Tensor:
    """Reduce `t` over all ranks, call `fn(offset, reduced, out_chunk)` on this rank's `owned_slice`, then (if
    `gather`) all-gather `out`; the reduced values are left in t's slice, as `fused_all_reduce` does (unless fn
    did the reduction: fn_sources).

    One node: `fused_all_reduce` (fn on each chunk while it is in cache). Across nodes: the hierarchical
    reduce_scatter (shared memory, then torch.distributed among the ranks with this local rank), fn on this rank's
    1/P, and the hierarchical all_gather: every rank computes a different slice, so the sliced state of a DSL
    program (Sliced over all P ranks) lines up, and partial sums over slices count each element once.
    fn_sources: as in `fused_all_reduce` (across nodes fn always gets the reduced chunk, as a list of one)."""
    if comm.nnodes == 1:
        return fused_all_reduce(comm, t, fn, out=out, op=op, gather=gather, fn_bytes=fn_bytes, fn_sources=fn_sources)
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


_FUSED_ADAM = getattr(torch, "_fused_adam_", None)
_steps: dict[int, torch.Tensor] = {}


def _step_tensor(step: int) -> torch.Tensor:
    t = _steps.get(step)
    if t is None:
        if len(_steps) > 64:
            _steps.clear()
        t = _steps[step] = torch.tensor(float(step))
    return t


def adam_chunk_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int,
                      lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                      weight_decay: float = 0.0) -> None:
    """One Adam step on a chunk, in place, with torch.optim.Adam's formulas (non-amsgrad).

    Uses torch's fused CPU Adam kernel (one pass over p, g, m, v: the chunk is read and written once) when this
    torch has it, else the single-tensor formulas of torch.optim.Adam."""
    b1, b2 = betas
    if _FUSED_ADAM is not None and p.dtype == g.dtype == m.dtype == v.dtype and p.device.type == "cpu":
        _FUSED_ADAM([p], [g], [m], [v], [], [_step_tensor(step)], amsgrad=False, lr=lr, beta1=b1, beta2=b2,
                    weight_decay=weight_decay, eps=eps, maximize=False)
        return
    if weight_decay:
        g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    bc1 = 1 - b1 ** step
    bc2_sqrt = math.sqrt(1 - b2 ** step)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)


class AdamSlice:
    """Adam state (m, v) for this rank's slice of a flat parameter vector: ``fn`` for fused_all_reduce.

    Usage: ``opt = AdamSlice(comm, numel, lr=...)``; each step: ``opt.step(grads, params)`` reduces the gradients
    (mean over ranks by default), updates the slice, and all-gathers the parameters.
    """

    def __init__(self, comm: ShmCommunicator, numel: int, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, grad_op: str = "mean"):
        self.comm = comm
        self.start, self.stop = slice_bounds(comm, numel)
        self.m = torch.zeros(self.stop - self.start)
        self.v = torch.zeros(self.stop - self.start)
        self.hp = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.grad_op = grad_op
        self.steps = 0

    def chunk_fn(self) -> ChunkFn:
        s, step, hp = self.start, self.steps, self.hp

        def fn(offset: int, g: torch.Tensor, p: torch.Tensor) -> None:
            a, b = offset - s, offset - s + g.numel()
            adam_chunk_update(p, g, self.m[a:b], self.v[a:b], step=step, **hp)
        return fn

    def step(self, grads: torch.Tensor, params: torch.Tensor, gather: bool = True) -> torch.Tensor:
        self.steps += 1
        return fused_all_reduce(self.comm, grads, self.chunk_fn(), out=params, op=self.grad_op, gather=gather)


class CommThread:
    """One background thread that runs communication calls in submission order."""

    def __init__(self) -> None:
        self._ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cocosync-comm")

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        return self._ex.submit(fn, *args, **kwargs)

    def close(self) -> None:
        self._ex.shutdown(wait=True)

    def __enter__(self) -> "CommThread":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def overlap_chunks(produce: Callable[[int], Any], communicate: Callable[[int, Any], Any], n_chunks: int, *,
                   thread: CommThread | None = None) -> list[Any]:
    """For i in range(n_chunks): ``c = produce(i)`` on this thread while ``communicate(i - 1, c_prev)`` runs on the
    background thread. Communications run one at a time, in order (every rank issues them in the same order).
    Returns the communicate results in chunk order; an exception in either is raised here after the
    in-flight communication finished."""
    if n_chunks < 0:
        raise ValueError(f"n_chunks={n_chunks} must be >= 0")
    own = thread is None
    th = thread or CommThread()
    results: list[Any] = []
    pending: Future | None = None
    try:
        for i in range(n_chunks):
            try:
                c = produce(i)
            except BaseException:
                if pending is not None:
                    pending.exception()  # let the in-flight communication finish before unwinding
                raise
            if pending is not None:
                results.append(pending.result())
            pending = th.submit(communicate, i, c)
        if pending is not None:
            results.append(pending.result())
    finally:
        if own:
            th.close()
    return results
