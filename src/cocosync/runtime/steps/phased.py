"""A fused collective whose sliced computation needs global norms (LAMB's trust ratio, gradient clipping).

A norm over the whole tensor cannot be finished chunk by chunk inside one reduce-scatter: every element that
depends on it must wait for it. So the step runs in phases over this rank's slice, still one reduce-scatter and
one all-gather of the data. A stage's level is the number of norms on its longest path from the inputs:

  0. reduce-scatter, and on each group of reduced chunks (while in cache) one kernel computing the level-0 outputs
     (e.g. LAMB's new moments) and the partial sums of squares of the level-1 norms' operands (LAMB's ||w||, ||r||);
     within a node that kernel does the reduction too: it reads every rank's chunk in place and writes the sum
     over this rank's own chunk, in the same loop;
  -- one all-reduce of those few partial sums; the norms and the scalars that depend on them (the trust ratio);
  1. one kernel per group computing the level-1 outputs (w - lr * ratio * r, written straight into the Replicated
     state's slice); and so on (LAMB with clipping in the program has two levels: the clip norm, then ||r||);
  then the all-gather (none within a node when that state is node-shared).

Nothing crosses phases through memory except the program's own outputs: a later phase recomputes the earlier
values it needs (LAMB's r) from the reduced gradient (still in place), the inputs and the states already written
(a new moment is read from the moment), which moves fewer bytes than writing and re-reading them.
Across nodes the reduce-scatter and all-gather are hierarchical (`fused.reduce_and_apply`): each rank owns a
distinct 1/P, so partial sums over slices count every element once.
"""

from __future__ import annotations

import bisect
import itertools

import torch

from cocosync.dsl.ir import Node, Program
from cocosync.dsl.registry import OPS
from cocosync.lower.plan import FusedCollective
from cocosync.runtime.comm.fused import gather_slices, node_shared, owned_slice, reduce_and_apply
from cocosync.runtime.stage import StageComm, run_stage, run_stages
from cocosync.runtime.steps.codegen import build_kernel, can_fuse
from cocosync.runtime.steps.common import (
    KERNEL_BYTES,
    Runner,
    StepOptions,
    across_nodes_ok,
    first_call_timeout,
    kernel_reduce_of,
    outside_readers,
    put_consts,
    reduce_buffer,
    store_results,
)

__all__ = ["phased_collective_runner"]

# a segment_norm is a norm per segment (LAMB's per-tensor ratio): the same phases
NORMS = tuple(op for op, d in OPS.items() if d.norm)


def _levels(step) -> dict[int, int]:
    """id -> level (norms on the longest path from the inputs) for every stage of the step."""
    level: dict[int, int] = {}
    for s in step.order:
        level[id(s)] = max((level.get(id(a), 0) for a in s.args), default=0) + (s.op in NORMS)
    return level


class _Kernel:
    """What one phase's kernel computes: `stages` for the `roots` (state writes, the gathered slice), and the sums
    of squares of the `operands` of the next level's `norms` (whole, or per segment for a segment_norm)."""

    def __init__(self, stages: list[Node], roots: list[Node], norms: list[Node], operands: list[Node]):
        self.stages, self.roots = stages, roots
        self.whole = [(nm, x) for nm, x in zip(norms, operands) if nm.op == "norm"]
        self.segmented = [(nm, x) for nm, x in zip(norms, operands) if nm.op == "segment_norm"]


