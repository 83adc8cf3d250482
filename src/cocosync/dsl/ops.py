"""Op constructors with shape, dtype and layout inference (CoCoNeT's rules); each op's properties are in dsl.registry.

Every constructor checks its operands when it is called and raises DslError naming the op, the operands and
what was expected, so an ill-typed program cannot be built.
"""

from __future__ import annotations

from typing import Any

import torch

from cocosync.dsl.ir import Node, bind_operators
from cocosync.dsl.registry import OPS
from cocosync.dsl.types import (
    FLAT,
    FLOAT_DTYPES,
    DslError,
    Layout,
    Local,
    ReduceOp,
    Replicated,
    Sliced,
    as_layout,
    float32,
    parse_reduce_op,
)

COMPARISONS = tuple(op for op, d in OPS.items() if d.comparison)  # lt, le, gt, ge, eq, ne


def _desc(x: Any) -> str:
    if isinstance(x, Node):
        from cocosync.dsl.printer import type_str

        return f"{x.name or x.op}: {type_str(x)}"
    return repr(x)


def _attrs(**kw: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(kw.items())


def _node(opname: str, args: tuple[Node, ...], shape, dtype, layout: Layout, name: str | None = None, **attrs) -> Node:
    return Node(opname, args, _attrs(**attrs), tuple(shape), dtype, layout, name)


# ---- declarations --------------------------------------------------------------------------------------------
def Tensor(name: str, shape: tuple[int, ...] | list[int] | int, dtype: torch.dtype = float32,  # noqa: N802
           layout: Layout = Replicated) -> Node:
    """A program input: global shape, dtype, and layout (Local, Replicated or Sliced(dim))."""
    if not isinstance(name, str) or not name.isidentifier():
        raise DslError(f"Tensor name must be an identifier, got {name!r}")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and d > 0 for d in shape):
        raise DslError(f"Tensor {name!r}: shape must be positive ints, got {shape}")
    if dtype not in FLOAT_DTYPES:
        raise DslError(f"Tensor {name!r}: dtype {dtype} is not supported; expected one of {list(FLOAT_DTYPES)}")
    layout = _flat_1d(as_layout(layout), len(shape))
    if layout.is_sliced and not layout.is_flat and layout.dim >= len(shape):
        raise DslError(f"Tensor {name!r}: {layout} needs a tensor with more than {layout.dim} dims, shape is {shape}")
    return _node("input", (), shape, dtype, layout, name, kind="tensor")


def Scalar(name: str, dtype: torch.dtype = float32) -> Node:  # noqa: N802
    """A scalar program input (the same value on every rank), e.g. a learning rate."""
    if not isinstance(name, str) or not name.isidentifier():
        raise DslError(f"Scalar name must be an identifier, got {name!r}")
    if dtype not in FLOAT_DTYPES:
        raise DslError(f"Scalar {name!r}: dtype {dtype} is not supported; expected one of {list(FLOAT_DTYPES)}")
    return _node("input", (), (), dtype, Replicated, name, kind="scalar")


def const(value: float, dtype: torch.dtype = float32) -> Node:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DslError(f"constant must be an int or float, got {value!r}")
    return _node("const", (), (), dtype, Replicated, None, value=float(value))


# ---- elementwise ----------------------------------------------------------------------------------------------
def _lift(op: str, operands: tuple[Any, ...]) -> tuple[Node, ...]:
    """Turn Python numbers into constants of the dtype of the tensor operands."""
    tensors = [x for x in operands if isinstance(x, Node)]
    if not tensors:
        raise DslError(f"{op}: needs at least one DSL tensor operand, got {operands!r}")
    dtype = next((t.dtype for t in tensors if t.ndim > 0 and t.dtype is not torch.bool), None) or next(
        (t.dtype for t in tensors if t.dtype is not torch.bool), float32)
    out = []
    for x in operands:
        if isinstance(x, Node):
            out.append(x)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            out.append(const(x, dtype))
        else:
            raise DslError(f"{op}: operand {x!r} is neither a DSL tensor nor a Python number")
    return tuple(out)


