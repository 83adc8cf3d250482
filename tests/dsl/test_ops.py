"""Shape, dtype and layout inference, and the errors for ill-typed programs."""

import pytest
import torch

import cocosync as cs
from cocosync import DslError, Local, Replicated, Sliced, bfloat16, float32


def T(name, shape=(8, 4), layout=Replicated, dtype=float32):
    return cs.Tensor(name, shape, dtype, layout)


@pytest.mark.parametrize("la, lb, want", [
    (Local, Local, "L"), (Replicated, Replicated, "R"), (Local, Replicated, "L"), (Replicated, Local, "L"),
    (Sliced(0), Sliced(0), "S[0]"), (Sliced(1), Replicated, "S[1]"), (Replicated, Sliced(0), "S[0]"),
])
def test_elementwise_layout_rules(la, lb, want):
    assert str((T("a", layout=la) + T("b", layout=lb)).layout) == want


@pytest.mark.parametrize("la, lb", [(Local, Sliced(0)), (Sliced(0), Local), (Sliced(0), Sliced(1))])
def test_elementwise_layout_mismatch_names_operands(la, lb):
    with pytest.raises(DslError, match=r"add: operands a: f32\[8, 4\] .*b: f32\[8, 4\] .*mix layouts"):
        T("a", layout=la) + T("b", layout=lb)


def test_broadcast_shapes_and_scalars():
    x = T("x", (8, 4), Sliced(0)) * T("bias", (4,)) + 1.0
    assert x.shape == (8, 4) and str(x.layout) == "S[0]" and x.dtype == float32
    y = T("y", (8, 4), Sliced(1)) + T("col", (8, 1))
    assert str(y.layout) == "S[1]"
    with pytest.raises(DslError, match="do not broadcast"):
        T("a", (8, 4)) + T("b", (3,))
    with pytest.raises(DslError, match="sliced dim 0 of v: f32\\[1, 4\\] S\\[0\\] would be broadcast"):
        T("v", (1, 4), Sliced(0)) + T("w", (8, 4))


def test_dtype_rules():
    a, b = T("a"), T("b", dtype=bfloat16)
    with pytest.raises(DslError, match="different dtypes.*cast"):
        a + b
    assert (cs.cast(b, float32) + a).dtype == float32
    assert (b * cs.Scalar("lr")).dtype == bfloat16  # a 0-dim operand takes the tensor's dtype
    assert (a > 0).dtype == torch.bool
    with pytest.raises(DslError, match="boolean"):
        (a > 0) + a
    with pytest.raises(DslError, match="cond must be a boolean"):
        cs.where(a, a, a)


@pytest.mark.parametrize("la, lb, want", [
    (Sliced(1), Sliced(0), "L"), (Replicated, Sliced(1), "S[1]"), (Sliced(0), Replicated, "S[0]"),
    (Replicated, Replicated, "R"), (Local, Replicated, "L"), (Local, Local, "L"),
])
def test_matmul_layout_rules(la, lb, want):
    out = T("a", (4, 8), la) @ T("b", (8, 6), lb)
    assert out.shape == (4, 6) and str(out.layout) == want


@pytest.mark.parametrize("la, lb", [(Sliced(0), Sliced(0)), (Replicated, Sliced(0)), (Sliced(1), Replicated),
                                    (Local, Sliced(1))])
def test_matmul_layout_errors(la, lb):
    with pytest.raises(DslError, match="matmul: layouts"):
        T("a", (4, 8), la) @ T("b", (8, 6), lb)


def test_matmul_shape_error():
    with pytest.raises(DslError, match=r"expected a \(\.\.\., m, k\) and b \(k, n\), got a: f32\[4, 8\] R and b"):
        T("a", (4, 8)) @ T("b", (4, 8))


def test_collective_layout_rules():
    g = T("g", layout=Local)
    assert str(cs.all_reduce(g).layout) == "R"
    assert str(cs.reduce_scatter(g, dim=1).layout) == "S[1]"
    assert str(cs.all_gather(cs.reduce_scatter(g)).layout) == "R"
    assert str(cs.broadcast(g, 1).layout) == "R"
    assert str(cs.reduce(g, "max", 0).layout) == "L"
    assert str(cs.scatter(T("r")).layout) == "S[0]"
    assert str(cs.send(T("s", layout=Sliced(0)), groups=2).layout) == "S[0]"
    assert str(cs.norm(T("s", layout=Sliced(0))).layout) == "R" and cs.norm(g).layout.is_local


