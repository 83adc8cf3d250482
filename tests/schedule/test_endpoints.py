"""reorder and fuse take the endpoints a user names (CoCoNeT's expression-tree stages): naming Adam's three updates
gives exactly the standard schedule's program, which the interpreter checks against the program as written; a
path through an all_reduce is not taken (the cycle error stays)."""

from __future__ import annotations

import pytest
import torch

import cocosync as cs
from cocosync.dsl import Local
from cocosync.interp import interpret
from cocosync.programs.lamb import lamb_program
from cocosync.programs.optimizers import adam_program, sgd_program
from cocosync.programs.sync import bmuf_program
from cocosync.schedule.errors import ScheduleError
from cocosync.schedule.fuse import fuse
from cocosync.schedule.schedule import Schedule
from cocosync.schedule.standard import STANDARD
from cocosync.tune.workloads import global_inputs

CASES = {  # program, its updates (the endpoints), the state kept sliced
    "adam": (adam_program(96), ["m_new", "v_new", "w_new"], ["m", "v"]),
    "lamb": (lamb_program(96), ["m_new", "v_new", "w_new"], ["m", "v"]),
    "sgd": (sgd_program(96, momentum=True), ["buf_new", "w_new"], ["buf"]),
    "bmuf": (bmuf_program(96), ["s_new", "glob_new", "delta_new"], ["glob", "delta"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_naming_the_updates_gives_the_standard_schedule(name):
    program, updates, state = CASES[name]
    s = Schedule(program)
    _, ag = s.split([x.name for x in program.stages if x.op == "all_reduce"][0])
    s.reorder(updates, ag)
    s.as_slice(state)
    s.fuse(updates)
    assert str(s.program) == str(STANDARD[name](program).program)
    assert str(s.directives[-1]) == f"fuse([{', '.join(updates)}])"  # the schedule as written, short
    for world in (2, 3):
        inputs = global_inputs(program, world, {"c1": 0.1, "c2": 0.01, "eps": 1e-8})
        want, got = interpret(program, world, inputs), interpret(s.program, world, inputs)
        for rank, (w, g) in enumerate(zip(want, got)):
            for k, ref in w.items():
                part = ref.chunk(world)[rank] if k in state else ref
                torch.testing.assert_close(g[k], part, rtol=1e-5, atol=1e-6)


def test_endpoints_do_not_reach_through_an_all_reduce():
    g, w = cs.Tensor("g", 8, layout=Local), cs.Tensor("w", 8)
    a = w * 2.0
    p = cs.Program("cyc", [g, w], {"c": a + cs.all_reduce(g * a)})
    with pytest.raises(ScheduleError, match="would form a cycle"):
        fuse(p, ["mul1", "add1"])


def test_fuse_of_an_all_reduce_with_computations_is_a_fused_all_reduce():
    """CoCoNeT's fuse(AllReduce, update): split implicitly, the computations on slices, one fused collective."""
    from cocosync.lower import lower
    from cocosync.lower.plan import FusedCollective

    program = sgd_program(96)
    s = Schedule(program)
    s.fuse(["all_reduce1", "w_new"])
    assert str(s.program) == str(STANDARD["sgd"](program).program)
    assert any(isinstance(step, FusedCollective) for step in lower(s).steps)
    momentum = sgd_program(96, momentum=True)  # two states: each gathered, no single all_gather to end on
    with pytest.raises(ScheduleError, match="exactly one reduce_scatter"):
        Schedule(momentum).fuse(["all_reduce1", "w_new", "buf_new"])
