"""Lowering: groups become steps, steps come in a valid order, `dump` shows every pass; `cocosync show`."""

from click.testing import CliRunner

import cocosync as cs
from cocosync import Local
from cocosync.lower import Collective, FusedCollective, Kernel, Overlap, lower
from cocosync.programs.model_parallel import megatron_mlp_program
from cocosync.programs.optimizers import adam_program, sgd_program
from cocosync.schedule import Schedule, adam_schedule, megatron_schedule


def test_unscheduled_program_is_kernels_and_collectives():
    plan = lower(sgd_program(8, momentum=True))
    assert [type(s) for s in plan.steps] == [Kernel, Collective, Kernel]
    assert str(plan) == ("plan sgd_momentum (3 steps)\n   0: kernel(mul1)\n   1: collective(all_reduce1 = all_reduce)\n"
                         "   2: kernel(add1, buf_new, mul2, sub1, w_new)")


def test_adam_is_one_fused_collective():
    plan = lower(adam_schedule(adam_program(8)))
    (step,) = plan.steps
    assert isinstance(step, FusedCollective)
    assert step.rs.op == "reduce_scatter" and step.ag.op == "all_gather"
    assert {s.name for s in step.compute} >= {"m_new", "v_new", "w_new"}


def test_megatron_overlap_step():
    plan = lower(megatron_schedule(megatron_mlp_program(8, 8, 16)))
    assert isinstance(plan.steps[-1], Overlap) and plan.steps[-1].chunks == 4
    assert [s.op for s in plan.steps[-1].stages] == ["matmul", "reduce_scatter", "add", "dropout", "add", "all_gather"]


def test_groups_order_steps_and_kernel_groups():
    s = Schedule(sgd_program(8))
    s.fuse(["mul1", "sub1", "w_new"])
    plan = lower(s)
    assert [str(x) for x in plan.steps] == ["collective(all_reduce1 = all_reduce)", "kernel(mul1, sub1, w_new)"]


def test_dump_lists_every_pass(capsys):
    lower(adam_schedule(adam_program(8)).program, dump=True)
    out = capsys.readouterr().out
    for name in ("check", "dce", "form_units", "order_units", "merge_kernels", "to_steps"):
        assert f"--- after {name} ---" in out


def test_lower_runs_dce():
    x = cs.Tensor("x", 8, layout=Local)
    p = cs.Program("p", [x], {"y": cs.scatter(cs.all_gather(cs.reduce_scatter(x))) * 2.0})
    assert [str(s) for s in lower(p).steps] == ["collective(reduce_scatter1 = reduce_scatter)", "kernel(mul1)"]


def test_show_cli_builtin_and_file(tmp_path):
    from cocosync.cli import main

    res = CliRunner().invoke(main, ["show", "adam"])
    assert res.exit_code == 0, res.output
    assert "schedule of adam (4 directives)" in res.output and "fused_collective(" in res.output
    f = tmp_path / "prog.py"
    f.write_text("from cocosync.programs.optimizers import sgd_program\nfrom cocosync.schedule import Schedule\n"
                 "program = sgd_program(8)\n"
                 "def schedule(p):\n    s = Schedule(p)\n    rs, ag = s.split('all_reduce1')\n    return s\n")
    res = CliRunner().invoke(main, ["show", str(f)])
    assert res.exit_code == 0, res.output
    assert "split(all_reduce1)" in res.output and "all_reduce1_rs = reduce_scatter(g, mean)" in res.output
    res = CliRunner().invoke(main, ["show", "nothing"])
    assert res.exit_code != 0 and "built-in example" in res.output
