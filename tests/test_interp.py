"""The oracle against hand-computed expectations, for every op and layout."""

import pytest
import torch

import cocosync as cs
from cocosync import DslError, Local, Replicated, Sliced, bfloat16, float32

t = lambda *v: torch.tensor(v, dtype=float32)  # noqa: E731


def run(outputs, inputs, P=2, decl=None):
    return cs.interpret(cs.Program("p", decl, outputs), P, inputs)


def test_collectives_on_two_ranks():
    x = cs.Tensor("x", (4,), float32, Local)
    outs = {"sum": cs.all_reduce(x), "max": cs.all_reduce(x, "max"), "min": cs.all_reduce(x, "min"),
            "mean": cs.all_reduce(x, "mean"), "rs": cs.reduce_scatter(x), "ag": cs.all_gather(cs.reduce_scatter(x)),
            "bc": cs.broadcast(x, 1), "red": cs.reduce(x, "sum", 0)}
    r0, r1 = t(1, 2, 3, 4), t(10, -20, 30, -40)
    out = run(outs, {"x": [r0, r1]}, decl=[x])
    for r in range(2):
        assert torch.equal(out[r]["sum"], t(11, -18, 33, -36))
        assert torch.equal(out[r]["max"], t(10, 2, 30, 4))
        assert torch.equal(out[r]["min"], t(1, -20, 3, -40))
        assert torch.equal(out[r]["mean"], t(5.5, -9, 16.5, -18))
        assert torch.equal(out[r]["ag"], t(11, -18, 33, -36))
        assert torch.equal(out[r]["bc"], r1)
    assert torch.equal(out[0]["rs"], t(11, -18)) and torch.equal(out[1]["rs"], t(33, -36))
    assert torch.equal(out[0]["red"], t(11, -18, 33, -36)) and torch.equal(out[1]["red"], r1)


def test_scatter_and_sliced_dims():
    r = cs.Tensor("r", (2, 4), float32, Replicated)
    out = run({"s0": cs.scatter(r), "s1": cs.scatter(r, dim=1)}, {"r": torch.arange(8.0).reshape(2, 4)}, decl=[r])
    assert torch.equal(out[0]["s0"], t(0, 1, 2, 3)[None]) and torch.equal(out[1]["s0"], t(4, 5, 6, 7)[None])
    assert torch.equal(out[1]["s1"], torch.tensor([[2.0, 3], [6, 7]]))


def test_elementwise_replicated_meets_sliced():
    s = cs.Tensor("s", (4,), float32, Sliced(0))
    r = cs.Tensor("r", (4,), float32, Replicated)
    out = run({"y": s * r + 1}, {"s": t(1, 2, 3, 4), "r": t(10, 20, 30, 40)}, decl=[s, r])
    assert torch.equal(out[0]["y"], t(11, 41)) and torch.equal(out[1]["y"], t(91, 161))


def test_unary_and_where():
    x = cs.Tensor("x", (3,), float32, Replicated)
    outs = {"sqrt": cs.sqrt(x), "rsqrt": cs.rsqrt(x), "exp": cs.exp(x * 0), "log": cs.log(x), "abs": abs(-x),
            "pow": x ** 2, "w": cs.where(x > 2, x, -1.0), "mx": cs.maximum(x, 2.0), "mn": cs.minimum(x, 2.0)}
    out = run(outs, {"x": t(1, 4, 16)}, decl=[x])[1]
    assert torch.equal(out["sqrt"], t(1, 2, 4)) and torch.equal(out["rsqrt"], t(1, 0.5, 0.25))
    assert torch.equal(out["exp"], t(1, 1, 1)) and torch.allclose(out["log"], t(0, 1.3862944, 2.7725887))
    assert torch.equal(out["abs"], t(1, 4, 16)) and torch.equal(out["pow"], t(1, 16, 256))
    assert torch.equal(out["w"], t(-1, 4, 16)) and torch.equal(out["mx"], t(2, 4, 16))
    assert torch.equal(out["mn"], t(1, 2, 2))


