"""A kernel step whose values are states' updates writes the states in place (one pass, no copy at the program's
end) unless a later stage reads a state's old value; either way the plan equals the interpreter."""

from __future__ import annotations

import pytest
import torch

from cocosync.dsl import Local, Program, Scalar, Tensor, update
from cocosync.interp import interpret
from cocosync.lower import lower
from cocosync.runtime.executor import compile_plan

N = 257


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(N, generator=g), "c": torch.randn(N, generator=g)}


def _check(program: Program, kernels: str, eager_work: int | None) -> tuple[dict, dict]:
    plan = compile_plan(lower(program), kernels=kernels, eager_work=eager_work)
    given = _inputs(3)
    ptrs = {k: v.data_ptr() for k, v in given.items()}
    want = interpret(program, 1, {**{k: v.clone() for k, v in given.items()}, "a": 0.5})[0]
    got = plan(**given, a=0.5)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6, msg=name)
    for name in ("x", "c"):  # the states hold their new values, in the caller's tensors
        assert given[name].data_ptr() == ptrs[name]
        torch.testing.assert_close(given[name], want[name], rtol=1e-6, atol=1e-6, msg=name)
    return plan, want


@pytest.mark.parametrize("kernels,eager_work", [("eager", None), ("inductor", 0)], ids=["eager", "inductor"])
def test_states_read_and_written_by_one_kernel_are_written_in_place(kernels, eager_work):
    x, c, a = Tensor("x", N, layout=Local), Tensor("c", N, layout=Local), Scalar("a")
    d = a * (x - c)
    program = Program("elastic", [x, c, a], [update(x, x - d), update(c, c + d)])
    plan, _ = _check(program, kernels, eager_work)
    runner = plan.runners[0]
    assert runner is not None and runner.__qualname__.startswith("_in_place_runner"), runner.__qualname__


def test_a_state_read_after_the_kernel_step_is_not_written_in_place():
    """all_reduce(x) reads x in another step (lowering may order it either side of the kernel): unless it ran
    before, the kernel must not write x in place, so it returns new tensors that the program's end copies in; c,
    read by nobody else, also waits (one form per kernel)."""
    from cocosync.dsl import all_reduce
    from cocosync.lower.plan import Kernel
    from cocosync.runtime.steps.kernel import _in_place_states

    def decision(program):
        plan = lower(program)
        i, step = next((i, s) for i, s in enumerate(plan.steps) if isinstance(s, Kernel) and any(
            st.op == "update" for st in s.stages))
        earlier = frozenset(id(st) for s in plan.steps[:i] for st in s.stages)
        updates = [s for s in step.stages if s.op == "update"]
        return _in_place_states(step, plan.program, updates, [u.args[1] for u in updates], earlier)

    x, c, a = Tensor("x", N, layout=Local), Tensor("c", N, layout=Local), Scalar("a")
    d = a * (x - c)
    alone = Program("elastic", [x, c, a], [update(x, x - d), update(c, c + d)])
    assert [s.name for s in decision(alone)] == ["x", "c"]
    shared = Program("elastic_sum", [x, c, a], [update(x, x - d), update(c, c + d), all_reduce(x)],
                     output_names=["x", "c", "total"])
    assert decision(shared) is None
    # BMUF's replicated plan reads delta (mom * delta) in a step before the all_reduce: that reader has run when
    # the update kernel writes delta, glob and s in place
    from cocosync.programs.sync import bmuf_program

    assert [s.name for s in decision(bmuf_program(N))] == ["delta", "glob", "s"]
