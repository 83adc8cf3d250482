"""The reference interpreter: the definition of the language and the oracle of every test.

`interpret(program, world_size, inputs)` runs a program for P simulated ranks in one process with plain torch
ops. It works on *global* values, so each rule reads like the op's definition:

  Local       one tensor per rank
  Replicated  one tensor per group (every rank of the group sees it)
  Sliced      one *whole* tensor per group; rank i of the group sees the i-th part along the sliced dim

Only when results are handed back is a Sliced value cut into each rank's part. Written to be obviously right,
not fast. Reductions accumulate in float32 and cast back, as the runtime does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from cocosync.dsl.check import check_world
from cocosync.dsl.ir import Node, Program
from cocosync.dsl.registry import OpKind, names
from cocosync.dsl.types import DslError, Layout, ReduceOp, part_of

__all__ = ["interpret", "rank_inputs", "dropout_mask", "dropout_uniform", "reduce_tensors", "ELEMENTWISE"]


def dropout_uniform(shape: Sequence[int], seed: int, rank: int | None = None) -> torch.Tensor:
    """The float32 uniform draw behind dropout's keep-mask (element kept where >= p). rank=None
    (Replicated/Sliced values): one draw for the whole tensor from seed alone; a rank (Local values): the draw
    depends on seed and rank. Part of the language's definition."""
    gen = torch.Generator().manual_seed(seed if rank is None else seed * 1_000_003 + rank + 1)
    return torch.rand(tuple(shape), generator=gen)


def dropout_mask(shape: Sequence[int], p: float, seed: int, rank: int | None = None) -> torch.Tensor:
    """Keep-mask of dropout(p, seed): `dropout_uniform(shape, seed, rank) >= p`."""
    return dropout_uniform(shape, seed, rank) >= p


def reduce_tensors(xs: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Elementwise reduction over ranks, accumulated in float32, returned in the inputs' dtype."""
    stacked = torch.stack([x.float() for x in xs])
    out = {ReduceOp.SUM: lambda: stacked.sum(0), ReduceOp.MEAN: lambda: stacked.mean(0),
           ReduceOp.MAX: lambda: stacked.amax(0), ReduceOp.MIN: lambda: stacked.amin(0)}[op]()
    return out.to(xs[0].dtype)


def _dropout(x: torch.Tensor, p: float, seed: int, rank: int | None) -> torch.Tensor:
    return x * dropout_mask(x.shape, p, seed, rank).to(x.dtype) / (1.0 - p)


#: op -> torch function on whole tensors (elementwise ops; dropout takes the rank separately)
ELEMENTWISE: dict[str, Callable[..., torch.Tensor]] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
    "maximum": torch.maximum, "minimum": torch.minimum, "neg": torch.neg, "abs": torch.abs, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "exp": torch.exp, "log": torch.log, "where": torch.where,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
}


@dataclass
class _Val:
    layout: Layout
    parts: list[torch.Tensor]  # per rank (Local) or per group (Replicated, Sliced: the whole tensor)


class _World:
    def __init__(self, world_size: int, gsize: int):
        self.P, self.G = world_size, gsize

    def group(self, r: int) -> int:
        return r // self.G

    def ranks(self, g: int) -> range:
        return range(g * self.G, (g + 1) * self.G)

    @property
    def ngroups(self) -> int:
        return self.P // self.G

    def part(self, v: _Val, r: int) -> torch.Tensor:
        """What rank r holds of v (the interface to the outside world)."""
        if v.layout.is_local:
            return v.parts[r]
        whole = v.parts[self.group(r)]
        if v.layout.is_replicated:
            return whole
        return part_of(whole, v.layout, self.G, r % self.G)

    def for_rank(self, v: _Val, r: int) -> torch.Tensor:
        """v as an operand of a Local computation on rank r (Replicated/Sliced values never meet Local ones
        except Replicated, which is the group's whole tensor)."""
        return v.parts[r] if v.layout.is_local else v.parts[self.group(r)]


