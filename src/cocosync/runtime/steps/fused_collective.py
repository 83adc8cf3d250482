"""The fast form of a FusedCollective step without norms: CoCoNeT's FusedAllReduce.

RS -> elementwise compute -> AG over dim 0, through shared memory. Each rank reduces its slice chunk by chunk;
while the chunk is in cache the fused kernel computes the sliced stages on it (slices of Replicated inputs are read
in place, Sliced states are updated in place), and the all-gathered value is written straight into the Replicated
state it updates (e.g. w). Within a node the kernel also sums the ranks' chunks itself. Across nodes: the
hierarchical reduce-scatter, the kernel on this rank's 1/P, the hierarchical all-gather (`comm.fused.reduce_and_apply`).
Steps with norms run in phases (runtime.steps.phased).
"""

from __future__ import annotations

import torch

from cocosync.dsl.ir import Program
from cocosync.lower.plan import FusedCollective
from cocosync.runtime.comm.fused import node_shared, owned_slice, reduce_and_apply
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

__all__ = ["fused_collective_runner"]


def fused_collective_runner(step: FusedCollective, program: Program, comm: StageComm,
                            options: StepOptions) -> Runner | None:
    """A runner for a fused collective without norms, or None (reference path)."""
    kernels, donate = options.kernels, options.donate
    shm = getattr(comm, "shm", None)
    rs, ag = step.rs, step.ag
    if shm is None or rs.layout.dim != 0 or ag.args[0].layout.dim != 0 or not across_nodes_ok(shm, rs):
        return None
    shape = rs.shape
    inside = {id(s) for s in step.order}
    # the update of a Replicated state by the gathered value is done by the all-gather writing into the state
    w_update = next((o for o in program.stages if o.op == "update" and o.args[1] is ag), None)
    scalars = [s for s in step.compute if s.ndim == 0]
    scatters = [s for s in step.compute if s.op == "scatter"]
    body = [s for s in step.compute if s.ndim > 0 and s.op != "scatter" and s is not w_update]
    if not all(can_fuse(s) and s.shape == shape for s in body):
        return None
    if not all(s.layout.dim == 0 and s.args[0].shape == shape for s in scatters):
        return None
    if any(not can_fuse(s) for s in scalars):
        return None
    # operands from outside the step must be 0-dim, or Sliced(0) with the RS's shape (a local slice)
    for s in body:
        for a in s.args:
            if id(a) not in inside and a.op != "const" and a.ndim and not (a.layout == rs.layout and a.shape == shape):
                return None
    needed = outside_readers(program, inside)
    gathered = ag.args[0]
    state_writes = [s for s in body if s.op == "update"]
    users = program.users()
    for s in [*state_writes, *([w_update] if w_update else [])]:
        if any(id(u) not in inside for u in users[s.args[0].name] if u is not s):
            return None  # someone outside reads the old state: writing in place would change what it sees
    if any(i not in {id(ag), id(w_update) if w_update else 0, *map(id, state_writes)} for i in needed):
        return None  # another value is needed outside: keep the reference implementation
    if id(gathered) not in {id(b) for b in body}:
        return None
    outs = [gathered, *state_writes]
    src_of = {id(s): s.args[0] for s in scatters}
    # inputs that are the memory an output is written to: the state read and updated in place (m, v), and the
    # slice of w when the all-gathered result goes straight into w; the kernel reads them from its outputs
    reads_out = {id(s.args[0]): 1 + j for j, s in enumerate(state_writes)}
    if w_update is not None:
        reads_out.update({id(sc): 0 for sc in scatters if src_of[id(sc)] is w_update.args[0]})
    kern = build_kernel(body, outs, kernels, name=f"fused_{rs.name}", into=True, reads_out=reads_out)
    op = rs.attr("op")
    # within a node the kernel also does the reduction: it reads every rank's gradients where they are, in its one
    # pass (the reduced values are never written out and read back)
    reduce_of = kernel_reduce_of(shm, rs, options.fuse_reduction)
    kern_src = None if reduce_of is None else build_kernel(body, outs, kernels, name=f"fused_{rs.name}_src",
                                                           into=True, reads_out=reads_out, reduce_of=reduce_of)
    scratch: dict[str, torch.Tensor] = {}
    compiling = [True] if kern.backend == "inductor" else []

    def run(env: dict) -> None:
        for s in scalars:
            run_stage(s, env, comm)
        put_consts(kern.inputs, env)
        buf = reduce_buffer(rs, env, shm, donate, scratch)
        if not all(env[id(s.args[0])].is_contiguous() for s in state_writes):
            return run_stages(step.stages, env, comm)
        if w_update is not None:
            out = env[id(w_update.args[0])]
            if not out.is_contiguous():
                return run_stages(step.stages, env, comm)
        else:
            out = torch.empty(ag.shape, dtype=ag.dtype)
        flat_out = out.view(-1)
        if shm.nnodes > 1 and node_shared(shm, flat_out):
            return run_stages(step.stages, env, comm)
        start = owned_slice(shm, buf.numel())[0]
        feeds = []
        for a in kern.inputs:
            if a is rs:
                feeds.append(None)  # the reduced chunk
            elif id(a) in src_of:  # slice of a Replicated input, read in place
                feeds.append(("global", env[id(src_of[id(a)])].reshape(-1)))
            elif a.ndim:
                feeds.append(("local", env[id(a)].view(-1)))
            else:
                feeds.append(("scalar", env[id(a)]))
        state_views = [env[id(s.args[0])].view(-1) for s in state_writes]

        def chunk_fn(offset: int, parts: list[torch.Tensor] | torch.Tensor, out_chunk: torch.Tensor) -> None:
            parts = parts if isinstance(parts, list) else [parts]  # every rank's chunk, or the reduced one
            n, lo = parts[0].numel(), offset - start
            args = []
            for f in feeds:
                if f is None:
                    args += parts
                else:
                    args.append(f[1] if f[0] == "scalar" else
                                f[1][offset:offset + n] if f[0] == "global" else f[1][lo:lo + n])
            k = kern if len(parts) == 1 else kern_src
            assert k is not None
            k(*args, out_chunk, *(view[lo:lo + n] for view in state_views))

        with first_call_timeout(shm, compiling):
            reduce_and_apply(shm, buf.view(-1), chunk_fn, out=flat_out, op=op, fn_bytes=KERNEL_BYTES,
                             fn_sources=kern_src is not None)
        store_results(env, ag, w_update, out, state_writes)
    return run