def _flat_1d(layout: Layout, ndim: int) -> Layout:
    """Flat slices of a 1-D tensor are its slices along dim 0: one spelling for one layout."""
    return Sliced(0) if layout.is_flat and ndim == 1 else layout


def _broadcast_layout(op: str, args: tuple[Node, ...], shape: tuple[int, ...]) -> Layout:
    """CoCoNeT's rule: Replicated operands take the other operands' layout; Local and Sliced never mix. A flat slice
    holds a run of elements, not whole rows: its other tensor operands must have the result's full shape."""
    layouts = []
    for a in args:
        if a.layout.is_replicated:
            continue
        if a.layout.is_flat:
            if a.shape != shape:
                raise DslError(f"{op}: {_desc(a)} is sliced flat and would be broadcast to {list(shape)}")
            layouts.append(a.layout)
        elif a.layout.is_sliced:
            d = a.layout.dim + len(shape) - a.ndim  # the operand's sliced dim, in the result's dims
            if a.shape[a.layout.dim] != shape[d]:
                raise DslError(f"{op}: sliced dim {a.layout.dim} of {_desc(a)} would be broadcast; "
                               "a Sliced dim must match the result's size")
            layouts.append(Sliced(d))
        else:
            layouts.append(Local)
    if not layouts:
        return Replicated
    if len(set(layouts)) > 1:
        raise DslError(f"{op}: operands {', '.join(_desc(a) for a in args)} mix layouts "
                       f"{sorted(map(str, set(layouts)))}; "
                       "a Local tensor cannot meet a Sliced one (reduce_scatter or all_gather first), "
                       "and Sliced operands must be sliced along the same dim")
    if layouts[0].is_flat:
        for a in args:
            if a.ndim and a.shape != shape:
                raise DslError(f"{op}: {_desc(a)} would be broadcast against a tensor sliced flat; a flat slice "
                               f"holds a run of elements, so every tensor operand needs the full shape {list(shape)}")
    return layouts[0]


def _elementwise(op: str, *operands: Any, dtype: torch.dtype | None = None, **attrs: Any) -> Node:
    args = _lift(op, operands)
    try:
        shape = tuple(torch.broadcast_shapes(*(a.shape for a in args)))
    except RuntimeError:
        raise DslError(f"{op}: shapes of {', '.join(_desc(a) for a in args)} do not broadcast") from None
    if dtype is None:
        ranked = {a.dtype for a in args if a.ndim > 0}
        pool = ranked or {a.dtype for a in args}
        if len(pool) > 1:
            raise DslError(f"{op}: operands {', '.join(_desc(a) for a in args)} have different dtypes "
                           f"{sorted(map(str, pool))}; insert cast(x, dtype) to make them equal")
        dtype = pool.pop()
    return _node(op, args, shape, dtype, _broadcast_layout(op, args, shape), **attrs)


def _float_operands(op: str, args: tuple[Node, ...]) -> None:
    for a in args:
        if a.dtype is torch.bool:
            raise DslError(f"{op}: operand {_desc(a)} is boolean; arithmetic needs float tensors (use where)")


def _arith(op: str):
    def build(a: Any, b: Any) -> Node:
        _float_operands(op, _lift(op, (a, b)))
        return _elementwise(op, a, b)

    build.__name__ = op
    build.__doc__ = f"Elementwise {op} with broadcasting; Python numbers become constants."
    return build


def _unary(op: str):
    def build(x: Node) -> Node:
        node = _elementwise(op, x)
        _float_operands(op, node.args)
        return node

    build.__name__ = op
    build.__doc__ = f"Elementwise {op}."
    return build


def _compare(op: str):
    def build(a: Any, b: Any) -> Node:
        _float_operands(op, _lift(op, (a, b)))
        node = _elementwise(op, a, b)
        return _node(op, node.args, node.shape, torch.bool, node.layout)

    build.__name__ = op
    build.__doc__ = f"Elementwise comparison {op}, a boolean tensor for `where`."
    return build


add, sub, mul, div, pow, maximum, minimum = (_arith(o) for o in ("add", "sub", "mul", "div", "pow", "maximum",
                                                                   "minimum"))
