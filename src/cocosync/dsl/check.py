"""Whole-program checks (per-op typing is done by the constructors in ops.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cocosync.dsl.types import FLAT, DslError, Sliced, slice_count

if TYPE_CHECKING:
    from cocosync.dsl.ir import Program


def program_groups(program: "Program") -> int:
    """The number of groups the program's communication splits the world into (1 when it has no comm)."""
    seen = {s.attr("groups") for s in program.stages if s.attr("groups") is not None}
    return seen.pop() if seen else 1


def world_independent(program: "Program") -> bool:
    """Whether the program computes the same on any number of ranks: no stage communicates, keeps a rank's slice or
    draws a rank's dropout mask, and no value is Sliced. Such a program runs on its rank alone (a world of one)."""
    from cocosync.dsl.registry import OPS, OpKind

    rank_bound = (OpKind.COMMUNICATES, OpKind.SLICE)
    return not any(OPS[s.op].kind in rank_bound or s.op == "dropout" for s in program.stages) and not any(
        n.layout.is_sliced for n in (*program.inputs, *program.stages))


def check_program(program: "Program") -> None:
    declared = {id(n) for n in program.inputs}
    names = [n.name for n in program.inputs]
    if len(set(names)) != len(names):
        raise DslError(f"program {program.name!r}: input names repeat: {names}")
    for stage in program.stages:
        for a in stage.args:
            if a.op == "input" and id(a) not in declared:
                raise DslError(f"program {program.name!r}: stage {stage.name!r} reads {a.name!r}, which is not in "
                               f"the program's inputs {names}")
    written: dict[str, str] = {}
    for s in program.stages:
        if s.op == "update":
            state = s.args[0].name
            if state in written:
                raise DslError(f"program {program.name!r}: state {state!r} is updated twice "
                               f"({written[state]!r} and {s.name!r}); a state has at most one update")
            written[state] = s.name
    if len(set(program.output_names)) != len(program.output_names):
        raise DslError(f"program {program.name!r}: output names repeat: {list(program.output_names)}")
    groups = {s.attr("groups") for s in program.stages if s.attr("groups") is not None}
    if len(groups) > 1:
        raise DslError(f"program {program.name!r}: communication ops use different groups= values {sorted(groups)}; "
                       "one program splits the world one way")


def check_world(program: "Program", world_size: int) -> int:
    """Check that the program can run on `world_size` ranks; returns the group size G (ranks per group)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise DslError(f"world_size must be a positive int, got {world_size!r}")
    groups = program_groups(program)
    if world_size % groups:
        raise DslError(f"program {program.name!r} splits the world into groups={groups}, "
                       f"which does not divide world_size={world_size}")
    gsize = world_size // groups
    for n in (*program.inputs, *program.stages):
        if n.layout.is_flat and slice_count(n.shape, n.layout) % gsize:
            raise DslError(f"{n.name!r} ({n.shape}, {n.layout}) cannot be sliced into {gsize} equal runs of "
                           f"elements: {slice_count(n.shape, n.layout)} elements; make the element count a multiple "
                           f"of {gsize}")
        if n.layout.is_sliced and not n.layout.is_flat and n.shape[n.layout.dim] % gsize:
            fits = [d for d, k in enumerate(n.shape) if k % gsize == 0]
            hint = f"slice along dim {fits[0]}" if fits else (
                "slice flat (split(..., dim=FLAT))" if slice_count(n.shape, Sliced(FLAT)) % gsize == 0 else "pad it")
            raise DslError(f"{n.name!r} ({n.shape}, {n.layout}) cannot be sliced into {gsize} equal parts along "
                           f"dim {n.layout.dim}; make that dim a multiple of {gsize}, or {hint}")
        root = n.attr("root")
        if root is not None and root >= gsize:
            raise DslError(f"{n.name!r}: root={root} is not a rank of a group of {gsize} ranks "
                           f"(expected 0..{gsize - 1})")
    return gsize
