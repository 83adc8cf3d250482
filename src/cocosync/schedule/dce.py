"""dce: dead-stage elimination and the trivial simplification the transformations leave behind.

* `scatter(all_gather(x))` along x's sliced dim is x (reorder of a value that was gathered, then sliced again);
* stages no output depends on disappear (so do outputs not in `keep`, when given);
* groups that name a stage which is gone are dropped.
"""

from __future__ import annotations

from typing import Sequence

from cocosync.dsl.ir import Node, Program
from cocosync.schedule._rewrite import finish, walk
from cocosync.schedule.errors import ScheduleError


def dce(program: Program, keep: Sequence[str] | None = None) -> Program:
    if keep is not None:
        unknown = sorted(set(keep) - set(program.output_names))
        if unknown:
            raise ScheduleError("dce", unknown[0], f"is not an output; outputs: {list(program.output_names)}")
        pairs = [(n, o) for n, o in zip(program.output_names, program.outputs) if n in keep]
        program = Program(program.name, program.inputs, {n: o for n, o in pairs}, stages=program.stages,
                          groups=program.groups, origin=program.origin)

    def simplify(s: Node, new: dict[int, Node]) -> Node | None:
        if s.op == "scatter":
            x = new.get(id(s.args[0]), s.args[0])
            if x.op == "all_gather" and x.args[0].layout == s.layout and x.args[0].shape == s.shape:
                return x.args[0]
        return None

    return finish(program, walk(program, {}, simplify))