neg, abs, sqrt, rsqrt, exp, log = (_unary(o) for o in ("neg", "abs", "sqrt", "rsqrt", "exp", "log"))
lt, le, gt, ge, eq, ne = (_compare(o) for o in COMPARISONS)


def where(cond: Node, a: Any, b: Any) -> Node:
    """Elementwise if-then-else (CoCoNeT's Ite): a where cond is true, else b."""
    if not isinstance(cond, Node) or cond.dtype is not torch.bool:
        raise DslError(f"where: cond must be a boolean tensor (a comparison), got {_desc(cond)}")
    if not any(isinstance(x, Node) for x in (a, b)):
        a = const(a) if isinstance(a, (int, float)) else a  # two numbers: a float32 choice
    ab = _lift("where", (a, b))
    return _elementwise("where", cond, *ab, dtype=_elementwise("where", *ab).dtype)


def cast(x: Node, dtype: torch.dtype) -> Node:
    if dtype not in FLOAT_DTYPES:
        raise DslError(f"cast: dtype {dtype} is not supported; expected one of {list(FLOAT_DTYPES)}")
    return _elementwise("cast", x, dtype=dtype, to=dtype)


def dropout(x: Node, p: float, seed: int) -> Node:
    """Zero each element with probability p and scale the rest by 1/(1-p). Deterministic given seed (and the rank,
    for a Local tensor); a Sliced tensor draws the mask of the whole tensor, so slicing does not change results."""
    if not 0.0 <= p < 1.0:
        raise DslError(f"dropout: p must be in [0, 1), got {p}")
    if not isinstance(seed, int) or seed < 0:
        raise DslError(f"dropout: seed must be a non-negative int, got {seed!r}")
    _float_operands("dropout", (x,))
    return _elementwise("dropout", x, p=float(p), seed=seed)


# ---- other compute --------------------------------------------------------------------------------------------
def matmul(a: Node, b: Node) -> Node:
    """a (..., m, k) @ b (k, n). Layouts: S[k] x S[0] -> L (partial sums), R x S[1] -> S[last],
    S[d] x R -> S[d] for a non-contracted d, R x R -> R, L with L/R -> L."""
    if not (isinstance(a, Node) and isinstance(b, Node)):
        raise DslError(f"matmul: operands must be DSL tensors, got {a!r}, {b!r}")
    if a.ndim < 2 or b.ndim != 2 or a.shape[-1] != b.shape[0]:
        raise DslError(f"matmul: expected a (..., m, k) and b (k, n), got {_desc(a)} and {_desc(b)}")
    if a.dtype != b.dtype:
        raise DslError(f"matmul: dtypes differ ({_desc(a)}, {_desc(b)}); cast one of them")
    shape = (*a.shape[:-1], b.shape[1])
    la, lb, kdim = a.layout, b.layout, a.ndim - 1
    if la.is_flat or lb.is_flat:
        raise DslError(f"matmul: {_desc(a if la.is_flat else b)} is sliced flat; a matmul needs whole rows or "
                       "columns (slice along a dim, or all_gather first)")
    if la.is_sliced and lb.is_sliced:
        layout = Local if (la.dim == kdim and lb.dim == 0) else None
    elif la.is_sliced and lb.is_replicated:
        layout = Sliced(la.dim) if la.dim != kdim else None
    elif la.is_replicated and lb.is_sliced:
        layout = Sliced(a.ndim - 1) if lb.dim == 1 else None
    elif la.is_local and lb.is_sliced or la.is_sliced and lb.is_local:
        layout = None
    elif la.is_local or lb.is_local:
        layout = Local
    else:
        layout = Replicated
    if layout is None:
        raise DslError(f"matmul: layouts {la} x {lb} of {_desc(a)} and {_desc(b)} are not supported; expected "
                       f"S[{kdim}] x S[0], R x S[1], S[d] x R (d < {kdim}), or Local/Replicated operands")
    return _node("matmul", (a, b), shape, a.dtype, layout)


def _to_scalar_layout(x: Node) -> Layout:
    return Local if x.layout.is_local else Replicated