class _Phases:
    """The step cut into phases, checked; `ok` False means: use the reference path."""

    def __init__(self, step, program: Program, shm):
        self.ok = False
        rs, ag = step.rs, step.ag
        if shm is None or rs.layout.dim != 0 or ag.args[0].layout.dim != 0 or not across_nodes_ok(shm, rs):
            return
        self.norms = [s for s in step.compute if s.op in NORMS]
        if not self.norms:
            return
        self.rs, self.ag, self.shape, self.gathered = rs, ag, rs.shape, ag.args[0]
        self.inside, self.level = {id(s) for s in step.order}, _levels(step)
        self.w_update = next((o for o in program.stages if o.op == "update" and o.args[1] is ag), None)
        self.scalars = [s for s in step.compute if s.ndim == 0 and s.op not in NORMS]
        scatters = [s for s in step.compute if s.op == "scatter"]
        body = [s for s in step.compute if s.ndim > 0 and s.op not in ("scatter", *NORMS) and s is not self.w_update]
        if not all(can_fuse(s) and s.shape == self.shape for s in body) or not all(map(can_fuse, self.scalars)):
            return
        if not all(s.layout.dim == 0 and s.args[0].shape == self.shape for s in scatters):
            return
        self.src_of = {id(s): s.args[0] for s in scatters}
        if any(self.kind(a) is None for s in body + self.norms for a in s.args if a.op != "const"):
            return
        self.K = max(self.level[id(s)] for s in body)
        writes = [s for s in body if s.op == "update"]
        self.writes = [[s for s in writes if self.level[id(s)] == k] for k in range(self.K + 1)]
        # the phase each state is written in (the Replicated one by the all-gathered value's phase)
        self.written_at = {id(s.args[0]): self.level[id(s)] for s in writes}
        self.value_at = {id(s.args[1]): (self.level[id(s)], s) for s in writes}
        if self.w_update is not None:
            self.written_at[id(self.w_update.args[0])] = self.level[id(self.gathered)]
        order = {id(s): i for i, s in enumerate(step.order)}
        # an input that the step also reads through its scatter is read once, as that slice (no aliasing)
        scatter_of = {id(sc.args[0]): sc for sc in scatters}
        self.kernels: list[_Kernel] = []  # one per phase
        for k in range(self.K + 1):
            roots = [*([self.gathered] if self.level[id(self.gathered)] == k else []), *self.writes[k]]
            norms = [nm for nm in self.norms if self.level[id(nm)] == k + 1]
            operands = [scatter_of.get(id(nm.args[0]), nm.args[0]) for nm in norms]
            stages = self._closure(roots + operands, k, body)
            if stages is None:
                return
            stages.sort(key=lambda s: order[id(s)])
            self.kernels.append(_Kernel(stages, roots, norms, operands))
        self.ok = self._outside_safe(program)

    def kind(self, a: Node) -> str | None:
        """How this rank reads its slice of operand `a` ('reduced', 'segnorm', 'stage', 'global', 'local',
        'scalar')."""
        if a is self.rs:
            return "reduced"
        if a.op == "segment_norm" and id(a) in self.inside:
            return "segnorm"
        if id(a) in self.inside and a.ndim and id(a) not in self.src_of:
            return "stage"
        if id(a) in self.src_of or (a.ndim and a.layout.is_replicated and a.shape == self.shape
                                    and id(a) not in self.inside):
            return "global"
        if a.ndim:
            return "local" if a.layout == self.rs.layout and a.shape == self.shape and id(a) not in self.inside \
                else None
        return "scalar"

    def _closure(self, roots: list[Node], k: int, body: list[Node]):
        """The stages phase k computes for `roots`, recomputing earlier values (those written by earlier phases are
        read back from where they were written); None when it would read a state's old value after it was
        overwritten."""
        bodyset = {id(s) for s in body}
        stages: list[Node] = []
        seen: set[int] = set()
        todo = list(roots)
        while todo:
            s = todo.pop()
            if id(s) in seen:
                continue
            seen.add(id(s))
            at = self.value_at.get(id(s))
            if at is not None and at[0] < k:  # a state's new value, written by an earlier phase: read the state
                continue
            if s is self.gathered and self.level[id(s)] < k:
                continue
            if id(s) not in bodyset:  # a leaf: reduced, scalar, input, slice of an input
                src = self.src_of.get(id(s), s)
                if self.written_at.get(id(src), k) < k:
                    return None  # that state was overwritten by an earlier phase
                continue
            stages.append(s)
            todo.extend(a for a in s.args if a.op != "const")
        return stages

    def _outside_safe(self, program: Program) -> bool:
        """States are written in place: nobody outside the step may read their old value, and no other value of
        the step may be needed outside it."""
        users = program.users()
        writes = [s for ph in self.writes for s in ph] + ([self.w_update] if self.w_update else [])
        for s in writes:
            if any(id(u) not in self.inside for u in users[s.args[0].name] if u is not s):
                return False
        # a whole norm may be an output too (clipping's grad_norm): finish_norms leaves its value in env
        allowed = {id(self.ag), *map(id, writes), *(id(nm) for nm in self.norms if nm.op == "norm")}
        return all(i in allowed for i in outside_readers(program, self.inside))


