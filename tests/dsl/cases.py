"""A catalog of small programs covering every op and layout, with deterministic inputs.

Each case is `name -> builder(world_size) -> (program, global inputs)`. Builders are importable by spawned ranks,
so the executor can rebuild the same program and inputs on every rank and compare with the interpreter.
"""

from __future__ import annotations

import torch

import cocosync as cs
from cocosync import Local, Replicated, Sliced, bfloat16, float16, float32

N = 8  # divisible by every world size tested (2, 4)


def _rand(shape, seed, dtype=float32, positive=False):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return (t.abs() + 0.5 if positive else t).to(dtype)


def _locals(P, shape, seed, dtype=float32, positive=False):
    return [_rand(shape, seed + 101 * r, dtype, positive) for r in range(P)]


def _elementwise(layout_a, layout_b, P):
    """Every elementwise op on operands of the two layouts (Local and Sliced never meet)."""
    a = cs.Tensor("a", (N, 4), float32, layout_a)
    b = cs.Tensor("b", (N, 4), float32, layout_b)
    s = cs.Scalar("s")
    pos = cs.abs(a) + 0.5
    outs = {
        "add": a + b, "sub": a - b, "mul": a * b, "div": a / (cs.abs(b) + 1), "pow": pos ** 2.0,
        "max": cs.maximum(a, b), "min": cs.minimum(a, b), "neg": -a, "sqrt": cs.sqrt(pos), "rsqrt": cs.rsqrt(pos),
        "exp": cs.exp(a), "log": cs.log(pos), "scal": s * a + 1.5, "rsub": 2 - b / 4,
        "where": cs.where(a > b, a, b * 2), "where2": cs.where(cs.le(a, 0.1), 0.0, b),
        "cmp": cs.where(cs.eq(a, a) , 1.0, 0.0) + cs.where(cs.ne(a, b), 1.0, 0.0) + cs.where(a >= b, 1.0, 0.0)
        + cs.where(a < 0, 1.0, 0.0),
        "cast": cs.cast(cs.cast(a, bfloat16), float32),
    }
    inputs = {"s": 0.75}
    for name, lay, seed in (("a", layout_a, 1), ("b", layout_b, 2)):
        inputs[name] = _locals(P, (N, 4), seed) if lay.is_local else _rand((N, 4), seed)
    return cs.Program("elementwise", [a, b, s], outs), inputs


def _broadcasting(P):
    """A Replicated bias broadcast against Sliced(0) and Sliced(1) tensors (sliced dim aligned or broadcast)."""
    x0 = cs.Tensor("x0", (N, 8), float32, Sliced(0))
    x1 = cs.Tensor("x1", (N, 8), float32, Sliced(1))
    bias = cs.Tensor("bias", (8,), float32, Replicated)
    col = cs.Tensor("col", (N, 1), float32, Replicated)
    outs = {"r0": x0 + bias, "r1": x1 * bias, "c1": x1 - col, "c0": x0 * col}
    inputs = {"x0": _rand((N, 8), 3), "x1": _rand((N, 8), 4), "bias": _rand((8,), 5), "col": _rand((N, 1), 6)}
    return cs.Program("broadcasting", [x0, x1, bias, col], outs), inputs


def _dropout(P):
    xl = cs.Tensor("xl", (N, 4), float32, Local)
    xr = cs.Tensor("xr", (N, 4), float32, Replicated)
    xs = cs.Tensor("xs", (N, 4), float32, Sliced(1))
    outs = {"dl": cs.dropout(xl, 0.5, 7), "dr": cs.dropout(xr, 0.25, 8), "ds": cs.dropout(xs, 0.5, 9)}
    inputs = {"xl": _locals(P, (N, 4), 10), "xr": _rand((N, 4), 11), "xs": _rand((N, 4), 12)}
    return cs.Program("dropout", [xl, xr, xs], outs), inputs


def _matmul(P):
    a_k = cs.Tensor("a_k", (4, N), float32, Sliced(1))
    b_k = cs.Tensor("b_k", (N, 4), float32, Sliced(0))
    a_r = cs.Tensor("a_r", (4, N), float32, Replicated)
    b_n = cs.Tensor("b_n", (N, N), float32, Sliced(1))
    a_m = cs.Tensor("a_m", (2, N, N), float32, Sliced(1))
    a_l = cs.Tensor("a_l", (4, N), float32, Local)
    b_r = cs.Tensor("b_r", (N, N), float32, Replicated)
    outs = {"ss": a_k @ b_k, "rs": a_r @ b_n, "sr": cs.matmul(a_m, b_r), "rr": a_r @ b_r, "lr": a_l @ b_r,
            "ll": a_l @ cs.cast(cs.cast(b_r, float32), float32)}
    inputs = {"a_k": _rand((4, N), 20), "b_k": _rand((N, 4), 21), "a_r": _rand((4, N), 22), "b_n": _rand((N, N), 23),
              "a_m": _rand((2, N, N), 24), "a_l": _locals(P, (4, N), 25), "b_r": _rand((N, N), 26)}
    return cs.Program("matmul", [a_k, b_k, a_r, b_n, a_m, a_l, b_r], outs), inputs