def test_matmul_sliced_contraction_gives_partial_sums():
    a = cs.Tensor("a", (1, 4), float32, Sliced(1))
    b = cs.Tensor("b", (4, 1), float32, Sliced(0))
    y = a @ b
    out = run({"y": y, "z": cs.all_reduce(y)}, {"a": t(1, 2, 3, 4)[None], "b": t(1, 1, 1, 1)[:, None]}, decl=[a, b])
    assert out[0]["y"].item() == 3 and out[1]["y"].item() == 7 and out[0]["z"].item() == 10


def test_norm_and_reduce_tensor_of_sliced_are_global():
    s = cs.Tensor("s", (4,), float32, Sliced(0))
    loc = cs.Tensor("l", (2,), float32, Local)
    outs = {"n": cs.norm(s), "sum": cs.reduce_tensor(s), "max": cs.reduce_tensor(s, "max"),
            "mean": cs.reduce_tensor(s, "mean"), "nl": cs.norm(loc)}
    out = run(outs, {"s": t(1, 2, 2, 4), "l": [t(3, 4), t(0, 1)]}, decl=[s, loc])
    for r in range(2):
        assert out[r]["n"].item() == 5 and out[r]["sum"].item() == 9 and out[r]["max"].item() == 4
        assert out[r]["mean"].item() == 2.25
    assert out[0]["nl"].item() == 5 and out[1]["nl"].item() == 1


def test_update_and_chained_reads():
    w = cs.Tensor("w", (2,), float32, Replicated)
    w1 = cs.update(w, w * 2)
    out = run([w1, w1 + w], {"w": t(1, 2)}, decl=[w])[0]
    assert torch.equal(out["w"], t(2, 4)) and torch.equal(out["add1"], t(3, 6))  # other reads see the old w


def test_dropout_is_deterministic_and_scaled():
    x = cs.Tensor("x", (1000,), float32, Replicated)
    xl = cs.Tensor("xl", (1000,), float32, Local)
    outs = {"d": cs.dropout(x, 0.5, seed=3), "dl": cs.dropout(xl, 0.5, seed=3)}
    ones = torch.ones(1000)
    a = run(outs, {"x": ones, "xl": ones}, decl=[x, xl])
    b = run(outs, {"x": ones, "xl": ones}, decl=[x, xl])
    assert torch.equal(a[0]["d"], b[0]["d"]) and torch.equal(a[0]["d"], a[1]["d"])  # Replicated: same everywhere
    assert not torch.equal(a[0]["dl"], a[1]["dl"])  # Local: depends on the rank
    assert set(a[0]["d"].unique().tolist()) == {0.0, 2.0} and 400 < (a[0]["d"] == 0).sum() < 600


def test_send_between_groups():
    x = cs.Tensor("x", (2,), float32, Local)
    out = run({"y": cs.send(x, groups=2)}, {"x": [t(1, 1), t(2, 2), t(3, 3), t(4, 4)]}, P=4, decl=[x])
    assert [o["y"].tolist() for o in out] == [[0, 0], [0, 0], [1, 1], [2, 2]]


def test_low_precision_reduction_accumulates_in_float32():
    x = cs.Tensor("x", (1,), bfloat16, Local)
    big, small = torch.tensor([256.0], dtype=bfloat16), torch.tensor([1.0], dtype=bfloat16)
    out = run({"s": cs.all_reduce(x)}, {"x": [big, small, small, big * 0 + small]}, P=4, decl=[x])
    assert out[0]["s"].item() == 260.0  # bf16 pairwise would lose the ones: 256+1 rounds to 256


def test_input_errors():
    x = cs.Tensor("x", (4,), float32, Local)
    p = cs.Program("p", [x], [cs.all_reduce(x)])
    with pytest.raises(DslError, match="missing inputs \\['x'\\]"):
        cs.interpret(p, 2, {})
    with pytest.raises(DslError, match="pass one tensor per rank \\(2\\), got 3"):
        cs.interpret(p, 2, {"x": [torch.zeros(4)] * 3})
    with pytest.raises(DslError, match="expected shape \\(4,\\) dtype torch.float32, got shape \\(5,\\)"):
        cs.interpret(p, 2, {"x": torch.zeros(5)})
    s = cs.Tensor("s", (6,), float32, Sliced(0))
    with pytest.raises(DslError, match="cannot be sliced into 4 equal parts"):
        cs.interpret(cs.Program("q", [s], [s * 2]), 4, {"s": torch.zeros(6)})
