"""`cocosync show FILE.py|NAME`: a program, its schedule, the transformed listing and the plan.

FILE.py defines `program` (a Program) and optionally `schedule` (a Schedule, or a function program -> Schedule).
NAME is a built-in example: sgd, adam, lamb, megatron, pipeline, ma, bmuf (ShadowSync's dense sync).
"""

from __future__ import annotations

import runpy
from pathlib import Path

import click


def _builtin(name: str):
    from cocosync.programs.lamb import lamb_program
    from cocosync.programs.model_parallel import megatron_mlp_program, pipeline_program
    from cocosync.programs.optimizers import adam_program, sgd_program
    from cocosync.programs.sync import bmuf_program, ma_program
    from cocosync.schedule.standard import STANDARD

    programs = {"sgd": lambda: sgd_program(1024, momentum=True), "adam": lambda: adam_program(1024),
                "lamb": lambda: lamb_program(1024), "megatron": lambda: megatron_mlp_program(8, 1024, 4096),
                "pipeline": lambda: pipeline_program(8, 1024), "ma": lambda: ma_program(1024),
                "bmuf": lambda: bmuf_program(1024)}
    return programs[name](), STANDARD[name]


def load(target: str):
    """(program, schedule or None) from a file or a built-in name."""
    from cocosync.schedule import Schedule

    if not target.endswith(".py"):
        try:
            program, sched = _builtin(target)
        except KeyError:
            raise click.BadParameter(f"{target!r} is neither a .py file nor a built-in example "
                                     "(sgd, adam, lamb, megatron, pipeline, ma, bmuf)") from None
    else:
        if not Path(target).is_file():
            raise click.BadParameter(f"file {target!r} does not exist")
        ns = runpy.run_path(target)
        if "program" not in ns:
            raise click.BadParameter(f"{target} does not define `program`")
        program, sched = ns["program"], ns.get("schedule")
    if callable(sched) and not isinstance(sched, Schedule):
        sched = sched(program)
    return program, sched


@click.command()
@click.argument("target")
@click.option("--dump", is_flag=True, help="Print the plan after each lowering pass.")
def show(target: str, dump: bool) -> None:
    """Print a program, its schedule, the transformed program and its plan (TARGET: FILE.py or sgd, adam, lamb,
    megatron, pipeline, ma, bmuf)."""
    from cocosync.lower import lower
    from cocosync.runtime.steps.prepare import static_reason

    program, sched = load(target)
    click.echo(str(program))
    final = program
    if sched is not None:
        click.echo("")
        click.echo(str(sched))
        final = sched.program
        click.echo("")
        click.echo(str(final))
    click.echo("")
    plan = lower(final, dump=dump)
    click.echo(str(plan))
    if dump:  # which steps have a fast form, and why not where they do not (judged from the program alone)
        click.echo("--- fast forms ---")
        for i, step in enumerate(plan.steps):
            reason = static_reason(step, plan.program)
            click.echo(f"  {i:>2}: {'fast' if reason is None else 'stage by stage: ' + reason}")


explain = show
