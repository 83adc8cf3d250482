"""Named endpoints stand for the stages between them (CoCoNeT's expression-tree stages): `fuse` and `reorder` take
what the user names plus the intermediate stages, so a schedule can say fuse([m_new, v_new, w_new]) for Adam's three
updates instead of listing every multiply and add on the way.

* between(names): the named stages and every stage on a path from one of them to another;
* a fuse group holding an all_gather but not the reduce_scatter its values come from (or the other way round)
  reaches back to that reduce_scatter (forward to that all_gather), with the stages between, and takes the
  computations of inputs alone that only the group reads (scatters of state, 1 - beta1): a fused collective.
"""

from __future__ import annotations

from typing import Iterable

from cocosync.dsl.ir import Program
from cocosync.dsl.registry import OPS
from cocosync.schedule._rewrite import graph

__all__ = ["between", "between_readers", "fused_collective_closure"]


def _reach(start: Iterable[str], edges: dict[str, list[str]], through: set[str] | None = None) -> set[str]:
    """Stages reachable from `start` along `edges`, passing only through `through` (None: any)."""
    seen, stack = set(), list(start)
    while stack:
        x = stack.pop()
        for y in edges.get(x, ()):
            if y not in seen and (through is None or y in through):
                seen.add(y)
                stack.append(y)
    return seen


def between(program: Program, names: Iterable[str]) -> list[str]:
    """`names` and the stages on paths between them, in program order. A path counts only through stages a fused
    group may hold (computations, and the reduce_scatter / all_gather of a fused collective): the middle of an
    all_reduce or a matmul is not taken (fusing across it stays the error it was)."""
    args, users = graph(program)
    named = set(names)
    for s in program.stages:  # an update stands for the value it writes (its readers read that value)
        if s.name in named and s.op == "update" and not s.args[1].is_leaf:
            named.add(s.args[1].name)
    fusable = {s.name for s in program.stages if OPS[s.op].fusable or s.op in ("reduce_scatter", "all_gather")}
    middle = _reach(named, users, fusable) & _reach(named, args, fusable)
    return [s.name for s in program.stages if s.name in named or s.name in middle]


def _pure(program: Program) -> set[str]:
    """Stages a fused kernel may hold computed from inputs alone (scatters of state, 1 - beta1, beta1 * m); not a
    matmul of inputs (Megatron's first GEMM), which stays its own step."""
    pure: set[str] = set()
    for s in program.stages:
        if OPS[s.op].fusable and all((a.is_leaf and not a.layout.is_local) or a.name in pure
                                              for a in s.args):
            pure.add(s.name)
    return pure


def fused_collective_closure(program: Program, names: list[str]) -> list[str]:
    """A group holding a reduce_scatter or an all_gather grown into a fused collective: to the other end when it
    holds one only, and with the input-only computations only it reads (a group of computations: unchanged)."""
    ops = {s.name: s.op for s in program.stages}
    args, users = graph(program)
    inside = set(names)
    has_rs = any(ops.get(n) == "reduce_scatter" for n in inside)
    has_ag = any(ops.get(n) == "all_gather" for n in inside)
    if not has_rs and not has_ag:
        return names
    grown = set(inside)
    if has_rs != has_ag:
        if has_ag:
            ends = [n for n in _reach(inside, args) if ops.get(n) == "reduce_scatter"]
        else:
            ends = [n for n in _reach(inside, users) if ops.get(n) == "all_gather"]
        if len(ends) != 1:
            return names
        grown = set(between(program, [*inside, ends[0]]))
    pure = _pure(program)
    for s in reversed(program.stages):  # computations of inputs alone that only the group reads join it
        if s.name in pure and users[s.name] and all(u in grown for u in users[s.name]):
            grown.add(s.name)
    return [s.name for s in program.stages if s.name in grown]


def between_readers(program: Program, all_gather: str, names: list[str]) -> list[str]:
    """reorder's endpoints: the computations on paths from `all_gather` to the named ones, plus the computations of
    inputs alone that only those read (like `beta1 * m`, so state is read through slices only), in program order;
    the all_gather itself excluded."""
    args, users = graph(program)
    moved = set(between(program, [all_gather, *names])) - {all_gather}
    pure = _pure(program)
    for s in reversed(program.stages):
        if s.name in pure and s.ndim and users[s.name] and all(u in moved for u in users[s.name]):
            moved.add(s.name)
    return [s.name for s in program.stages if s.name in moved]