def norm(x: Node) -> Node:
    """Global L2 norm to a scalar: over the whole tensor for Sliced inputs (correct across ranks)."""
    _float_operands("norm", (x,))
    return _node("norm", (x,), (), x.dtype, _to_scalar_layout(x))


def segment_norm(x: Node, sizes: Any) -> Node:
    """Per-segment L2 norms, broadcast back: x (1-D) is cut into consecutive segments of `sizes` elements (e.g. the
    parameter tensors of a flat buffer) and each element becomes the norm of its segment. Same shape and layout as
    x; over the whole tensor for Sliced x (a segment may span ranks). LAMB's per-tensor trust ratio reads it."""
    _need("segment_norm", x, "a 1-D tensor", isinstance(x, Node) and x.ndim == 1)
    try:
        sizes = tuple(int(n) for n in sizes)
    except (TypeError, ValueError):
        raise DslError(f"segment_norm: sizes must be a sequence of integers, got {sizes!r:.80}") from None
    if not sizes or min(sizes) < 1 or sum(sizes) != x.shape[0]:
        raise DslError(f"segment_norm: sizes must be positive and add up to {x.shape[0]} (the length of "
                       f"{_desc(x)}), got {len(sizes)} sizes adding up to {sum(sizes)}")
    return _node("segment_norm", (x,), x.shape, x.dtype, x.layout, sizes=sizes)


def reduce_tensor(x: Node, op: ReduceOp | str = ReduceOp.SUM) -> Node:
    """Reduce all elements of x to a scalar (sum/max/min/mean); over the whole tensor for Sliced inputs."""
    _float_operands("reduce_tensor", (x,))
    return _node("reduce_tensor", (x,), (), x.dtype, _to_scalar_layout(x), op=parse_reduce_op(op))


def update(state: Node, value: Any) -> Node:
    """Write `value` into the state tensor `state` (an input) when the program finishes (CoCoNeT's Update)."""
    if not isinstance(state, Node) or state.op != "input" or state.attr("kind") != "tensor":
        raise DslError(f"update: the state must be a Tensor input, got {_desc(state)}")
    if not isinstance(value, Node):
        value = _lift("update", (state, value))[1]  # a number becomes a constant of the state's dtype
    if value.shape != state.shape and value.ndim != 0:
        raise DslError(f"update: value {_desc(value)} does not have the shape of state {_desc(state)}")
    if value.dtype != state.dtype:
        raise DslError(f"update: value {_desc(value)} has dtype {value.dtype}, state {state.name!r} has "
                       f"{state.dtype}; cast the value")
    if not (value.layout == state.layout or value.layout.is_replicated):
        raise DslError(f"update: value {_desc(value)} has layout {value.layout}, state {state.name!r} is "
                       f"{state.layout}; they must match (or the value must be Replicated)")
    return _node("update", (state, value), state.shape, state.dtype, state.layout)


bind_operators(add=add, sub=sub, mul=mul, div=div, pow=pow, neg=neg, abs=abs, matmul=matmul, lt=lt, le=le, gt=gt,
               ge=ge)


# ---- communication --------------------------------------------------------------------------------------------
def _check_groups(op: str, groups: int) -> int:
    if not isinstance(groups, int) or groups < 1:
        raise DslError(f"{op}: groups must be a positive int (the world splits into that many equal groups), "
                       f"got {groups!r}")
    return groups


def _need(op: str, x: Node, what: str, ok: bool) -> None:
    if not isinstance(x, Node):
        raise DslError(f"{op}: operand must be a DSL tensor, got {x!r}")
    if not ok:
        raise DslError(f"{op}: operand {_desc(x)} must be {what}")
    _float_operands(op, (x,))


def all_reduce(x: Node, op: ReduceOp | str = ReduceOp.SUM, *, groups: int = 1) -> Node:
    """Reduce a Local tensor over the ranks of the group; every rank gets the result (Replicated)."""
    _need("all_reduce", x, "Local", isinstance(x, Node) and x.layout.is_local)
    return _node("all_reduce", (x,), x.shape, x.dtype, Replicated, op=parse_reduce_op(op),
                 groups=_check_groups("all_reduce", groups))