def _load_input(node: Node, value: Any, w: _World) -> _Val:
    def one(t: Any, what: str) -> torch.Tensor:
        if isinstance(t, (int, float)) and node.attr("kind") == "scalar":
            t = torch.tensor(float(t), dtype=node.dtype)
        if not isinstance(t, torch.Tensor):
            raise DslError(f"input {node.name!r}{what}: expected a tensor, got {type(t).__name__}")
        if tuple(t.shape) != node.shape or t.dtype != node.dtype:
            raise DslError(f"input {node.name!r}{what}: expected shape {node.shape} dtype {node.dtype}, "
                           f"got shape {tuple(t.shape)} dtype {t.dtype}")
        return t.detach().clone()

    if node.layout.is_local:
        if isinstance(value, (list, tuple)):
            if len(value) != w.P:
                raise DslError(f"input {node.name!r} is Local: pass one tensor per rank ({w.P}), got {len(value)}")
            return _Val(node.layout, [one(t, f"[rank {r}]") for r, t in enumerate(value)])
        return _Val(node.layout, [one(value, "")] * w.P)
    return _Val(node.layout, [one(value, "")] * w.ngroups)


def _elementwise(node: Node, args: list[_Val], w: _World) -> _Val:
    def apply(xs: list[torch.Tensor], rank: int | None) -> torch.Tensor:
        if node.op == "cast":
            return xs[0].to(node.attr("to"))
        if node.op == "dropout":
            return _dropout(xs[0], node.attr("p"), node.attr("seed"), rank)
        return ELEMENTWISE[node.op](*xs).to(node.dtype)

    if node.layout.is_local:
        return _Val(node.layout, [apply([w.for_rank(a, r) for a in args], r) for r in range(w.P)])
    return _Val(node.layout, [apply([a.parts[g] for a in args], None) for g in range(w.ngroups)])


def _matmul(node: Node, a: _Val, b: _Val, w: _World) -> _Val:
    if a.layout.is_sliced and b.layout.is_sliced:  # S[k] x S[0] -> L: partial products, one per rank
        parts = [a.parts[w.group(r)].chunk(w.G, dim=-1)[r % w.G] @ b.parts[w.group(r)].chunk(w.G, dim=0)[r % w.G]
                 for r in range(w.P)]
        return _Val(node.layout, parts)
    if node.layout.is_local:
        return _Val(node.layout, [w.for_rank(a, r) @ w.for_rank(b, r) for r in range(w.P)])
    return _Val(node.layout, [a.parts[g] @ b.parts[g] for g in range(w.ngroups)])


def _to_scalar(node: Node, x: _Val, fn: Callable[[torch.Tensor], torch.Tensor], w: _World) -> _Val:
    return _Val(node.layout, [fn(t.float()).to(node.dtype) for t in x.parts])


