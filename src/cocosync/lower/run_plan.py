"""compile_plan(plan): run a Plan on the current rank of a torch.distributed group, step by step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cocosync.lower.plan import Plan
from cocosync.runtime.executor import CompiledProgram


class CompiledPlan(CompiledProgram):
    """Callable like `cocosync.compile(program)`: `out = fn(**inputs)` with this rank's parts of the inputs."""

    def __init__(self, plan: Plan, group: dist.ProcessGroup | None = None):
        super().__init__(plan.program, group)
        self.plan = plan

    def _run(self, env: dict[int, torch.Tensor]) -> None:
        for step in self.plan.steps:
            step.run(env, self.comm)


def compile_plan(plan: Plan, group: dist.ProcessGroup | None = None) -> CompiledPlan:
    return CompiledPlan(plan, group)


def compile_scheduled(program_or_schedule: Any, group: dist.ProcessGroup | None = None) -> CompiledPlan:
    """Lower a Program (or a Schedule's program) and compile the plan."""
    from cocosync.lower.lower import lower

    program = getattr(program_or_schedule, "program", program_or_schedule)
    return compile_plan(lower(program), group)