def _pieces(ends: list[int], offset: int, n: int):
    """(segment index, start, stop) of the segments' pieces within [offset, offset + n); `ends` are cumulative."""
    i = bisect.bisect_right(ends, offset)
    lo = offset
    while lo < offset + n:
        hi = min(ends[i], offset + n)
        yield i, lo, hi
        lo, i = hi, i + 1


def phased_collective_runner(step: FusedCollective, program: Program, comm: StageComm,
                             options: StepOptions) -> Runner | None:
    """The phased runner of a FusedCollective with norms, or None when a precondition fails (reference path)."""
    kernels, donate = options.kernels, options.donate
    shm = getattr(comm, "shm", None)
    ph = _Phases(step, program, shm)
    if not ph.ok:
        return None
    rs, ag, w_update, gathered = ph.rs, ph.ag, ph.w_update, ph.gathered

    def phase_kernel(k: int, **kw):
        kp, first = ph.kernels[k], 1 if gathered in ph.kernels[k].roots else 0
        reads_out = {id(s.args[0]): first + j for j, s in enumerate(ph.writes[k])}
        if first and w_update is not None:
            reads_out.update({sc: 0 for sc, src in ph.src_of.items() if src is w_update.args[0]})
        roots = [*kp.roots, rs] if "reduce_of" in kw else kp.roots
        return build_kernel(kp.stages, roots, kernels, into=True, reads_out=reads_out,
                            sumsq=[x for _, x in kp.whole], squares=[x for _, x in kp.segmented], **kw)

    kerns = [phase_kernel(k, name=f"fused_{rs.name}_{k}") if kp.stages or kp.whole or kp.segmented else None
             for k, kp in enumerate(ph.kernels)]
    op = rs.attr("op")
    # within a node, phase 0's kernel also does the reduction: it reads every rank's gradient chunk in place, sums
    # them in its loop and writes the sum (which later phases read back) over this rank's own chunk
    reduce_of = kernel_reduce_of(shm, rs, options.fuse_reduction)
    kern0_src = None
    if reduce_of is not None and kerns[0] is not None and any(a is rs for a in kerns[0].inputs):
        kern0_src = phase_kernel(0, name=f"fused_{rs.name}_0_src", reduce_of=reduce_of,
                                 reduced_out=(shm.local_rank, len(ph.kernels[0].roots)))
    compiling = [True] if any(k is not None and k.backend == "inductor" for k in kerns) else []
    kinds = {id(a): ph.kind(a) for k in kerns if k is not None for a in [*k.inputs, *k.sumsq, *k.squares]}
    ends = {id(nm): list(itertools.accumulate(nm.attr("sizes"))) for nm in ph.norms if nm.op == "segment_norm"}
    scratch: dict = {}

    def run(env: dict) -> None:
        def scalars_at(k: int) -> None:
            for s in ph.scalars:
                if ph.level[id(s)] == k:
                    run_stage(s, env, comm)

        scalars_at(0)
        put_consts([a for k in kerns if k is not None for a in k.inputs], env)
        buf = reduce_buffer(rs, env, shm, donate, scratch).view(-1)
        writes = [s for w in ph.writes for s in w]
        state = {id(s): env[id(s.args[0])].view(-1) for s in writes if env[id(s.args[0])].is_contiguous()}
        out = env[id(w_update.args[0])] if w_update is not None else torch.empty(ag.shape, dtype=ag.dtype)
        if len(state) < len(writes) or not out.is_contiguous() or shm.nnodes > 1 and node_shared(shm, out):
            return run_stages(step.stages, env, comm)
        flat_out = out.view(-1)
        start, stop = owned_slice(shm, buf.numel())
        step_elems = max(1, max(shm.chunk_bytes, KERNEL_BYTES) // buf.element_size())
        values = {id(s.args[1]): state[id(s)] for s in writes}  # new values of states, read from the states
        values[id(gathered)] = flat_out[start:stop]

        def chunk_buffer(key, dtype: torch.dtype, n: int) -> torch.Tensor:
            if key not in scratch:
                scratch[key] = torch.empty(step_elems, dtype=dtype)
            return scratch[key][:n]

        def view(a: Node, offset: int, n: int) -> torch.Tensor:
            k, lo = kinds[id(a)], offset - start
            if k == "reduced":
                return buf[offset:offset + n]
            if k == "segnorm":  # each element gets its segment's norm (pieces filled in a cached buffer)
                b = chunk_buffer(("seg", id(a)), a.dtype, n)
                for i, p0, p1 in _pieces(ends[id(a)], offset, n):
                    b[p0 - offset:p1 - offset].fill_(env[id(a)][i])
                return b
            if k == "stage":
                return values[id(a)][lo:lo + n]
            if k == "global":
                return env[id(ph.src_of.get(id(a), a))].reshape(-1)[offset:offset + n]
            if k == "local":
                return env[id(a)].view(-1)[lo:lo + n]
            return env[id(a)]

        def phase(k: int):
            kern, kp, writes_k = kerns[k], ph.kernels[k], ph.writes[k]
            has_out = gathered in kp.roots
            sqs = [torch.zeros((), dtype=torch.float32) for _ in kp.whole]  # separate: never aliased
            acc = [torch.zeros(len(sqs), dtype=torch.float64),
                   *(torch.zeros(len(nm.attr("sizes")), dtype=torch.float64) for nm, _ in kp.segmented)]

            def chunk(offset: int, n: int, parts: list[torch.Tensor] | None = None) -> None:
                if kern is None:
                    return
                lo = offset - start
                sqvs = [chunk_buffer(("sq", j), torch.float32, n) for j in range(len(kp.segmented))]
                outs = [*([flat_out[offset:offset + n]] * has_out), *(state[id(s)][lo:lo + n] for s in writes_k)]
                if parts is None or len(parts) == 1:  # the reduced chunk is in buf
                    kern(*(view(a, offset, n) for a in kern.inputs), *outs, *sqs, *sqvs)
                else:  # every rank's chunk: the kernel sums them and writes the sum to buf
                    assert kern0_src is not None
                    peers = parts[:shm.local_rank] + parts[shm.local_rank + 1:]  # its own chunk is read from buf, where the sum goes
                    args = [x for a in kern0_src.inputs for x in (peers if a is rs else [view(a, offset, n)])]
                    kern0_src(*args, *outs, buf[offset:offset + n], *sqs, *sqvs)
                for j, sq in enumerate(sqs):
                    acc[0][j] += sq
                for j, (nm, _) in enumerate(kp.segmented):
                    for i, p0, p1 in _pieces(ends[id(nm)], offset, n):
                        acc[1 + j][i] += sqvs[j][p0 - offset:p1 - offset].sum()
            return chunk, acc

        def finish_norms(acc: list[torch.Tensor], kp: _Kernel, k: int) -> None:
            if kp.whole or kp.segmented:  # one all-reduce of every partial sum of this level
                sums = shm.all_reduce(torch.cat(acc).float(), "sum").sqrt()
                for j, (nm, _) in enumerate(kp.whole):
                    env[id(nm)] = sums[j].to(nm.dtype)
                at = len(kp.whole)
                for nm, _ in kp.segmented:
                    env[id(nm)] = sums[at:at + len(nm.attr("sizes"))].to(nm.dtype)
                    at += len(nm.attr("sizes"))
            scalars_at(k)

        with first_call_timeout(shm, compiling):
            chunk, acc = phase(0)
            if kern0_src is not None:
                reduce_and_apply(shm, buf, lambda offset, parts, _out: chunk(offset, parts[0].numel(), parts),
                                 op=op, gather=False, fn_bytes=KERNEL_BYTES, fn_sources=True)
            else:
                reduce_and_apply(shm, buf, lambda offset, red, _out: chunk(offset, red.numel()), op=op, gather=False,
                                 fn_bytes=KERNEL_BYTES)
            finish_norms(acc, ph.kernels[0], 1)
            for k in range(1, ph.K + 1):
                chunk, acc = phase(k)
                for a in range(start, stop, step_elems):
                    chunk(a, min(step_elems, stop - a))
                finish_norms(acc, ph.kernels[k], k + 1)
            gather_slices(shm, flat_out)
        store_results(env, ag, w_update, out, writes)
    return run
