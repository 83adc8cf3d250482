"""The fast form of a Kernel step: its fusable stages as one generated function (runtime.steps.codegen), compiled
once; a step that starts with a matmul runs as the GEMM with its epilogue (runtime.steps.matmul)."""

from __future__ import annotations

from cocosync.dsl.ir import Program
from cocosync.lower.plan import Kernel
from cocosync.runtime.stage import StageComm
from cocosync.runtime.steps.codegen import build_kernel, can_fuse
from cocosync.runtime.steps.common import Runner, StepOptions, outside_readers, put_consts
from cocosync.runtime.steps.matmul import matmul_runner

__all__ = ["kernel_runner"]


def kernel_runner(step: Kernel, program: Program, comm: StageComm, options: StepOptions) -> Runner | None:
    """A runner for the step, or None (reference path)."""
    stages = list(step.stages)
    if stages[0].op == "matmul":  # a GEMM and its epilogue (lower.merge_kernels puts them in one step)
        return matmul_runner(step, program, comm, options, outside_readers(program, {id(s) for s in stages}))
    if len(stages) < 2 or not all(can_fuse(s) for s in stages):
        return None
    inside = {id(s) for s in stages}
    outs = [s for s in stages if id(s) in outside_readers(program, inside)]
    if any(s.op == "update" or s.shape != stages[-1].shape for s in stages):
        return None  # broadcasting / state writes: keep the reference semantics
    k = build_kernel(stages, outs, options.kernels, name=f"k_{stages[0].name}")

    def run(env: dict) -> None:
        put_consts(k.inputs, env)
        for node, val in zip(outs, k(*(env[id(a)] for a in k.inputs))):
            env[id(node)] = val
    return run
