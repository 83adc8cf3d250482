"""The IR: immutable nodes and programs.

A `Node` is one value of the program: an input, a constant, or a stage (an op applied to other nodes). Shapes
are *global* (logical) shapes: a Sliced tensor of shape (1024,) on 4 ranks holds 256 elements per rank. Types
(shape, dtype, layout) are inferred once, when a node is built (see ops.py), so a Node is always well-typed.

A `Program` names every stage (auto names like `add2` for those the user did not name), lists them in
topological order, and is what schedules transform and lowerings compile. Passes build new programs with
`dataclasses.replace`; nodes are never mutated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from cocosync.dsl.registry import OpKind, names
from cocosync.dsl.types import DslError, Layout

#: ops that are leaves of the graph, not stages
LEAF_OPS = names(lambda d: d.kind is OpKind.LEAF)


@dataclass(frozen=True, eq=False, slots=True)
class Node:
    op: str
    args: tuple["Node", ...]
    attrs: tuple[tuple[str, Any], ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Layout
    name: str | None = None

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_leaf(self) -> bool:
        return self.op in LEAF_OPS

    def __repr__(self) -> str:
        from cocosync.dsl.printer import type_str

        return f"<{self.op} {self.name or '?'}: {type_str(self)}>"

    # Arithmetic builds new nodes. `==` stays identity (nodes are dict keys); use ops.eq / ops.ne for values.
    def __add__(self, o): return _ARITH["add"](self, o)
    def __radd__(self, o): return _ARITH["add"](o, self)
    def __sub__(self, o): return _ARITH["sub"](self, o)
    def __rsub__(self, o): return _ARITH["sub"](o, self)
    def __mul__(self, o): return _ARITH["mul"](self, o)
    def __rmul__(self, o): return _ARITH["mul"](o, self)
    def __truediv__(self, o): return _ARITH["div"](self, o)
    def __rtruediv__(self, o): return _ARITH["div"](o, self)
    def __pow__(self, o): return _ARITH["pow"](self, o)
    def __neg__(self): return _ARITH["neg"](self)
    def __abs__(self): return _ARITH["abs"](self)
    def __matmul__(self, o): return _ARITH["matmul"](self, o)
    def __lt__(self, o): return _ARITH["lt"](self, o)
    def __le__(self, o): return _ARITH["le"](self, o)
    def __gt__(self, o): return _ARITH["gt"](self, o)
    def __ge__(self, o): return _ARITH["ge"](self, o)
    __hash__ = object.__hash__


#: the ops behind Node's operators, by name: bound by cocosync.dsl.ops (`bind_operators`), which builds nodes and so
#: imports this module; `cocosync.dsl` imports both
_ARITH: dict[str, Callable[..., Node]] = {}


def bind_operators(**ops: Callable[..., Node]) -> None:
    """Node's operators (`a + b`, `-a`, `a @ b`, `a < b`, ...) build nodes with these DSL ops, by name."""
    _ARITH.update(ops)


def topo_order(outputs: Iterable[Node]) -> list[Node]:
    """All nodes reachable from outputs, each after its arguments (deterministic DFS post-order)."""
    seen: set[int] = set()
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(n, False) for n in reversed(list(outputs))]
    while stack:
        node, expanded = stack.pop()
        if id(node) in seen:
            continue
        if expanded:
            seen.add(id(node))
            order.append(node)
            continue
        stack.append((node, True))
        stack.extend((a, False) for a in reversed(node.args) if id(a) not in seen)
    return order


