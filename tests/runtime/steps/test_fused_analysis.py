"""The one analysis of a fused collective (runtime.steps.fused_analysis): phases, operand kinds, and the reason a
step has no fused form, which `cocosync show --dump` prints."""

from __future__ import annotations

from click.testing import CliRunner

from cocosync.cli import main as cli
from cocosync.dsl.ir import Program
from cocosync.lower import FusedCollective, lower
from cocosync.programs.lamb import lamb_program
from cocosync.programs.mixed_precision import adam_mp_program
from cocosync.programs.optimizers import adam_program
from cocosync.runtime.steps.fused_analysis import FusedGroup, NotFused, OperandKind, analyze
from cocosync.runtime.steps.prepare import static_reason
from cocosync.schedule.standard import adam_schedule, lamb_schedule, sharded_update_schedule


def _step(plan) -> FusedCollective:
    (step,) = [s for s in plan.steps if isinstance(s, FusedCollective)]
    return step


def test_adam_is_one_phase_reading_slices_in_place():
    plan = lower(adam_schedule(adam_program(64)))
    g = analyze(_step(plan), plan.program)
    assert isinstance(g, FusedGroup) and len(g.phases) == 1 and not g.norms
    assert g.w_update is not None and g.gathered in g.phases[0].roots
    assert {s.args[0].name for s in g.writes} == {"m", "v"}
    by_name = {n.name: k for n in plan.program.stages + plan.program.inputs for i, k in g.kinds.items() if id(n) == i}
    assert by_name[g.rs.name] is OperandKind.REDUCED and by_name["w_s"] is OperandKind.GLOBAL
    assert by_name["lr"] is OperandKind.SCALAR
    assert static_reason(_step(plan), plan.program) is None


def test_norms_cut_the_group_into_phases():
    plan = lower(lamb_schedule(lamb_program(64)))
    g = analyze(_step(plan), plan.program)
    assert isinstance(g, FusedGroup) and len(g.phases) == 2
    assert g.phases[0].whole and not g.phases[1].whole  # ||w||, ||r|| summed in phase 0, used in phase 1
    clipped = adam_mp_program(64, clip=True)
    plan = lower(sharded_update_schedule(clipped, ("m", "v")))
    g = analyze(_step(plan), plan.program)
    assert isinstance(g, FusedGroup) and len(g.phases) == 2 and g.phases[0].whole


def test_a_value_read_outside_the_group_is_named():
    plan = lower(adam_schedule(adam_program(64)))
    step = _step(plan)
    inner = next(s for s in step.compute if s.op == "sqrt")
    p = plan.program  # the same stages and fuse group, one more output
    leaky = Program("adam_leak", p.inputs, [*p.outputs, inner], stages=p.stages,
                    output_names=(*p.output_names, "leak"), groups=p.groups)
    why = analyze(step, leaky)
    assert isinstance(why, NotFused) and inner.name in why.reason and "read outside the group" in why.reason
    assert static_reason(step, leaky) == why.reason


def test_show_dump_prints_the_reason(tmp_path):
    f = tmp_path / "prog.py"
    f.write_text("from cocosync.dsl.ir import Program\nfrom cocosync.lower import lower\n"
                 "from cocosync.programs.optimizers import adam_program\n"
                 "from cocosync.schedule.standard import adam_schedule\n"
                 "p = adam_schedule(adam_program(64)).program\n"
                 "inner = next(s for s in p.stages if s.op == 'sqrt')\n"
                 "program = Program('adam_leak', p.inputs, [*p.outputs, inner], stages=p.stages,\n"
                 "                  output_names=(*p.output_names, 'leak'), groups=p.groups)\n")
    out = CliRunner().invoke(cli, ["show", str(f), "--dump"])
    assert out.exit_code == 0, out.output
    assert "--- fast forms ---" in out.output and "stage by stage:" in out.output
    assert "read outside the group" in out.output
    ok = CliRunner().invoke(cli, ["show", "adam", "--dump"])
    assert ok.exit_code == 0 and "0: fast" in ok.output
