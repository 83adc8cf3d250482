"""Shared machinery of the transformations: resolving stage handles, fresh names, and rebuilding a Program
after some of its nodes were replaced (types of the replacements are checked, groups and origins carried over)."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from cocosync.dsl.ir import Group, Node, Program
from cocosync.dsl.types import DslError
from cocosync.schedule.errors import ScheduleError

Ref = Node | str


def resolve(program: Program, ref: Ref, directive: str) -> Node:
    """The stage or input `ref` (a name, or a node of this program or of the user's original graph)."""
    try:
        return program.stage(ref)
    except DslError:
        name = ref if isinstance(ref, str) else (ref.name or repr(ref))
        raise ScheduleError(directive, name, f"is not a stage of program {program.name!r}; "
                            f"stages: {[s.name for s in program.stages]}") from None


def names_of(program: Program) -> set[str]:
    return {n.name for n in (*program.inputs, *program.stages) if n.name is not None}


class Namer:
    """Fresh, readable names: `base` if free, else base2, base3, ..."""

    def __init__(self, taken: Iterable[str]):
        self.taken = set(taken)

    def __call__(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            k += 1
            name = f"{base}{k}"
        self.taken.add(name)
        return name


def same_type(a: Node, b: Node) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.layout == b.layout


def remap(stage: Node, new: Mapping[int, Node]) -> Node:
    """`stage` with its arguments replaced by their new versions (which must have the same types)."""
    args = tuple(new.get(id(a), a) for a in stage.args)
    if all(x is y for x, y in zip(args, stage.args)):
        return stage
    for old, nw in zip(stage.args, args):
        if not same_type(old, nw):
            raise DslError(f"internal: {old!r} replaced by {nw!r} under {stage.name!r} changes its type")
    return dataclasses.replace(stage, args=args)


def walk(program: Program, new: dict[int, Node], custom=None) -> dict[int, Node]:
    """Visit stages in order: `custom(stage, new)` returns the stage's new version or None (then: remap)."""
    for s in program.stages:
        if id(s) in new:
            continue
        got = custom(s, new) if custom is not None else None
        new[id(s)] = got if got is not None else remap(s, new)
    return new


def finish(program: Program, new: Mapping[int, Node], *, outputs: Mapping[int, Node] | None = None,
           groups: Iterable[Group] | None = None) -> Program:
    """The program whose inputs and outputs are the new versions in `new` (`outputs` overrides some outputs).
    Unreachable stages disappear; groups naming a stage that is gone are dropped; user handles keep resolving."""
    outputs = outputs or {}
    ins = tuple(new.get(id(i), i) for i in program.inputs)
    outs = tuple(outputs.get(id(o)) or new.get(id(o), o) for o in program.outputs)
    staged = Program(program.name, ins, outs, output_names=program.output_names)
    present = {s.name for s in staged.stages}
    kept = tuple(g for g in (program.groups if groups is None else groups) if all(n in present for n in g.stages))
    origin = dict(staged.origin)
    for uid, old in program.origin.items():
        hit = staged.origin.get(id(new.get(id(old), old)))
        if hit is not None:
            origin[uid] = hit
    return dataclasses.replace(staged, groups=kept, origin=origin)


def graph(program: Program) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(args, users): stage name -> names of the stages/inputs it reads, and -> names of the stages reading it."""
    args = {s.name: [a.name for a in s.args if not a.is_leaf or a.op == "input"] for s in program.stages}
    users = {n: [] for n in names_of(program)}
    for s, xs in args.items():
        for a in xs:
            users[a].append(s)
    return args, users


def connected(members: list[str], args: Mapping[str, list[str]]) -> list[list[str]]:
    """The connected components of `members` (edges: one reads the other)."""
    inside = set(members)
    adj = {m: set() for m in members}
    for m in members:
        for a in args.get(m, ()):
            if a in inside:
                adj[m].add(a)
                adj[a].add(m)
    comps, seen = [], set()
    for m in members:
        if m in seen:
            continue
        comp, stack = [], [m]
        seen.add(m)
        while stack:
            x = stack.pop()
            comp.append(x)
            for y in adj[x] - seen:
                seen.add(y)
                stack.append(y)
        comps.append(comp)
    return comps


def outside_path(members: list[str], args: Mapping[str, list[str]],
                 users: Mapping[str, list[str]]) -> tuple[str, str, str] | None:
    """(a, x, b) when an outside stage x reads member a (maybe indirectly) and member b reads x (maybe indirectly):
    grouping the members would form a cycle. None when there is no such path."""
    inside = set(members)
    # outside stages reachable downstream from the members without passing through a member
    down: dict[str, str] = {}
    stack = [(u, m) for m in members for u in users.get(m, ()) if u not in inside]
    while stack:
        x, src = stack.pop()
        if x in down:
            continue
        down[x] = src
        stack.extend((u, src) for u in users.get(x, ()) if u not in inside)
    for b in members:
        for x in args.get(b, ()):
            if x not in inside and x in down:
                return down[x], x, b
    return None


def named(node: Node, name: str) -> Node:
    return dataclasses.replace(node, name=name)