@dataclass(frozen=True, slots=True)
class Group:
    """A schedule annotation: stages that run as one unit. kind: 'fuse' (one kernel / fused collective) or 'overlap'."""

    kind: str
    stages: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Program:
    """`Program(name, inputs, outputs)`: outputs is a list of nodes (named by their stage names) or a dict name -> node.

    `stages` (topological order, leaves excluded) and `output_names` are filled in; every stage gets a unique name.
    """

    name: str
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]
    stages: tuple[Node, ...] = ()
    output_names: tuple[str, ...] = ()
    groups: tuple[Group, ...] = ()
    origin: Mapping[int, Node] = field(default_factory=dict, compare=False, repr=False)

    def __init__(self, name: str, inputs: Sequence[Node], outputs: Sequence[Node] | Mapping[str, Node],
                 stages: Sequence[Node] = (), output_names: Sequence[str] = (), groups: Sequence[Group] = (),
                 origin: Mapping[int, Node] | None = None):
        if isinstance(outputs, Mapping):
            output_names, outputs = tuple(outputs.keys()), tuple(outputs.values())
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass init
        set_("name", name)
        set_("groups", tuple(groups))
        if stages:  # already canonical (built by a pass): keep as given
            set_("inputs", tuple(inputs))
            set_("outputs", tuple(outputs))
            set_("stages", tuple(stages))
            set_("output_names", tuple(output_names) or tuple(
                o.args[0].name if o.op == "update" else o.name for o in outputs))
            set_("origin", dict(origin or {}))
        else:
            self._canonicalize(tuple(inputs), tuple(outputs), tuple(output_names))
        from cocosync.dsl.check import check_program

        check_program(self)

    def _canonicalize(self, inputs: tuple[Node, ...], outputs: tuple[Node, ...], output_names: tuple[str, ...]):
        for n in (*inputs, *outputs):
            if not isinstance(n, Node):
                raise DslError(f"program {self.name!r}: inputs and outputs must be DSL nodes, got {n!r}")
        for n in inputs:
            if n.op != "input":
                raise DslError(f"program {self.name!r}: input {n!r} is a stage, not a Tensor/Scalar declaration")
        nodes = topo_order((*inputs, *outputs))
        used: set[str] = set()
        for node in nodes:
            if node.name is not None and node.op != "const":
                if node.name in used:
                    raise DslError(f"program {self.name!r}: two different values are named {node.name!r}; "
                                   "names must be unique")
                used.add(node.name)
        counters: dict[str, int] = {}
        new: dict[int, Node] = {}
        for node in nodes:
            name = node.name
            if not node.is_leaf and name is None:
                name = self._auto_name(node, new, used, counters)
                used.add(name)
            new[id(node)] = dataclasses.replace(node, name=name, args=tuple(new[id(a)] for a in node.args))
        object.__setattr__(self, "inputs", tuple(new[id(n)] for n in inputs))
        object.__setattr__(self, "outputs", tuple(new[id(n)] for n in outputs))
        object.__setattr__(self, "stages", tuple(n for n in topo_order(self.outputs) if not n.is_leaf))
        # an update's output is named after its state: out["w"] is the new w
        object.__setattr__(self, "output_names", output_names or tuple(
            n.args[0].name if n.op == "update" else n.name for n in self.outputs))
        object.__setattr__(self, "origin", new)

    @staticmethod
    def _auto_name(node: Node, new: dict[int, Node], used: set, counters: dict[str, int]) -> str:
        base = f"{new[id(node.args[0])].name}_new" if node.op == "update" else node.op
        if node.op == "update" and base not in used:
            return base
        k = counters.get(base, 0) + 1
        while f"{base}{k}" in used:
            k += 1
        counters[base] = k
        return f"{base}{k}"

    # lookups ---------------------------------------------------------------------------------------------
    def stage(self, ref: "Node | str") -> Node:
        """The stage named `ref`, or the program's copy of the user's node `ref`."""
        if isinstance(ref, Node):
            if ref.name is not None and any(s is ref for s in self.stages):
                return ref
            hit = self.origin.get(id(ref))
            if hit is not None:
                return hit
            if ref.name is None:
                raise DslError(f"node {ref!r} is not a stage of program {self.name!r}")
            ref = ref.name
        for s in (*self.stages, *self.inputs):
            if s.name == ref:
                return s
        raise DslError(f"program {self.name!r} has no stage named {ref!r}; stages: {[s.name for s in self.stages]}")

    def input(self, name: str) -> Node:
        for n in self.inputs:
            if n.name == name:
                return n
        raise DslError(f"program {self.name!r} has no input {name!r}; inputs: {[n.name for n in self.inputs]}")

    @property
    def updates(self) -> dict[str, Node]:
        """state input name -> the update stage that writes it."""
        return {o.args[0].name: o for o in self.outputs if o.op == "update"}

    def users(self) -> dict[str, list[Node]]:
        """stage/input name -> stages that read it."""
        out: dict[str, list[Node]] = {n.name: [] for n in (*self.inputs, *self.stages)}
        for s in self.stages:
            for a in s.args:
                if not a.is_leaf or a.op == "input":
                    out[a.name].append(s)
        return out

    def __str__(self) -> str:
        from cocosync.dsl.printer import format_program

        return format_program(self)
