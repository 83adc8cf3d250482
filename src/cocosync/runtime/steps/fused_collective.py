"""The fast form of a FusedCollective step: CoCoNeT's FusedAllReduce, in phases around global norms.

Without norms (one phase): each rank reduces its slice chunk by chunk; while a group of reduced chunks is in cache
one generated kernel computes the sliced stages on it (slices of Replicated inputs are read in place, Sliced states
are updated in place), and the all-gathered value is written straight into the Replicated state it updates (e.g.
w), where the all-gather reads it. Within a node the kernel also sums the ranks' chunks itself: it reads every
rank's gradient chunk where it is, in its one pass (the reduced values are never written out and read back).

A norm over the whole tensor (LAMB's trust ratio, gradient clipping) cannot be finished chunk by chunk: everything
that depends on it must wait for it. Then (runtime.steps.fused_analysis) phase 0 is the reduce-scatter with a kernel
computing the level-0 outputs (LAMB's new moments) and the partial sums of squares of the level-1 norms' operands
(within a node that kernel also reduces, writing the sum over this rank's own chunk for the later phases); one
all-reduce of those few partial sums finishes the norms and the scalars after them (the trust ratio); phase 1's
kernel computes the level-1 outputs; and so on; then the all-gather (none within a node when that state is
node-shared). Still one reduction of the gradients. Across nodes the reduce-scatter and all-gather are
hierarchical (`comm.fused.reduce_and_apply`): each rank owns a distinct 1/P, so partial sums count every element once.
"""

from __future__ import annotations

import bisect
import itertools
from contextlib import contextmanager
from typing import Callable

import torch

from cocosync.dsl.ir import Node, Program
from cocosync.dsl.types import ReduceOp
from cocosync.lower.plan import FusedCollective
from cocosync.runtime.comm.fused import gather_slices, node_shared, owned_slice, reduce_and_apply
from cocosync.runtime.comm.headers import TagMismatch
from cocosync.runtime.comm.verify import verify_same
from cocosync.runtime.reference.stage import StageComm, run_stage, run_stages
from cocosync.runtime.steps.codegen import Kernel, build_kernel
from cocosync.runtime.steps.common import (
    Runner,
    StepOptions,
    eager_work,
    first_call_timeout,
    kernel_bytes,
    kernel_reduce_of,
    put_consts,
    reduce_buffer,
    store_results,
)
from cocosync.runtime.steps.fused_analysis import FusedGroup, OperandKind, Phase

__all__ = ["fused_collective_runner"]


def _pieces(ends: list[int], offset: int, n: int):
    """(segment index, start, stop) of the segments' pieces within [offset, offset + n); `ends` are cumulative."""
    i = bisect.bisect_right(ends, offset)
    lo = offset
    while lo < offset + n:
        hi = min(ends[i], offset + n)
        yield i, lo, hi
        lo, i = hi, i + 1


@contextmanager
def _naming_mismatches(step: FusedCollective, comm: StageComm, scalars: dict[str, float]):
    """Turn a TagMismatch (every rank of the node sees it in the same call) into an error naming the first scalar
    input that differs, gathered from the ranks of the program's group."""
    try:
        yield
    except TagMismatch:
        verify_same(f"{step} (its scalar inputs)", {k: "nan" if v != v else v for k, v in scalars.items()},
                    comm.group)
        raise


def _phase_kernel(g: FusedGroup, k: int, kernels: str, name: str, **kw) -> Kernel:
    """Phase k's kernel. The states it updates in place (and, when the all-gathered value goes straight into the
    Replicated state, that state's slice) are read from its outputs: `reads_out`."""
    p = g.phases[k]
    first = 1 if g.gathered in p.roots else 0
    reads_out = {id(s.args[0]): first + j for j, s in enumerate(p.writes)}
    if first and g.w_update is not None:
        reads_out.update({sc: 0 for sc, src in g.src_of.items() if src is g.w_update.args[0]})
    roots = [*p.roots, g.rs] if kw.get("reduced_out") else list(p.roots)
    return build_kernel(p.stages, roots, kernels, into=True, reads_out=reads_out, sumsq=[x for _, x in p.whole],
                        squares=[x for _, x in p.segmented], name=name, **kw)


