"""prepare(step, program, comm, options): the fast form of a plan step, or None (it then runs stage by stage).

Every fast form is checked against the interpreter in the tests; when a precondition does not hold we fall back
rather than guess. One module per step kind: kernel (with matmul), fused_collective (analysed by fused_analysis),
overlap.
"""

from __future__ import annotations

from cocosync.dsl.ir import Program
from cocosync.lower.plan import FusedCollective, Kernel, Overlap, Step
from cocosync.runtime.reference.stage import StageComm
from cocosync.runtime.steps.common import Runner, StepOptions
from cocosync.runtime.steps.fused_analysis import NotFused, analyze, runtime_reason
from cocosync.runtime.steps.fused_collective import fused_collective_runner
from cocosync.runtime.steps.kernel import kernel_reason, kernel_runner
from cocosync.runtime.steps.overlap import overlap_reason, overlap_runner

__all__ = ["prepare", "static_reason"]


def prepare(step: Step, program: Program, comm: StageComm, options: StepOptions,
            earlier: frozenset[int] = frozenset()) -> Runner | None:
    """A runner `run(env)` for the step's fast form, or None. `earlier`: ids of the stages of the plan's steps
    before this one (a kernel may write a state in place that only they read)."""
    if comm.pruning.touches(step.stages) and not isinstance(step, Overlap):
        return None  # stage by stage, skipping what this rank prunes (runtime.reference.prune)
    if isinstance(step, Kernel):
        return kernel_runner(step, program, comm, options, earlier)
    if isinstance(step, FusedCollective):
        group = analyze(step, program)
        if isinstance(group, NotFused) or runtime_reason(group, comm.shm) is not None:
            return None
        return fused_collective_runner(group, step, program, comm, options)
    if isinstance(step, Overlap):
        return overlap_runner(step, program, comm)
    return None


def static_reason(step: Step, program: Program) -> str | None:
    """Why the step has no fast form, judged from the program alone (None: it has one wherever the ranks allow,
    e.g. a fused collective needs the shared-memory backend). For `cocosync show --dump`."""
    if isinstance(step, Kernel):
        return kernel_reason(step, program)
    if isinstance(step, FusedCollective):
        group = analyze(step, program)
        return group.reason if isinstance(group, NotFused) else None
    if isinstance(step, Overlap):
        return overlap_reason(step)
    return "a single collective: it runs as itself"