def _reductions(P):
    xl = cs.Tensor("xl", (N, 4), float32, Local)
    xr = cs.Tensor("xr", (N, 4), float32, Replicated)
    xs = cs.Tensor("xs", (N, 4), float32, Sliced(0))
    outs = {}
    for nm, x in (("l", xl), ("r", xr), ("s", xs)):
        outs[f"norm_{nm}"] = cs.norm(x)
        for op in ("sum", "max", "min", "mean"):
            outs[f"{op}_{nm}"] = cs.reduce_tensor(x, op)
    outs["scaled"] = xs / cs.norm(xs)  # a Replicated scalar meets a Sliced tensor
    inputs = {"xl": _locals(P, (N, 4), 30), "xr": _rand((N, 4), 31), "xs": _rand((N, 4), 32)}
    return cs.Program("reductions", [xl, xr, xs], outs), inputs


def _updates(P):
    sl = cs.Tensor("sl", (N,), float32, Local)
    sr = cs.Tensor("sr", (N,), float32, Replicated)
    ss = cs.Tensor("ss", (N, 4), float32, Sliced(1))
    full = cs.Tensor("full", (N, 4), float32, Replicated)
    u_ss = cs.update(ss, ss * 2 + full)
    outs = [cs.update(sl, sl + sr), cs.update(sr, 0.0), u_ss, cs.update(full, full + 1)]
    outs.append(cs.all_gather(u_ss))  # a later stage reads the updated value
    inputs = {"sl": _locals(P, (N,), 40), "sr": _rand((N,), 41), "ss": _rand((N, 4), 42), "full": _rand((N, 4), 43)}
    return cs.Program("updates", [sl, sr, ss, full], outs), inputs


def _collectives(dtype):
    def build(P):
        x = cs.Tensor("x", (N, 4), dtype, Local)
        y = cs.Tensor("y", (N, 4), dtype, Sliced(1))
        r = cs.Tensor("r", (N, 4), dtype, Replicated)
        outs = {f"ar_{op}": cs.all_reduce(x, op) for op in ("sum", "max", "min", "mean")}
        outs |= {"rs0": cs.reduce_scatter(x), "rs1_mean": cs.reduce_scatter(x, "mean", dim=1),
                 "ag1": cs.all_gather(y), "ag0": cs.all_gather(cs.reduce_scatter(x, "max")),
                 "bc": cs.broadcast(x, root=1), "red": cs.reduce(x, "sum", root=1),
                 "red_max": cs.reduce(x, "max", root=0), "sc": cs.scatter(r), "sc1": cs.scatter(r, dim=1)}
        inputs = {"x": _locals(P, (N, 4), 50, dtype), "y": _rand((N, 4), 51, dtype), "r": _rand((N, 4), 52, dtype)}
        return cs.Program(f"collectives_{dtype}".replace("torch.", ""), [x, y, r], outs), inputs
    return build


def _groups(P):
    """Two groups (pipeline stages): collectives within each group, send from group 0 to group 1."""
    x = cs.Tensor("x", (N, 4), float32, Local)
    y = cs.Tensor("y", (N, 4), float32, Sliced(0))
    ar = cs.all_reduce(x, groups=2)
    rs = cs.reduce_scatter(x, groups=2)
    outs = {"ar": ar, "send_r": cs.send(ar, groups=2), "send_l": cs.send(x * 2, groups=2),
            "pipe": cs.all_gather(cs.send(rs, groups=2), groups=2), "ag": cs.all_gather(y, groups=2),
            "bc": cs.broadcast(x, 1 if P >= 4 else 0, groups=2)}
    inputs = {"x": _locals(P, (N, 4), 60), "y": _rand((N, 4), 61)}
    return cs.Program("groups", [x, y], outs), inputs


CASES = {
    "ew_LL": lambda P: _elementwise(Local, Local, P),
    "ew_RR": lambda P: _elementwise(Replicated, Replicated, P),
    "ew_SS": lambda P: _elementwise(Sliced(0), Sliced(0), P),
    "ew_S1S1": lambda P: _elementwise(Sliced(1), Sliced(1), P),
    "ew_LR": lambda P: _elementwise(Local, Replicated, P),
    "ew_RS": lambda P: _elementwise(Replicated, Sliced(0), P),
    "ew_S1R": lambda P: _elementwise(Sliced(1), Replicated, P),
    "broadcasting": _broadcasting,
    "dropout": _dropout,
    "matmul": _matmul,
    "reductions": _reductions,
    "updates": _updates,
    "coll_f32": _collectives(float32),
    "coll_bf16": _collectives(bfloat16),
    "coll_f16": _collectives(float16),
    "groups": _groups,
}

#: tolerance per case: low precision collectives may round differently when the summation order differs
TOL = {"coll_bf16": 2e-2, "coll_f16": 2e-3}


def run_cases_on_rank(names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Runs on a real rank: build each case, compile it, feed this rank's part of the inputs."""
    import torch.distributed as dist

    from cocosync.interp import rank_inputs

    P, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name in names:
        program, inputs = CASES[name](P)
        local = rank_inputs(program, P, inputs, rank)
        local = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in local.items()}
        out[name] = {k: v.clone() for k, v in cs.compile(program)(**local).items()}
    return out
