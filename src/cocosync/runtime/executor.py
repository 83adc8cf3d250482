"""Running programs and plans on the current rank of a real torch.distributed process group.

`compile(program)` runs a Program stage by stage (runtime.reference.stage: torch ops on this rank's part of the values;
collectives through shared memory within a node, torch.distributed otherwise). `compile_plan(plan)` runs a lowered
Plan, each step in its fast form where one applies (runtime.steps: fused kernels, fused shared-memory collectives,
chunked overlap) and stage by stage otherwise. Tests compare both with the interpreter.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from cocosync.dsl.ir import Program
from cocosync.dsl.types import DslError
from cocosync.lower.lower import lower
from cocosync.lower.plan import Plan
from cocosync.runtime.profile import StepProfile, timed_steps
from cocosync.runtime.reference.stage import StageComm, local_shape, run_stages
from cocosync.runtime.steps.common import StepOptions
from cocosync.runtime.steps.prepare import prepare

__all__ = ["compile", "CompiledProgram", "CompiledPlan", "compile_plan", "compile_scheduled"]


class CompiledProgram:
    """Callable: `out = fn(**inputs)` with this rank's parts of the inputs; returns {output name: local tensor}.

    States written by `update` are modified in place (and returned under the state's name).
    """

    def __init__(self, program: Program, group: dist.ProcessGroup | None = None, backend: str | None = None):
        self.program = program
        self.comm = StageComm(program, group, backend)
        self._shapes = {n.name: local_shape(n, self.comm.group_size) for n in program.inputs}
        self._scalars: dict[str, tuple[float, torch.Tensor]] = {}

    def _check_inputs(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        p = self.program
        names = {n.name for n in p.inputs}
        unused = self.comm.pruning.unused_inputs
        if missing := sorted(names - set(inputs) - unused):
            raise DslError(f"{p.name}: missing inputs {missing}")
        if extra := sorted(set(inputs) - names):
            raise DslError(f"{p.name}: unknown inputs {extra}; the program takes {sorted(names)}")
        out = {}
        device = None
        for n in p.inputs:
            if n.name not in inputs:
                continue  # not read on this rank (see unused_inputs)
            v = inputs[n.name]
            if isinstance(v, (int, float)) and n.attr("kind") == "scalar":
                held = self._scalars.get(n.name)  # the same value as last call: its tensor (programs never write
                if held is None or held[0] != v:  # scalar inputs); a round at small sizes pays ~3 us per new one
                    held = self._scalars[n.name] = (v, torch.tensor(float(v), dtype=n.dtype))
                v = held[1]
            if not isinstance(v, torch.Tensor):
                raise DslError(f"{p.name}: input {n.name!r} must be a tensor, got {type(v).__name__}")
            want = self._shapes[n.name]
            if tuple(v.shape) != want or v.dtype != n.dtype:
                rank = dist.get_rank() if dist.is_initialized() else 0
                raise DslError(f"{p.name}: input {n.name!r} ({n.layout}) on rank {rank} must have local "
                               f"shape {want} and dtype {n.dtype}; got shape {tuple(v.shape)} dtype {v.dtype}")
            if n.ndim and device is not None and v.device != device:
                raise DslError(f"{p.name}: input {n.name!r} is on {v.device}, other inputs are on {device}")
            device = device or (v.device if n.ndim else None)
            out[n.name] = v
        self.comm.device = device or torch.device("cpu")  # where values a pruned rank makes up (zeros) live
        return out

    @property
    def unused_inputs(self) -> frozenset[str]:
        """Inputs this rank's program does not read (e.g. what the last pipeline stage would send): may be omitted."""
        return self.comm.pruning.unused_inputs

    def __call__(self, **inputs: Any) -> dict[str, torch.Tensor]:
        env: dict[int, torch.Tensor] = {}
        given = self._check_inputs(inputs)
        for n in self.program.inputs:
            if n.name in given:
                env[id(n)] = given[n.name]
        self._run(env)
        return self._finish(env, given)

    def _run(self, env: dict[int, torch.Tensor]) -> None:
        run_stages(self.program.stages, env, self.comm)

    def _finish(self, env: dict[int, torch.Tensor], given: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for s in self.program.stages:  # updates take effect when the program finishes
            if s.op == "update" and env[id(s)] is not given[s.args[0].name]:  # (fused steps write in place)
                given[s.args[0].name].copy_(env[id(s)].expand_as(given[s.args[0].name]))
        return {name: (given[o.args[0].name] if o.op == "update" else env[id(o)])
                for name, o in zip(self.program.output_names, self.program.outputs)}


def compile(program: Program, group: dist.ProcessGroup | None = None,  # noqa: A001
            backend: str | None = None) -> CompiledProgram:
    """Compile `program` for the current rank of `group` (default: the whole world).
    backend: 'auto' (default), 'shm' or 'torch' (see StageComm)."""
    return CompiledProgram(program, group, backend)


class CompiledPlan(CompiledProgram):
    """Callable like `cocosync.compile(program)`: `out = fn(**inputs)` with this rank's parts of the inputs.

    Steps with a fast form (fused kernels, fused shared-memory collectives: runtime.steps) use it; the others run
    their stages one by one. kernels: 'inductor' or 'eager' (default $COCOSYNC_KERNELS, else inductor).
    `fast=False` runs every step by its reference implementation. donate: names of inputs the program may
    consume (their contents are undefined afterwards), e.g. arena gradients reduced in place. fuse_reduction:
    within a node a fused collective's kernel sums the ranks' gradient chunks itself (default True, or
    $COCOSYNC_FUSE_REDUCTION=0; False reduces first, for A/B measurements). kernel_bytes: gradient bytes per call
    of a fused collective's kernel (default: $COCOSYNC_KERNEL_BYTES, else `cocosync tune kernel-bytes`'s value,
    else 2 MB). eager_work: elements x stages below which a compiled kernel runs its eager source (default:
    $COCOSYNC_EAGER_WORK, else `cocosync tune eager-work`'s value, else 256K)."""

    def __init__(self, plan: Plan, group: dist.ProcessGroup | None = None, *, backend: str | None = None,
                 kernels: str | None = None, fast: bool = True, donate: tuple[str, ...] = (),
                 fuse_reduction: bool | None = None, kernel_bytes: int | None = None,
                 eager_work: int | None = None):
        super().__init__(plan.program, group, backend)
        self.plan = plan
        unknown = set(donate) - {n.name for n in plan.program.inputs}
        if unknown:
            raise ValueError(f"donate={sorted(unknown)}: not inputs of {plan.program.name!r}")
        options = StepOptions.make(kernels=kernels, donate=frozenset(donate), fuse_reduction=fuse_reduction,
                                   kernel_bytes=kernel_bytes, eager_work=eager_work)
        self.runners = []
        earlier: set[int] = set()  # the stages of the steps before (they have run when a step runs)
        for step in plan.steps:
            self.runners.append(prepare(step, plan.program, self.comm, options, frozenset(earlier)) if fast else None)
            earlier.update(id(s) for s in step.stages)
        self._profile: StepProfile | None = None

    @property
    def fast_steps(self) -> list[str]:
        """The steps that run in a fast form (for reports and tests)."""
        return [str(s) for s, r in zip(self.plan.steps, self.runners) if r is not None]

    @contextmanager
    def profile(self, sync: bool = False) -> Iterator[StepProfile]:
        """Time every step of the calls made inside the block (see runtime.profile); sync=True: the node's ranks meet
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
        for i in range(len(self.runners)):
            self.run_step(i, env)

    def run_step(self, i: int, env: dict[int, torch.Tensor]) -> None:
        """Step i on `env`: its fast form if it has one, else its stages one by one."""
        runner = self.runners[i]
        if runner is not None:
            runner(env)
        else:
            run_stages(self.plan.steps[i].stages, env, self.comm)


def compile_plan(plan: Plan, group: dist.ProcessGroup | None = None, **options: Any) -> CompiledPlan:
    """Compile a plan for this rank; options: backend, kernels, fast, donate, fuse_reduction, kernel_bytes,
    eager_work (see CompiledPlan)."""
    return CompiledPlan(plan, group, **options)


def compile_scheduled(program_or_schedule: Any, group: dist.ProcessGroup | None = None,
                      **options: Any) -> CompiledPlan:
    """Lower a Program (or a Schedule's program) and compile the plan (options as for compile_plan)."""
    program = getattr(program_or_schedule, "program", program_or_schedule)
    return compile_plan(lower(program), group, **options)
