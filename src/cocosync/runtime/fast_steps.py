"""Fast implementations of plan steps: fused kernels and fused shared-memory collectives.

`prepare(step, program, comm, kernels)` returns a runner `run(env)` for a step when a fast form applies, or
None (the step then runs its reference implementation, stage by stage). Every fast form is checked against
the interpreter in the tests; when a precondition does not hold we fall back rather than guess.

- Kernel: its fusable stages become one generated function (runtime.kernels), compiled once; a matmul and its
  epilogue fold the bias and relu into the GEMM call (runtime.matmul_step).
- FusedCollective (RS -> elementwise compute -> AG over dim 0 on one node, shared memory): CoCoNeT's
  FusedAllReduce. Each rank reduces its slice chunk by chunk; while the chunk is in cache the fused kernel
  computes the sliced stages on it (slices of Replicated inputs are read in place, Sliced states are updated
  in place), and the all-gathered value is written straight into the Replicated state it updates (e.g. w).
  Across nodes: the hierarchical reduce-scatter, the kernel on this rank's 1/P, the hierarchical all-gather
  (`fused.reduce_and_apply`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable

import torch

from cocosync.dsl.ir import Node, Program
from cocosync.runtime.fused import node_shared, owned_slice, reduce_and_apply
from cocosync.runtime.kernels import build_kernel, can_fuse
from cocosync.runtime.overlap_step import overlap_runner

Runner = Callable[[dict], None]
FIRST_CALL_TIMEOUT = 900.0  # seconds: a cold Inductor compile on a busy 2-core machine can take minutes
# fused collectives within a node: the compute kernel also sums the ranks' chunks (False: the collective reduces
# first, the kernel reads the reduced chunk; kept for A/B measurements). Read when a plan is compiled.
FUSE_REDUCTION = True
# bytes (of gradient) per call of a fused collective's kernel: each call of a compiled kernel costs ~30 us of
# guards and wrappers, ~half the work of a 256 KB chunk, so the kernel runs on several reduced chunks at once
KERNEL_BYTES = int(os.environ.get("COCOSYNC_KERNEL_BYTES", 2 << 20))  # 2 MB: best of 0.25-8 MB (bench dp)


def outside_readers(program: Program, inside: set[int]) -> set[int]:
    """ids of the step's stages whose values are read outside the step or are program outputs."""
    needed = {id(o) for o in program.outputs}
    for s in program.stages:
        if id(s) not in inside:
            needed.update(id(a) for a in s.args)
    return needed & inside


def prepare(step, program: Program, comm, kernels: str | None,
            donate: frozenset[str] = frozenset()) -> Runner | None:
    """donate: names of inputs whose contents the program may consume (e.g. gradients living in the arena: the
    fused collective then reduces them in place instead of copying them into shared memory first)."""
    from cocosync.lower.plan import FusedCollective, Kernel as KernelStep, Overlap  # (lower imports this module)

    if comm.pruning.touches(step.stages) and not isinstance(step, Overlap):
        return None  # stage by stage, skipping what this rank prunes (runtime.prune)
    if isinstance(step, KernelStep):
        return _kernel_runner(step, program, comm, kernels)
    if isinstance(step, FusedCollective):
        if any(s.op in ("norm", "segment_norm") for s in step.compute):
            from cocosync.runtime.norm_step import norm_collective_runner

            return norm_collective_runner(step, program, comm, kernels, donate)
        return _fused_collective_runner(step, program, comm, kernels, donate)
    if isinstance(step, Overlap):
        return overlap_runner(step, program, comm, kernels)
    return None


def _kernel_runner(step, program: Program, comm, kernels: str | None) -> Runner | None:
    stages = list(step.stages)
    if stages[0].op == "matmul":  # a GEMM and its epilogue (lower.merge_kernels puts them in one step)
        from cocosync.runtime.matmul_step import matmul_runner

        return matmul_runner(step, program, comm, kernels, outside_readers(program, {id(s) for s in stages}))
    if len(stages) < 2 or not all(can_fuse(s) for s in stages):
        return None
    inside = {id(s) for s in stages}
    outs = [s for s in stages if id(s) in outside_readers(program, inside)]
    if any(s.op == "update" or s.shape != stages[-1].shape for s in stages):
        return None  # broadcasting / state writes: keep the reference semantics
    k = build_kernel(stages, outs, kernels, name=f"k_{stages[0].name}")

    def run(env: dict) -> None:
        put_consts(k.inputs, env)
        for node, val in zip(outs, k(*(env[id(a)] for a in k.inputs))):
            env[id(node)] = val
    return run


