"""prepare(step, program, comm, options): the fast form of a plan step, or None (it then runs stage by stage).

Every fast form is checked against the interpreter in the tests; when a precondition does not hold we fall back
rather than guess. One module per step kind: kernel (with matmul), fused_collective, phased (a fused collective
with norms), overlap.
"""

from __future__ import annotations

from cocosync.dsl.ir import Program
from cocosync.dsl.registry import OPS
from cocosync.lower.plan import FusedCollective, Kernel, Overlap, Step
from cocosync.runtime.stage import StageComm
from cocosync.runtime.steps.common import Runner, StepOptions
from cocosync.runtime.steps.fused_collective import fused_collective_runner
from cocosync.runtime.steps.kernel import kernel_runner
from cocosync.runtime.steps.overlap import overlap_runner
from cocosync.runtime.steps.phased import phased_collective_runner

__all__ = ["prepare"]


def prepare(step: Step, program: Program, comm: StageComm, options: StepOptions) -> Runner | None:
    """A runner `run(env)` for the step's fast form, or None."""
    if comm.pruning.touches(step.stages) and not isinstance(step, Overlap):
        return None  # stage by stage, skipping what this rank prunes (runtime.prune)
    if isinstance(step, Kernel):
        return kernel_runner(step, program, comm, options)
    if isinstance(step, FusedCollective):
        if any(OPS[s.op].norm for s in step.compute):
            return phased_collective_runner(step, program, comm, options)
        return fused_collective_runner(step, program, comm, options)
    if isinstance(step, Overlap):
        return overlap_runner(step, program, comm)
    return None
