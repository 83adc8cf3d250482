"""The fast form of a Kernel step: its fusable stages as one generated function (runtime.steps.codegen), compiled
once; a step that starts with a matmul runs as the GEMM with its epilogue (runtime.steps.matmul)."""

from __future__ import annotations

from cocosync.dsl.ir import Program
from cocosync.lower.plan import Kernel
from cocosync.runtime.reference.stage import StageComm
from cocosync.runtime.steps.codegen import build_kernel, can_fuse
from cocosync.runtime.steps.common import Runner, StepOptions, eager_work, local_ranks_of, outside_readers, put_consts
from cocosync.runtime.steps.matmul import matmul_runner

__all__ = ["kernel_runner", "kernel_reason"]


def kernel_reason(step: Kernel, program: Program) -> str | None:
    """Why the step runs stage by stage (None: it has a fast form)."""
    stages = list(step.stages)
    if stages[0].op == "matmul":  # a GEMM and its epilogue (lower.merge_kernels puts them in one step)
        if len(stages) < 2 or any(a.ndim != 2 for a in stages[0].args):
            return f"{stages[0].name}: a matmul without an epilogue, or not 2-D: one torch call already"
        return None
    # one stage is one torch op already
    if len(stages) < 2:
        return f"{stages[0].name}: a single stage runs as one torch op"
    # generated kernels hold the elementwise ops whose value depends only on their operands
    bad = next((s for s in stages if not can_fuse(s)), None)
    if bad is not None:
        return f"{bad.name} ({bad.op}) is not an op generated kernels compute"
    # broadcasting and state writes keep the reference semantics
    odd = next((s for s in stages if s.op == "update" or s.shape != stages[-1].shape), None)
    if odd is not None:
        return f"{odd.name} writes a state or has another shape than the kernel's {list(stages[-1].shape)}"
    return None


def kernel_runner(step: Kernel, program: Program, comm: StageComm, options: StepOptions) -> Runner | None:
    """A runner for the step, or None (reference path)."""
    stages = list(step.stages)
    if kernel_reason(step, program) is not None:
        return None
    if stages[0].op == "matmul":
        return matmul_runner(step, program, comm, options, outside_readers(program, {id(s) for s in stages}))
    inside = {id(s) for s in stages}
    outs = [s for s in stages if id(s) in outside_readers(program, inside)]
    k = build_kernel(stages, outs, options.kernels, name=f"k_{stages[0].name}",
                     eager_work=eager_work(options, local_ranks_of(comm)))

    def run(env: dict) -> None:
        put_consts(k.inputs, env)
        for node, val in zip(outs, k(*(env[id(a)] for a in k.inputs))):
            env[id(node)] = val
    return run