@pytest.mark.parametrize("build, msg", [
    (lambda: cs.all_reduce(T("r")), "all_reduce: operand r: f32\\[8, 4\\] R must be Local"),
    (lambda: cs.reduce_scatter(T("s", layout=Sliced(0))), "reduce_scatter: operand s: .* must be Local"),
    (lambda: cs.all_gather(T("l", layout=Local)), "all_gather: operand l: .* must be Sliced"),
    (lambda: cs.scatter(T("l", layout=Local)), "scatter: operand l: .* must be Replicated"),
    (lambda: cs.all_reduce(T("l", layout=Local), "prod"), "unknown reduce op 'prod'"),
    (lambda: cs.reduce_scatter(T("l", layout=Local), dim=2), "dim 2 out of range"),
    (lambda: cs.send(T("x"), groups=1), "send: needs groups >= 2"),
    (lambda: cs.all_reduce(T("l", layout=Local), groups=0), "groups must be a positive int"),
    (lambda: cs.dropout(T("x"), 1.0, 0), "p must be in \\[0, 1\\)"),
    (lambda: cs.Tensor("x", (4,), torch.float64), "dtype torch.float64 is not supported"),
    (lambda: cs.Tensor("x", (4, 0)), "shape must be positive ints"),
    (lambda: cs.Tensor("x", (4,), float32, Sliced(1)), "S\\[1\\] needs a tensor with more than 1 dims"),
    (lambda: cs.update(T("x") + 1, T("y")), "the state must be a Tensor input"),
    (lambda: cs.update(T("x"), T("y", (4,))), "does not have the shape of state"),
    (lambda: cs.update(T("x", layout=Sliced(0)), T("y", layout=Local)), "layout L, state 'x' is S\\[0\\]"),
])
def test_construction_errors(build, msg):
    with pytest.raises(DslError, match=msg):
        build()


def test_program_checks():
    x, y = T("x", layout=Local), T("y")
    with pytest.raises(DslError, match="reads 'y', which is not in the program's inputs"):
        cs.Program("p", [x], [x + y])
    with pytest.raises(DslError, match="state 'y' is updated twice"):
        cs.Program("p", [y], [cs.update(y, y + 1), cs.update(y, y * 2)])
    with pytest.raises(DslError, match="different groups= values"):
        cs.Program("p", [x], [cs.all_reduce(x, groups=2) + cs.all_reduce(x)])
    with pytest.raises(DslError, match="two different values are named 'x'"):
        cs.Program("p", [x, T("x")], [x])


def test_listing_and_names():
    g, w, lr = T("g", (8,), Local), T("w", (8,)), cs.Scalar("lr")
    s = cs.all_reduce(g, "mean")
    p = cs.Program("sgd", [g, w, lr], [cs.update(w, w - lr * s)])
    assert str(p) == (
        "program sgd(g: f32[8] L, w: f32[8] R, lr: f32 R)\n"
        "  all_reduce1 = all_reduce(g, mean)  : f32[8] R\n"
        "  mul1        = lr * all_reduce1     : f32[8] R\n"
        "  sub1        = w - mul1             : f32[8] R\n"
        "  w_new       = update(w, sub1)      : f32[8] R\n"
        "  return w=w_new")
    assert p.stage(s).name == "all_reduce1" and p.stage("mul1").op == "mul"
    with pytest.raises(DslError, match="no stage named 'nope'"):
        p.stage("nope")


@pytest.mark.parametrize("build, msg", [
    (lambda: cs.segment_norm(T("m"), (16, 16)), "segment_norm: operand m: f32\\[8, 4\\] R must be a 1-D tensor"),
    (lambda: cs.segment_norm(T("v", (10,)), (4, 5)), "add up to 10 .* 2 sizes adding up to 9"),
    (lambda: cs.segment_norm(T("v", (10,)), (12, -2)), "must be positive"),
    (lambda: cs.segment_norm(T("v", (10,)), "ab"), "sizes must be a sequence of integers"),
])
def test_segment_norm_errors(build, msg):
    with pytest.raises(DslError, match=msg):
        build()


def test_segment_norm_keeps_shape_and_layout_and_equals_per_segment_norms():
    v = T("v", (10,), layout=Sliced(0))
    s = cs.segment_norm(v, (3, 7))
    assert s.shape == (10,) and str(s.layout) == "S[0]" and "sizes=(3, 7)" in str(cs.Program("p", [v], [s]))
    x, xin = torch.arange(10.0), T("x", (10,))
    out = cs.interpret(cs.Program("p", [xin], [cs.segment_norm(xin, (3, 7))]), 1, {"x": x})[0]
    want = torch.cat([x[:3].norm().expand(3), x[3:].norm().expand(7)])
    torch.testing.assert_close(next(iter(out.values())), want)