def put_consts(nodes, env: dict) -> None:
    for a in nodes:
        if a.op == "const":
            env.setdefault(id(a), torch.tensor(a.attr("value"), dtype=a.dtype))


def _fused_collective_runner(step, program: Program, comm, kernels: str | None,
                             donate: frozenset[str] = frozenset()) -> Runner | None:
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
    op = rs.attr("op").value
    # within a node the kernel also does the reduction: it reads every rank's gradients where they are, in its one
    # pass (the reduced values are never written out and read back)
    reduce_of = kernel_reduce_of(shm, rs)
    kern_src = None if reduce_of is None else build_kernel(body, outs, kernels, name=f"fused_{rs.name}_src",
                                                           into=True, reads_out=reads_out, reduce_of=reduce_of)
    scratch: dict[str, torch.Tensor] = {}
    compiling = [True] if kern.backend == "inductor" else []

    def run(env: dict) -> None:
        from cocosync.runtime.executor import run_stage

        for s in scalars:
            run_stage(s, env, comm)
        put_consts(kern.inputs, env)
        buf = reduce_buffer(rs, env, shm, donate, scratch)
        if not all(env[id(s.args[0])].is_contiguous() for s in state_writes):
            return _fallback(step, env, comm)
        if w_update is not None:
            out = env[id(w_update.args[0])]
            if not out.is_contiguous():
                return _fallback(step, env, comm)
        else:
            out = torch.empty(ag.shape, dtype=ag.dtype)
        flat_out = out.view(-1)
        if shm.nnodes > 1 and node_shared(shm, flat_out):
            return _fallback(step, env, comm)
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


def kernel_reduce_of(shm, rs: Node) -> tuple[Node, int, float | None] | None:
    """`Kernel(reduce_of=...)` for a fused collective's kernel that sums the local ranks' chunks of reduce-scatter
    `rs` itself (FUSE_REDUCTION, within one node, sum or mean), else None (the collective reduces first)."""
    op = rs.attr("op").value
    if not FUSE_REDUCTION or shm.nnodes > 1 or shm.L < 2 or op not in ("sum", "mean"):
        return None
    return rs, shm.L, 1.0 / shm.world if op == "mean" else None


def _fallback(step, env: dict, comm) -> None:
    step.run(env, comm)


def across_nodes_ok(shm, rs: Node) -> bool:
    """One node, or several with the reduce-scatter's length divisible by the world (each rank owns 1/P)."""
    return shm.nnodes == 1 or torch.Size(rs.args[0].shape).numel() % shm.world == 0


def reduce_buffer(rs: Node, env: dict, shm, donate: frozenset[str], scratch: dict) -> torch.Tensor:
    """The arena tensor the fused collective reduces in place: the donated gradient itself when it already lives
    in shared memory (zero-copy), else a copy in an arena buffer allocated once (collectively) per runner."""
    g = env[id(rs.args[0])]
    if rs.args[0].op == "input" and rs.args[0].name in donate and shm.arena.locate(g) is not None:
        return g
    if "g" not in scratch:
        scratch["g"] = shm.arena.empty(g.shape, g.dtype)
    scratch["g"].copy_(g)
    return scratch["g"]


@contextmanager
def first_call_timeout(shm, compiling: list):
    """While `compiling` (the first call, which compiles Inductor kernels inside the collective), peers wait up to
    FIRST_CALL_TIMEOUT; afterwards the communicator's own timeout again."""
    timeout = shm.flags.timeout
    if compiling:
        shm.flags.timeout = max(timeout, FIRST_CALL_TIMEOUT)
    try:
        yield
    finally:
        shm.flags.timeout = timeout
        compiling.clear()


def store_results(env: dict, ag: Node, w_update: Node | None, out: torch.Tensor, writes) -> None:
    """After a fused collective: the gathered value (also the Replicated state's new value) and the states written
    in place."""
    env[id(ag)] = out
    if w_update is not None:
        env[id(w_update)] = out
    for s in writes:
        env[id(s)] = env[id(s.args[0])]
