"""Fused elementwise kernels equal the interpreter; eager and Inductor backends agree."""

import pytest
import torch

import cocosync as cs
from cocosync.programs.optimizers import adam_program, adam_scalars
from cocosync.runtime.steps import codegen as kernels
from cocosync.runtime.steps.codegen import build_kernel, can_fuse


@pytest.fixture(autouse=True)
def always_compiled(monkeypatch):
    """Inductor kernels compile whatever the size here (they run their eager source below EAGER_WORK)."""
    monkeypatch.setattr(kernels, "EAGER_WORK", 0)


def _adam_update_kernel(backend):
    """The elementwise part of the Adam program (everything after the all_reduce), as one kernel."""
    p = adam_program(256)
    body = [s for s in p.stages if can_fuse(s)]
    outs = [p.updates[n] for n in ("w", "m", "v")]
    return p, build_kernel(body, outs, backend=backend, name="adam_update")


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_adam_kernel_matches_interpreter(backend):
    p, k = _adam_update_kernel(backend)
    gs = [torch.randn(256, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    inputs = {"g": gs, "w": torch.randn(256), "m": torch.rand(256), "v": torch.rand(256), **adam_scalars(3)}
    want = cs.interpret(p, 2, inputs)[0]
    env = {n: (torch.tensor(v) if isinstance(v, float) else v) for n, v in inputs.items() if n != "g"}
    env["all_reduce1"] = (gs[0] + gs[1]) / 2
    args = [env[a.name] for a in k.inputs]
    w, m, v = k(*args)
    torch.testing.assert_close(w, want["w"]), torch.testing.assert_close(m, want["m"])
    torch.testing.assert_close(v, want["v"])
    assert "ops['sqrt']" in k.source and k.source.count("\n") > 15
    if backend == "inductor":
        assert k.compile_seconds > 0
        k2 = _adam_update_kernel("inductor")[1]  # same computation: the compiled function is reused
        k2(*args)
        assert k2.compile_seconds == 0


def test_kernel_rejects_non_elementwise():
    x = cs.Tensor("x", (4,), cs.float32, cs.Local)
    p = cs.Program("p", [x], [cs.all_reduce(x) * 2])
    with pytest.raises(ValueError, match="not fusable elementwise ops"):
        build_kernel(p.stages, [p.outputs[0]], backend="eager")
    with pytest.raises(ValueError, match="kernel backend 'tvm'"):
        build_kernel(p.stages[1:], [p.outputs[0]], backend="tvm")


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_kernel_writes_into_chunk_views(backend):
    """The fused-collective form: outputs written in place into chunks (views) of larger state buffers."""
    a = cs.Tensor("a", (64,), cs.float32, cs.Sliced(0))
    b = cs.Tensor("b", (64,), cs.float32, cs.Sliced(0))
    s = a * 2 + b
    p = cs.Program("p", [a, b], [s, cs.sqrt(cs.abs(s))])
    k = build_kernel(p.stages, list(p.outputs), backend=backend, name="into", into=True)
    x, y = torch.randn(1000), torch.randn(1000)
    out0, out1 = torch.zeros(1000), torch.zeros(1000)
    for lo, hi in ((0, 256), (256, 512), (512, 1000)):  # equal chunks, then a longer tail
        assert k(x[lo:hi], y[lo:hi], out0[lo:hi], out1[lo:hi]) is None
    torch.testing.assert_close(out0, x * 2 + y)
    torch.testing.assert_close(out1, (x * 2 + y).abs().sqrt())


def test_kernel_with_constant_operands_of_maximum_and_minimum():
    x = cs.Tensor("x", (16,), cs.float32, cs.Replicated)
    outs = [cs.maximum(x * 2, 0.0), cs.minimum(1.0, x), cs.where(x > 0, x, 0.5)]
    p = cs.Program("p", [x], outs)
    k = build_kernel(p.stages, list(p.outputs), backend="eager")
    t = torch.randn(16)
    a, b, c = k(t)
    want = cs.interpret(p, 1, {"x": t})[0]
    torch.testing.assert_close(a, want["maximum1"]), torch.testing.assert_close(b, want["minimum1"])
    torch.testing.assert_close(c, want["where1"])


def test_inductor_kernel_updating_state_in_place_across_buffers_of_other_sizes():
    """A state read and written in place (reads_out) in chunks of buffers of different sizes: the compiled
    function is shared, and must not assume the size of the first buffer it saw."""
    m = cs.Tensor("m", (64,), cs.float32, cs.Sliced(0))
    g = cs.Tensor("g", (64,), cs.float32, cs.Sliced(0))
    m_new = cs.update(m, m * 0.5 + g)
    p = cs.Program("p", [m, g], [m_new])
    body = list(p.stages)
    k = build_kernel(body, list(p.outputs), backend="inductor", into=True, reads_out={id(p.inputs[0]): 0})
    assert [a.name for a in k.inputs] == ["g"]
    for n in (3000, 1000):
        state, grad = torch.randn(n), torch.randn(n)
        want = state * 0.5 + grad
        for lo, hi in ((0, 512), (512, 1024)):
            k(grad[lo:hi], state[lo:hi])
        torch.testing.assert_close(state[:1024], want[:1024])
        torch.testing.assert_close(state[1024:], want[1024:] * 0 + state[1024:])


def test_inductor_kernel_runs_eagerly_below_its_work_threshold(monkeypatch):
    """Small calls skip the compiled function (its per-call cost exceeds a few eager ops there); large ones use it.
    The threshold is elements x stages: 3 stages and EAGER_WORK=3000 -> compiled from 1000 elements."""
    monkeypatch.setattr(kernels, "EAGER_WORK", 3000)
    x = cs.Tensor("x", (8,), cs.float32, cs.Replicated)
    y = cs.Tensor("y", (8,), cs.float32, cs.Replicated)
    p = cs.Program("p", [x, y], [(x + y) * 3.0 - y])
    k = build_kernel(p.stages, list(p.outputs), backend="inductor", name="small_eager")
    a, b = torch.randn(999), torch.randn(999)
    torch.testing.assert_close(k(a, b)[0], (a + b) * 3 - b)
    assert k.compile_seconds == 0 and k._first  # not compiled yet
    a, b = torch.randn(1000), torch.randn(1000)
    torch.testing.assert_close(k(a, b)[0], (a + b) * 3 - b)
    assert k.compile_seconds > 0 and not k._first


@pytest.mark.parametrize("backend, dtype, count", [("eager", torch.float32, 2), ("eager", torch.bfloat16, 3),
                                                   ("inductor", torch.float32, 3), ("inductor", torch.bfloat16, 2)])
def test_kernel_reducing_its_input_equals_reducing_first(backend, dtype, count):
    """reduce_of: the kernel sums the ranks' chunks itself (the fused collective's one pass) and gets the same bits
    as the collectives' chunk reduction followed by the kernel on the reduced chunk. Inductor keeps a 16-bit
    reduced value in float32 (as every intermediate of its kernels), so there bfloat16 agrees to rounding."""
    from cocosync.reduce_op import ReduceOp
    from cocosync.runtime.comm.reduction import reduce_chunk

    n = 1000
    p = adam_program(n, dtype)
    body = [s for s in p.stages if can_fuse(s)]
    outs = [p.updates[k] for k in ("w", "m", "v")]
    red = next(s for s in p.stages if s.op == "all_reduce")
    plain = build_kernel(body, outs, backend=backend, name="adam_after")
    fused = build_kernel(body, outs, backend=backend, name="adam_fused", reduce_of=(red, count, 1.0 / count))
    assert fused.reduce_index is not None and f"reduced over {count} ranks" in fused.source
    gen = torch.Generator().manual_seed(count)
    parts = [torch.randn(n, generator=gen).to(dtype) for _ in range(count)]
    env = {"w": torch.randn(n, generator=gen).to(dtype), "m": torch.rand(n, generator=gen).to(dtype),
           "v": torch.rand(n, generator=gen).to(dtype), **{k: torch.tensor(v) for k, v in adam_scalars(4).items()}}
    reduced = torch.empty(n, dtype=dtype)
    reduce_chunk(reduced, parts, ReduceOp.MEAN, lambda k: torch.empty(k), 1.0 / count)
    env[red.name] = reduced
    want = plain(*[env[a.name] for a in plain.inputs])
    args = []
    for a in fused.inputs:
        args += parts if a is red else [env[a.name]]
    got = fused(*args)
    exact = dtype == torch.float32 or backend == "eager"
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **(dict(rtol=0, atol=0) if exact else dict(rtol=1.6e-2, atol=1e-3)))


def test_kernel_reduce_of_rejects_what_is_not_an_input():
    p = adam_program(64)
    body = [s for s in p.stages if can_fuse(s)]
    w = next(x for x in p.inputs if x.name == "w")
    with pytest.raises(ValueError, match="reduce_of names 'w' with count=1"):
        build_kernel(body, [p.updates["w"]], backend="eager", reduce_of=(w, 1, None))  # an input, but count < 2
    x = cs.Tensor("x", (64,), cs.float32, cs.Local)
    with pytest.raises(ValueError, match="reduce_of names 'x'.*expected an input"):
        build_kernel(body, [p.updates["w"]], backend="eager", reduce_of=(x, 2, None))
