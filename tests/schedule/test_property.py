"""Property tests: random well-typed programs under random valid schedules compute what the unscheduled program
computes, under the interpreter (hypothesis) and on real 2- and 4-process runs of their lowered plans (a sample)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cocosync as cs
from cocosync.dsl.ir import Program
from cocosync.lower import lower
from cocosync.schedule import replay
from tests.schedule.randprog import (
    adam_vs_torch_on_rank,
    assert_outputs_close,
    case,
    expected_for,
    inputs_for,
    random_program,
    random_schedule,
    run_plans_on_rank,
)


def _check_interp(prog, s, vals, P):
    ins = inputs_for(prog, vals, P)
    want = expected_for(s.program, cs.interpret(prog, P, ins), P)
    assert_outputs_close(cs.interpret(s.program, P, ins), want, f"{prog.name} P={P}")
    # the plan's step order is a valid order of the stages: run the program in that order
    plan = lower(s.program)
    order = [st for step in plan.steps for st in step.stages]
    assert sorted(x.name for x in order) == sorted(x.name for x in plan.program.stages)
    reordered = Program(plan.program.name, plan.program.inputs, plan.program.outputs, stages=order,
                        output_names=plan.program.output_names)
    assert_outputs_close(cs.interpret(reordered, P, ins), want, f"{prog.name} plan order P={P}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6))
def test_random_schedules_match_unscheduled(seed):
    prog, vals = random_program(seed)
    s = random_schedule(prog, seed)
    assert str(replay(prog, s.directives)) == str(s.program)  # schedules are data: replayable
    for P in (2, 4):
        _check_interp(prog, s, vals, P)


@pytest.mark.parametrize("name", ["sgd", "adam", "lamb", "megatron", "megatron_fused", "pipeline"])
def test_standard_schedules_match_unscheduled(name):
    prog, s, vals = case(("std", name))
    for P in (2, 4):
        _check_interp(prog, s, vals, P)


STD = ("sgd", "adam", "lamb", "megatron", "megatron_fused", "pipeline")
RANK_KEYS = [("std", n) for n in STD] + [("rand", k) for k in range(8)]


@pytest.mark.parametrize("P", [2, 4])
def test_plans_on_real_ranks_match_interpreter(rank_pool, P):
    per_rank = rank_pool(P).run(run_plans_on_rank, RANK_KEYS)
    for key in RANK_KEYS:
        prog, s, vals = case(key)
        want = expected_for(s.program, cs.interpret(prog, P, inputs_for(prog, vals, P)), P)
        assert_outputs_close([per_rank[r][key] for r in range(P)], want, f"{key} P={P}", tol=1e-4)


def test_scheduled_adam_matches_torch_adam(rank_pool):
    P, n, steps = 2, 16, 3
    got = rank_pool(P).run(adam_vs_torch_on_rank, n, steps)
    from tests.schedule.randprog import _rand

    w = _rand(n, 7).clone().requires_grad_(True)
    opt = torch.optim.Adam([w], lr=0.01)
    for t in range(1, steps + 1):
        w.grad = torch.stack([_rand(n, 1000 * t + r) for r in range(P)]).mean(0)
        opt.step()
    state = opt.state[w]
    for r in range(P):
        torch.testing.assert_close(got[r]["w"], w.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[r]["m"], state["exp_avg"].chunk(P)[r], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[r]["v"], state["exp_avg_sq"].chunk(P)[r], rtol=1e-5, atol=1e-6)
