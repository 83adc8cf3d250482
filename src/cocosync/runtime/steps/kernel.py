"""The fast form of a Kernel step: its fusable stages as one generated function (runtime.steps.codegen), compiled
once; a step that starts with a matmul runs as the GEMM with its epilogue (runtime.steps.matmul)."""

from __future__ import annotations

import dataclasses

from cocosync.dsl.ir import Node, Program
from cocosync.lower.plan import Kernel
from cocosync.runtime.reference.stage import StageComm
from cocosync.runtime.steps.codegen import build_kernel, can_fuse
from cocosync.runtime.steps.common import Runner, StepOptions, eager_work, local_ranks_of, outside_readers, put_consts
from cocosync.runtime.steps.matmul import matmul_runner

__all__ = ["kernel_runner", "kernel_reason"]


def kernel_reason(step: Kernel, program: Program) -> str | None:
    """Why the step runs stage by stage (None: it has a fast form)."""
    stages = list(step.stages)
    if stages[0].op == "matmul":  # a GEMM and its epilogue (lower.merge_kernels puts them in one step)
        if len(stages) < 2 or any(a.ndim != 2 for a in stages[0].args):
            return f"{stages[0].name}: a matmul without an epilogue, or not 2-D: one torch call already"
        return None
    # an update names the value a state takes when the program ends (executor._finish writes it): the kernel
    # computes the value, the update stands for it
    body = [s for s in stages if s.op != "update"]
    # one stage is one torch op already
    if len(body) < 2:
        return f"{stages[0].name}: a single stage runs as one torch op"
    # generated kernels hold the elementwise ops whose value depends only on their operands
    bad = next((s for s in body if not can_fuse(s)), None)
    if bad is not None:
        return f"{bad.name} ({bad.op}) is not an op generated kernels compute"
    # broadcasting keeps the reference semantics, and so does an update whose value changes layout on the way
    odd = next((s for s in stages if s.shape != stages[-1].shape or s.op == "update" and (
        s.args[1].layout != s.args[0].layout or s.args[1].dtype != s.args[0].dtype)), None)
    if odd is not None:
        return (f"{odd.name} has another shape than the kernel's {list(stages[-1].shape)}, or writes a state from "
                "a value of another layout or dtype")
    return None


def kernel_runner(step: Kernel, program: Program, comm: StageComm, options: StepOptions,
                  earlier: frozenset[int] = frozenset()) -> Runner | None:
    """A runner for the step, or None (reference path). `earlier`: the stages of the steps before it."""
    stages = list(step.stages)
    if kernel_reason(step, program) is not None:
        return None
    if stages[0].op == "matmul":
        return matmul_runner(step, program, comm, options, outside_readers(program, {id(s) for s in stages}))
    updates = [s for s in stages if s.op == "update"]
    body = [s for s in stages if s.op != "update"]
    inside = {id(s) for s in body}
    needed = outside_readers(program, inside)
    outs = [s for s in body if id(s) in needed]
    rewritten, form = _through_updates(body)
    work = eager_work(options, local_ranks_of(comm))
    states = _in_place_states(step, program, updates, outs, earlier)
    if states is not None:
        return _in_place_runner(rewritten, form, outs, states, updates, options, work, f"k_{body[0].name}")
    k = build_kernel(rewritten, [form[id(s)] for s in outs], options.kernels, name=f"k_{body[0].name}",
                     eager_work=work)
    aliases = [(id(u), id(u.args[1])) for u in updates]

    def run(env: dict) -> None:
        put_consts(k.inputs, env)
        for node, val in zip(outs, k(*(env[id(a)] for a in k.inputs))):
            env[id(node)] = val
        for u, value in aliases:  # the state's new value; executor._finish writes it when the program ends
            env[u] = env[value]
    return run


def _in_place_states(step: Kernel, program: Program, updates: list[Node], outs: list[Node],
                     earlier: frozenset[int] = frozenset()) -> list[Node] | None:
    """The states the kernel may write in place, one per output (None: it returns new tensors, which the program's
    end copies into the states): every value the kernel hands out is the value of one update of this step, and
    nothing that runs after it reads those states (no stage outside this step and the `earlier` ones, no program
    output: it would see the new values)."""
    by_value = {id(u.args[1]): u.args[0] for u in updates}
    if len(by_value) != len(updates) or {id(o) for o in outs} != set(by_value):
        return None
    inside = {id(s) for s in step.stages} | earlier
    written = {id(u.args[0]) for u in updates}
    if len(written) != len(updates) or any(a.op != "input" for a in by_value.values()):
        return None
    if any(id(a) in written for s in program.stages if id(s) not in inside for a in s.args) or any(
            id(o) in written for o in program.outputs):
        return None
    return [by_value[id(o)] for o in outs]


def _in_place_runner(rewritten: list[Node], form: dict[int, Node], outs: list[Node], states: list[Node],
                     updates: list[Node], options: StepOptions, work: int, name: str) -> Runner:
    """The kernel writing each update's value straight into its state (one pass: e.g. EASGD reads its replica and
    the centre once and writes both, where new tensors and the copies at the program's end take three passes);
    a state the kernel reads is read from the memory it writes (no two arguments alias)."""
    reads = {id(state): i for i, state in enumerate(states)}
    k = build_kernel(rewritten, [form[id(s)] for s in outs], options.kernels, name=name, into=True,
                     reads_out=reads, eager_work=work)

    def run(env: dict) -> None:
        put_consts(k.inputs, env)
        targets = [env[id(state)] for state in states]
        k(*(env[id(a)] for a in k.inputs), *targets)
        for node, state in zip(outs, targets):  # the values are the states now; the program's end copies nothing
            env[id(node)] = state
        for u in updates:
            env[id(u)] = env[id(u.args[1])]
    return run


def _through_updates(body: list[Node]) -> tuple[list[Node], dict[int, Node]]:
    """The stages with every operand that is an update read as the value it writes (a generated kernel computes
    values; the states are written when the program ends), and each original stage's id -> its form here."""
    new: dict[int, Node] = {}

    def value(a: Node) -> Node:
        while a.op == "update":
            a = a.args[1]
        return new.get(id(a), a)

    out = []
    for st in body:
        args = tuple(value(a) for a in st.args)
        new[id(st)] = st if all(x is y for x, y in zip(args, st.args)) else dataclasses.replace(st, args=args)
        out.append(new[id(st)])
    return out, new