def _slice_dim(op: str, x: Node, dim: int | str) -> Layout:
    if dim != FLAT and not (isinstance(dim, int) and 0 <= dim < x.ndim):
        raise DslError(f"{op}: dim {dim!r} out of range for {_desc(x)} (expected 0..{x.ndim - 1} or {FLAT!r})")
    return _flat_1d(Sliced(dim), x.ndim)


def reduce_scatter(x: Node, op: ReduceOp | str = ReduceOp.SUM, *, dim: int | str = 0, groups: int = 1) -> Node:
    """Reduce a Local tensor over the ranks; rank i keeps the i-th slice along dim (Sliced(dim); FLAT: the i-th
    run of its elements)."""
    _need("reduce_scatter", x, "Local", isinstance(x, Node) and x.layout.is_local)
    return _node("reduce_scatter", (x,), x.shape, x.dtype, _slice_dim("reduce_scatter", x, dim),
                 op=parse_reduce_op(op),
                 groups=_check_groups("reduce_scatter", groups))


def all_gather(x: Node, *, groups: int = 1) -> Node:
    """Concatenate the slices of a Sliced tensor on every rank (Replicated)."""
    _need("all_gather", x, "Sliced", isinstance(x, Node) and x.layout.is_sliced)
    return _node("all_gather", (x,), x.shape, x.dtype, Replicated, groups=_check_groups("all_gather", groups))


def broadcast(x: Node, root: int = 0, *, groups: int = 1) -> Node:
    """The root's value of a Local tensor, on every rank of the group (Replicated). root is a rank within the group."""
    _need("broadcast", x, "Local", isinstance(x, Node) and x.layout.is_local)
    if not isinstance(root, int) or root < 0:
        raise DslError(f"broadcast: root must be a rank index >= 0, got {root!r}")
    return _node("broadcast", (x,), x.shape, x.dtype, Replicated, root=root, groups=_check_groups("broadcast", groups))


def reduce(x: Node, op: ReduceOp | str = ReduceOp.SUM, root: int = 0, *, groups: int = 1) -> Node:
    """Reduce a Local tensor onto the root (rank within the group); other ranks keep their own value (Local)."""
    _need("reduce", x, "Local", isinstance(x, Node) and x.layout.is_local)
    if not isinstance(root, int) or root < 0:
        raise DslError(f"reduce: root must be a rank index >= 0, got {root!r}")
    return _node("reduce", (x,), x.shape, x.dtype, Local, op=parse_reduce_op(op), root=root,
                 groups=_check_groups("reduce", groups))


def scatter(x: Node, *, dim: int | str = 0, groups: int = 1) -> Node:
    """Keep this rank's slice of a Replicated tensor (no communication): Replicated -> Sliced(dim)."""
    _need("scatter", x, "Replicated", isinstance(x, Node) and x.layout.is_replicated)
    return _node("scatter", (x,), x.shape, x.dtype, _slice_dim("scatter", x, dim),
                 groups=_check_groups("scatter", groups))


def send(x: Node, *, groups: int) -> Node:
    """Point-to-point between consecutive groups (pipeline stages): the world splits into `groups` groups of G ranks;
    rank r sends x to rank r + G and the result is what rank r received from rank r - G (zeros on the first group).
    The layout is kept: a Sliced tensor sends only each rank's slice. groups = world size sends rank to rank."""
    _need("send", x, "a tensor", isinstance(x, Node))
    if _check_groups("send", groups) < 2:
        raise DslError(f"send: needs groups >= 2 (a sender group and a receiver group), got groups={groups}")
    return _node("send", (x,), x.shape, x.dtype, x.layout, groups=groups)


PUBLIC = ["Tensor", "Scalar", "const", "add", "sub", "mul", "div", "pow", "maximum", "minimum", "neg", "abs", "sqrt",
          "rsqrt", "exp", "log", "lt", "le", "gt", "ge", "eq", "ne", "where", "cast", "dropout", "matmul", "norm",
          "segment_norm", "reduce_tensor", "update", "all_reduce", "reduce_scatter", "all_gather", "broadcast",
          "reduce", "scatter",
          "send"]
