"""compile_plan(plan): run a Plan on the current rank of a torch.distributed group, step by step."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist

from cocosync.lower.plan import Plan
from cocosync.runtime.executor import CompiledProgram
from cocosync.runtime.profile import StepProfile, timed_steps
from cocosync.runtime.steps.fused_collective import prepare


class CompiledPlan(CompiledProgram):
    """Callable like `cocosync.compile(program)`: `out = fn(**inputs)` with this rank's parts of the inputs.

    Steps with a fast form (fused kernels, fused shared-memory collectives: runtime.steps) use it; the
    others run their stages one by one. kernels: 'inductor' or 'eager' (default $COCOSYNC_KERNELS, else inductor).
    `fast=False` runs every step by its reference implementation. donate: names of inputs the program may
    consume (their contents are undefined afterwards), e.g. arena gradients reduced in place."""

    def __init__(self, plan: Plan, group: dist.ProcessGroup | None = None, *, backend: str | None = None,
                 kernels: str | None = None, fast: bool = True, donate: tuple[str, ...] = ()):
        super().__init__(plan.program, group, backend)
        self.plan = plan
        unknown = set(donate) - {n.name for n in plan.program.inputs}
        if unknown:
            raise ValueError(f"donate={sorted(unknown)}: not inputs of {plan.program.name!r}")
        self.runners = [prepare(step, plan.program, self.comm, kernels, frozenset(donate)) if fast else None
                        for step in plan.steps]
        self._profile: StepProfile | None = None

    @property
    def fast_steps(self) -> list[str]:
        """The steps that run in a fast form (for reports and tests)."""
        return [str(s) for s, r in zip(self.plan.steps, self.runners) if r is not None]

    @contextmanager
    def profile(self, sync: bool = False) -> Iterator[StepProfile]:
        """Time every step of the calls made inside the block (see lower.profile); sync=True: the node's ranks meet
        before each step, so a step's time excludes waiting for a slower peer (every rank must profile then; it needs
        the shared-memory backend and is ignored with torch collectives)."""
        if self._profile is not None:
            raise RuntimeError(f"{self.program.name}: profile() is already active")
        self._profile = StepProfile([str(s) for s in self.plan.steps], [r is not None for r in self.runners], sync)
        try:
            yield self._profile
        finally:
            self._profile = None

    def _run(self, env: dict[int, torch.Tensor]) -> None:
        if self._profile is not None:
            return timed_steps(self, env, self._profile)
        for step, runner in zip(self.plan.steps, self.runners):
            if runner is not None:
                runner(env)
            else:
                step.run(env, self.comm)


def compile_plan(plan: Plan, group: dist.ProcessGroup | None = None, **options: Any) -> CompiledPlan:
    """Compile a plan for this rank; options: backend, kernels, fast (see CompiledPlan)."""
    return CompiledPlan(plan, group, **options)


def compile_scheduled(program_or_schedule: Any, group: dist.ProcessGroup | None = None,
                      **options: Any) -> CompiledPlan:
    """Lower a Program (or a Schedule's program) and compile the plan (options as for compile_plan)."""
    from cocosync.lower.lower import lower

    program = getattr(program_or_schedule, "program", program_or_schedule)
    return compile_plan(lower(program), group, **options)