def fused_collective_runner(group: FusedGroup, step: FusedCollective, program: Program, comm: StageComm,
                            options: StepOptions) -> Runner:
    """The runner of an analyzed fused collective (see fused_analysis.analyze and runtime_reason)."""
    shm = comm.shm
    assert shm is not None
    g, rs, ag, w_update, gathered = group, group.rs, group.ag, group.w_update, group.gathered
    one_phase = len(g.phases) == 1
    base = f"fused_{rs.name}" if one_phase else f"fused_{rs.name}_0"
    work = eager_work(options, shm.local_size)
    kerns = [_phase_kernel(g, k, options.kernels, base if k == 0 else f"fused_{rs.name}_{k}", eager_work=work)
             if p.has_kernel else None for k, p in enumerate(g.phases)]
    op: ReduceOp = rs.attr("op")
    # within a node phase 0's kernel also reduces: it reads every rank's chunk in place and sums them in its loop;
    # with later phases it writes the sum over this rank's own chunk (they read it back), else it writes nothing
    reduce_of = kernel_reduce_of(shm, rs, options.fuse_reduction)
    kern0_src = None
    if reduce_of is not None and kerns[0] is not None and any(a is rs for a in kerns[0].inputs):
        reduced_out = None if one_phase else (shm.local_rank, len(g.phases[0].roots))
        kern0_src = _phase_kernel(g, 0, options.kernels, f"{base}_src", reduce_of=reduce_of, reduced_out=reduced_out,
                                  eager_work=work)
    compiling = [True] if any(k is not None and k.backend == "inductor" for k in kerns) else []
    ends = {id(nm): list(itertools.accumulate(nm.attr("sizes"))) for nm in g.norms if nm.op == "segment_norm"}
    scratch: dict = {}
    scalar_inputs = [n for n in program.inputs if n.ndim == 0]
    call_bytes = kernel_bytes(options, shm.local_size)

    def run(env: dict) -> None:
        def scalars_at(k: int) -> None:
            for s in g.scalars:
                if g.level[id(s)] == k:
                    run_stage(s, env, comm)

        scalars_at(0)
        put_consts([a for k in kerns if k is not None for a in k.inputs], env)
        buf = reduce_buffer(rs, env, shm, options.donate, scratch).view(-1)
        writes = g.writes
        state = {id(s): env[id(s.args[0])].view(-1) for s in writes if env[id(s.args[0])].is_contiguous()}
        out = env[id(w_update.args[0])] if w_update is not None else torch.empty(ag.shape, dtype=ag.dtype)
        if len(state) < len(writes) or not out.is_contiguous() or shm.nnodes > 1 and node_shared(shm, out):
            return run_stages(step.stages, env, comm)  # memory the kernels cannot write in place: reference
        flat_out = out.view(-1)
        start, stop = owned_slice(shm, buf.numel())
        step_elems = max(1, max(shm.chunk_bytes, call_bytes) // buf.element_size())
        values = {id(s.args[1]): state[id(s)] for s in writes}  # new values of states, read from the states
        values[id(gathered)] = flat_out[start:stop]

        def chunk_buffer(key, dtype: torch.dtype, n: int) -> torch.Tensor:
            if key not in scratch:
                scratch[key] = torch.empty(step_elems, dtype=dtype)
            return scratch[key][:n]

        def view(a: Node, offset: int, n: int) -> torch.Tensor:
            k, lo = g.kinds[id(a)], offset - start
            if k is OperandKind.REDUCED:
                return buf[offset:offset + n]
            if k is OperandKind.SEGNORM:  # each element gets its segment's norm (pieces filled in a cached buffer)
                b = chunk_buffer(("seg", id(a)), a.dtype, n)
                for i, p0, p1 in _pieces(ends[id(a)], offset, n):
                    b[p0 - offset:p1 - offset].fill_(env[id(a)][i])
                return b
            if k is OperandKind.STAGE:
                return values[id(a)][lo:lo + n]
            if k is OperandKind.GLOBAL:
                return env[id(g.src_of.get(id(a), a))].reshape(-1)[offset:offset + n]
            if k is OperandKind.LOCAL:
                return env[id(a)].view(-1)[lo:lo + n]
            return env[id(a)]

        def phase(k: int) -> tuple[Callable, list[torch.Tensor]]:
            kern, p = kerns[k], g.phases[k]
            has_out = gathered in p.roots
            sqs = [torch.zeros((), dtype=torch.float32) for _ in p.whole]  # separate: never aliased
            acc = [torch.zeros(len(sqs), dtype=torch.float64),
                   *(torch.zeros(len(nm.attr("sizes")), dtype=torch.float64) for nm, _ in p.segmented)]

            def chunk(offset: int, n: int, parts: list[torch.Tensor] | None = None) -> None:
                if kern is None:
                    return
                lo = offset - start
                sqvs = [chunk_buffer(("sq", j), torch.float32, n) for j in range(len(p.segmented))]
                outs = [*([flat_out[offset:offset + n]] * has_out), *(state[id(s)][lo:lo + n] for s in p.writes)]
                if parts is None or len(parts) == 1:  # the reduced chunk is in buf
                    kern(*(view(a, offset, n) for a in kern.inputs), *outs, *sqs, *sqvs)
                elif one_phase:  # every rank's chunk: the kernel sums them in its loop
                    assert kern0_src is not None
                    args = [x for a in kern0_src.inputs for x in (parts if a is rs else [view(a, offset, n)])]
                    kern0_src(*args, *outs, *sqs, *sqvs)
                else:  # ... and writes the sum over its own chunk in buf, for the later phases
                    assert kern0_src is not None
                    me = shm.local_rank
                    peers = parts[:me] + parts[me + 1:]  # its own chunk is read from buf, where the sum goes
                    args = [x for a in kern0_src.inputs for x in (peers if a is rs else [view(a, offset, n)])]
                    kern0_src(*args, *outs, buf[offset:offset + n], *sqs, *sqvs)
                for j, sq in enumerate(sqs):
                    acc[0][j] += sq
                for j, (nm, _) in enumerate(p.segmented):
                    for i, p0, p1 in _pieces(ends[id(nm)], offset, n):
                        acc[1 + j][i] += sqvs[j][p0 - offset:p1 - offset].sum()
            return chunk, acc

        def finish_norms(acc: list[torch.Tensor], p: Phase, k: int) -> None:
            if p.whole or p.segmented:  # one all-reduce of every partial sum of this level
                sums = shm.all_reduce(torch.cat(acc).float(), ReduceOp.SUM).sqrt()
                for j, (nm, _) in enumerate(p.whole):
                    env[id(nm)] = sums[j].to(nm.dtype)
                at = len(p.whole)
                for nm, _ in p.segmented:
                    env[id(nm)] = sums[at:at + len(nm.attr("sizes"))].to(nm.dtype)
                    at += len(nm.attr("sizes"))
            scalars_at(k)

        # the scalar inputs (learning rate, betas, step-dependent corrections, ...) travel as a hash in the
        # collective's header: ranks that disagree fail at this call, naming the input, instead of diverging
        scalars = {n.name: float(env[id(n)]) for n in scalar_inputs if id(n) in env}
        # (a NaN hashes by identity: give it one value, so equal inputs always give equal tags)
        tag = hash(tuple(1e300 if v != v else v for v in scalars.values())) & 0x7FFF_FFFF_FFFF_FFFF
        with first_call_timeout(shm, compiling), _naming_mismatches(step, comm, scalars):
            chunk, acc = phase(0)
            sources = kern0_src is not None
            # one phase: the all-gather is part of the same collective (it reads the results where the kernel
            # wrote them); with later phases it waits for the last one (gather_slices)
            apply = (lambda offset, parts, _out: chunk(offset, parts[0].numel(), parts)) if sources else \
                (lambda offset, red, _out: chunk(offset, red.numel()))
            reduce_and_apply(shm, buf, apply, out=flat_out if one_phase else None, op=op, gather=one_phase,
                             fn_bytes=call_bytes, fn_sources=sources, tag=tag)
            if not one_phase:
                finish_norms(acc, g.phases[0], 1)
                for k in range(1, len(g.phases)):
                    chunk, acc = phase(k)
                    for a in range(start, stop, step_elems):
                        chunk(a, min(step_elems, stop - a))
                    finish_norms(acc, g.phases[k], k + 1)
                gather_slices(shm, flat_out)
        store_results(env, ag, w_update, out, writes)
    return run
