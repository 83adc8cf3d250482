"""EASGD as a DSL program (programs/sync.py): the compiled program equals the reference interpreter and the
textbook equations (the hand-written update it replaced), in every kernel form; it needs no process group (it has no
collective); the sync servers' centre shards run the same program."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cocosync.dsl import DslError, Local, Program, Tensor, all_reduce
from cocosync.interp import interpret
from cocosync.lower import lower
from cocosync.programs.sync import easgd_program
from cocosync.runtime.executor import compile_plan
from cocosync.shadowsync.sync.center import CenterShard

N = 1003


def _equations(x: torch.Tensor, c: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The update EASGD's class made by hand: diff = alpha * (x - c); x - diff, c + diff."""
    diff = (x - c) * alpha
    return x - diff, c + diff


def _vectors(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, generator=g), torch.randn(N, generator=g) * 3


@pytest.mark.parametrize("kernels,eager_work", [("eager", None), ("inductor", 0)], ids=["eager", "inductor"])
def test_compiled_easgd_equals_interpreter_and_equations(kernels, eager_work):
    assert not dist.is_initialized()  # a program without collectives runs on this process alone
    program = easgd_program(N)
    step = compile_plan(lower(program), kernels=kernels, eager_work=eager_work)
    assert step.fast_steps and step.comm.shm is None, step.fast_steps
    x, c = _vectors(0)
    for k, alpha in enumerate((0.3, 0.3, 0.05)):
        want = interpret(program, 1, {"x": x.clone(), "c": c.clone(), "alpha": alpha})[0]
        ref_x, ref_c = _equations(x, c, alpha)
        step(x=x, c=c, alpha=alpha)  # in place
        torch.testing.assert_close(x, want["x"], rtol=1e-6, atol=1e-6, msg=f"round {k}")
        torch.testing.assert_close(c, want["c"], rtol=1e-6, atol=1e-6, msg=f"round {k}")
        torch.testing.assert_close(x, ref_x, rtol=1e-6, atol=1e-6, msg=f"round {k}")
        torch.testing.assert_close(c, ref_c, rtol=1e-6, atol=1e-6, msg=f"round {k}")


def test_a_program_with_collectives_still_needs_a_process_group():
    x = Tensor("x", 8, layout=Local)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        compile_plan(lower(Program("avg", [x], [all_reduce(x)])))


def test_a_mistyped_input_is_named_without_a_process_group():
    step = compile_plan(lower(easgd_program(N)))
    with pytest.raises(DslError, match=r"input 'c'.*rank 0 must have local shape \(1003,\)"):
        step(x=torch.zeros(N), c=torch.zeros(N - 1), alpha=0.1)


def test_centre_shard_runs_the_program_and_answers_the_moved_point():
    x, c = _vectors(1)
    shard = CenterShard(c)
    moved = shard.exchange(x.clone(), 0.25)
    ref_x, ref_c = _equations(x, c, 0.25)
    torch.testing.assert_close(moved, ref_x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(shard.values, ref_c, rtol=1e-6, atol=1e-6)
    assert torch.equal(c, _vectors(1)[1])  # the shard holds its own copy