def segment_norms(x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """segment_norm on a whole (global) 1-D tensor: each element becomes the L2 norm of its segment (float32)."""
    norms = torch.stack([part.float().norm() for part in x.split(list(sizes))])
    return norms.repeat_interleave(torch.tensor(sizes))


def reduce_all(x: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """reduce_tensor of a whole tensor: ReduceOp's partial reduction (MEAN: the sum over the count)."""
    out = op.partial(x)
    return out / x.numel() if op is ReduceOp.MEAN else out


def _comm(node: Node, x: _Val, w: _World) -> _Val:
    op, root = node.attr("op"), node.attr("root")
    reduced = lambda g: reduce_tensors([x.parts[r] for r in w.ranks(g)], op)  # noqa: E731
    match node.op:
        case "all_reduce" | "reduce_scatter":
            return _Val(node.layout, [reduced(g) for g in range(w.ngroups)])
        case "all_gather" | "scatter":
            return _Val(node.layout, list(x.parts))
        case "broadcast":
            return _Val(node.layout, [x.parts[g * w.G + root] for g in range(w.ngroups)])
        case "reduce":
            return _Val(node.layout, [reduced(w.group(r)) if r % w.G == root else x.parts[r] for r in range(w.P)])
        case "send":  # group g receives what group g-1 sent; the first group receives zeros
            step = w.G if x.layout.is_local else 1
            return _Val(node.layout, [x.parts[i - step] if i >= step else torch.zeros_like(x.parts[i])
                                      for i in range(len(x.parts))])
    raise DslError(f"interpreter: no rule for communication op {node.op!r}")


def _update(node: Node, value: _Val, w: _World) -> _Val:
    state = node.args[0]
    shape = state.shape
    if state.layout.is_local and not value.layout.is_local:
        parts = [value.parts[w.group(r)] for r in range(w.P)]
    else:
        parts = value.parts
    return _Val(state.layout, [p.expand(shape).clone() for p in parts])


def interpret(program: Program, world_size: int, inputs: Mapping[str, Any]) -> list[dict[str, torch.Tensor]]:
    """Run `program` on `world_size` simulated ranks; returns, per rank, {output name: what that rank holds}.

    inputs: Replicated and Sliced tensors are given whole (global shape); a Local tensor as a list of one tensor
    per rank (or a single tensor, the same on every rank); a Scalar as a number or 0-dim tensor. State updates
    appear as outputs named after the state. Inputs are not modified.
    """
    w = _World(world_size, check_world(program, world_size))
    names = {n.name for n in program.inputs}
    if missing := sorted(names - set(inputs)):
        raise DslError(f"interpret {program.name!r}: missing inputs {missing}")
    if extra := sorted(set(inputs) - names):
        raise DslError(f"interpret {program.name!r}: unknown inputs {extra}; the program takes {sorted(names)}")
    env: dict[int, _Val] = {id(n): _load_input(n, inputs[n.name], w) for n in program.inputs}
    for s in program.stages:
        for a in s.args:
            if a.op == "const":
                env[id(a)] = _Val(a.layout, [torch.tensor(a.attr("value"), dtype=a.dtype)] * w.ngroups)
        env[id(s)] = RULES[s.op](s, [env[id(a)] for a in s.args], w)
    return [{name: w.part(env[id(o)], r).clone() for name, o in zip(program.output_names, program.outputs)}
            for r in range(world_size)]




Rule = Callable[[Node, list[_Val], _World], _Val]
#: op -> its meaning on the simulated world (every non-leaf op of dsl.registry has one: tests/dsl/test_registry.py)
RULES: dict[str, Rule] = {
    **{op: _elementwise for op in names(lambda d: d.elementwise)},
    **{op: lambda s, a, w: _comm(s, a[0], w) for op in names(lambda d: d.communicates or d.kind is OpKind.SLICE)},
    "matmul": lambda s, a, w: _matmul(s, *a, w),
    "norm": lambda s, a, w: _to_scalar(s, a[0], torch.linalg.vector_norm, w),
    "segment_norm": lambda s, a, w: _Val(s.layout, [segment_norms(t, s.attr("sizes")).to(s.dtype) for t in a[0].parts]),
    "reduce_tensor": lambda s, a, w: _to_scalar(s, a[0], lambda t: reduce_all(t, s.attr("op")), w),
    "update": lambda s, a, w: _update(s, a[1], w),
}


def rank_inputs(program: Program, world_size: int, inputs: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """The part of interpreter-style (global) `inputs` that rank `rank` passes to a compiled program."""
    w = _World(world_size, check_world(program, world_size))
    out = {}
    for n in program.inputs:
        v = inputs[n.name]
        if n.layout.is_local and isinstance(v, (list, tuple)):
            out[n.name] = v[rank]
        elif n.layout.is_sliced:
            out[n.name] = part_of(v, n.layout, w.G, rank % w.G).contiguous()
        else:
            out[n.name] = v
    return out
