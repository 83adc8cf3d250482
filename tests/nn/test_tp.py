"""Tensor-parallel layers (cocosync.nn) on 2 and 4 ranks equal the single-process nn.Linear / MLP: outputs, input
gradients and (gathered) weight gradients; dropout masks per call; uneven row counts; bad inputs."""

import pytest
import torch
from torch import nn

import cocosync as cs
from cocosync.interp import dropout_mask
from cocosync.nn import ColumnParallelLinear, MegatronMLP, RowParallelLinear, mlp_program

H, F = 16, 32
TOL = dict(rtol=1e-5, atol=1e-5)


def _dense(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(H, F), nn.Linear(F, H)


def _inputs(rows_shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*rows_shape, H, generator=g), torch.randn(*rows_shape, H, generator=g)


def _grads(mod):
    return {n: p.grad.clone() for n, p in mod.named_parameters()}


def _on_rank(P):
    import torch.distributed as dist

    rank, out = dist.get_rank(), {}
    fc1, fc2 = _dense()
    # Column -> relu -> Row (leading dims 2 x 3)
    x, dout = _inputs((2, 3))
    col, row = ColumnParallelLinear.from_dense(fc1, rank, P), RowParallelLinear.from_dense(fc2, rank, P, chunks=2)
    xr = x.clone().requires_grad_()
    y = row(torch.relu(col(xr)))
    y.backward(dout)
    out["linear"] = {"y": y.detach(), "dx": xr.grad, "col": _grads(col), "row": _grads(row)}
    # gathered column output, no bias, 5 rows (odd)
    x5, d5 = _inputs((5,), seed=2)
    lin = nn.Linear(H, F, bias=False)
    with torch.no_grad():
        lin.weight.copy_(fc1.weight)
    colg = ColumnParallelLinear.from_dense(lin, rank, P, gather_output=True)
    xr = x5.clone().requires_grad_()
    yg = colg(xr)
    yg.backward(torch.randn(5, F, generator=torch.Generator().manual_seed(3)))
    out["gather"] = {"y": yg.detach(), "dx": xr.grad, "w": colg.weight.grad}
    # the MLP block: two training calls (masks of seed and seed + 1), 8 rows and 7 rows (no split), then eval
    mlp = MegatronMLP.from_dense(fc1, fc2, rank, P, p=0.25, seed=3, chunks=2)
    res = []
    for shape in ((8,), (7,)):
        x, dout = _inputs(shape, seed=4 + len(res))
        xr = x.clone().requires_grad_()
        o = mlp(xr)
        o.backward(dout)
        res.append({"out": o.detach(), "dx": xr.grad})
    with torch.no_grad():
        ev = mlp.eval()(_inputs((8,), seed=4)[0])
    wrong = MegatronMLP.from_dense(fc1, fc2, (rank + 1) % P, P)  # shards of another rank
    try:
        wrong(_inputs((8,))[0])
        out["wrong"] = None
    except ValueError as e:
        out["wrong"] = str(e)
    out["mlp"] = {"calls": res, "grads": _grads(mlp), "eval": ev, "n": mlp.calls,
                  "fast": [s for plan in mlp._plans.plans.values() for s in plan.fast_steps]}
    return out


def _reference_mlp(fc1, fc2, x, mask):
    return fc2(torch.relu(fc1(x))) * mask + x


@pytest.mark.parametrize("P", [2, 4])
def test_tp_layers_match_single_process(rank_pool, P):
    got = rank_pool(P).run(_on_rank, P)
    fc1, fc2 = _dense()
    # Column -> Row
    x, dout = _inputs((2, 3))
    xr = x.clone().requires_grad_()
    y = fc2(torch.relu(fc1(xr)))
    y.backward(dout)
    for r in got:
        torch.testing.assert_close(r["linear"]["y"], y.detach(), **TOL)
        torch.testing.assert_close(r["linear"]["dx"], xr.grad, **TOL)
        torch.testing.assert_close(r["linear"]["row"]["bias"], fc2.bias.grad, **TOL)
    cat = lambda key, name, dim: torch.cat([r["linear"][key][name] for r in got], dim)  # noqa: E731
    torch.testing.assert_close(cat("col", "weight", 1), fc1.weight.grad.t(), **TOL)
    torch.testing.assert_close(cat("col", "bias", 0), fc1.bias.grad, **TOL)
    torch.testing.assert_close(cat("row", "weight", 0), fc2.weight.grad.t(), **TOL)
    # gathered column output
    fc1.zero_grad()
    x5, _ = _inputs((5,), seed=2)
    xr = x5.clone().requires_grad_()
    yg = xr @ fc1.weight.t()
    yg.backward(torch.randn(5, F, generator=torch.Generator().manual_seed(3)))
    for r in got:
        torch.testing.assert_close(r["gather"]["y"], yg.detach(), **TOL)
        torch.testing.assert_close(r["gather"]["dx"], xr.grad, **TOL)
    torch.testing.assert_close(torch.cat([r["gather"]["w"] for r in got], 1), fc1.weight.grad.t(), **TOL)
    # MLP block
    fc1, fc2 = _dense()
    for i, shape in enumerate(((8,), (7,))):
        x, dout = _inputs(shape, seed=4 + i)
        xr = x.clone().requires_grad_()
        mask = dropout_mask((shape[0], H), 0.25, 3 + i).float() / 0.75
        o = _reference_mlp(fc1, fc2, xr, mask)
        o.backward(dout)
        for r in got:
            torch.testing.assert_close(r["mlp"]["calls"][i]["out"], o.detach(), **TOL)
            torch.testing.assert_close(r["mlp"]["calls"][i]["dx"], xr.grad, **TOL)
    with torch.no_grad():
        want_eval = _reference_mlp(fc1, fc2, _inputs((8,), seed=4)[0], 1.0)
    mg = lambda name, dim: torch.cat([r["mlp"]["grads"][name] for r in got], dim)  # noqa: E731
    torch.testing.assert_close(mg("w1", 1), fc1.weight.grad.t(), **TOL)
    torch.testing.assert_close(mg("b1", 0), fc1.bias.grad, **TOL)
    torch.testing.assert_close(mg("w2", 0), fc2.weight.grad.t(), **TOL)
    for rank, r in enumerate(got):
        assert f"cut for rank {(rank + 1) % P} of {P}, but this process is rank {rank}" in r["wrong"]
        torch.testing.assert_close(r["mlp"]["grads"]["b2"], fc2.bias.grad, **TOL)
        torch.testing.assert_close(r["mlp"]["eval"], want_eval, **TOL)
        assert r["mlp"]["n"] == 2  # eval calls draw no mask
        assert any(s.startswith("overlap(") for s in r["mlp"]["fast"]), r["mlp"]["fast"]


def test_mlp_program_equals_dsl_dropout():
    """The mask-input program is the DSL's dropout(p, seed) by construction: check with the interpreter."""
    from cocosync.dsl import Program, Replicated, Sliced, Tensor, all_reduce, dropout, gt, where

    P, rows, p, seed = 2, 8, 0.25, 11
    x = Tensor("x", (rows, H), layout=Replicated)
    w1, b1 = Tensor("w1", (H, F), layout=Sliced(1)), Tensor("b1", (F,), layout=Sliced(0))
    w2, b2 = Tensor("w2", (F, H), layout=Sliced(0)), Tensor("b2", (H,), layout=Replicated)
    a = x @ w1 + b1
    ref = Program("ref", [x, w1, w2, b1, b2], {"out": dropout(all_reduce(where(gt(a, 0.0), a, 0.0) @ w2) + b2,
                                                                p, seed) + x})
    g = torch.Generator().manual_seed(0)
    vals = {"x": torch.randn(rows, H, generator=g), "w1": torch.randn(H, F, generator=g),
            "w2": torch.randn(F, H, generator=g), "b1": torch.randn(F, generator=g), "b2": torch.randn(H, generator=g)}
    want = cs.interpret(ref, P, vals)
    mask = dropout_mask((rows, H), p, seed).float() / (1 - p)
    got = cs.interpret(mlp_program(rows, H, F), P, {**vals, "mask": mask})
    for r in range(P):
        torch.testing.assert_close(got[r]["out"], want[r]["out"], rtol=1e-5, atol=1e-4)


def test_bad_inputs():
    with pytest.raises(RuntimeError, match="not initialized"):
        ColumnParallelLinear(H, F)
    with pytest.raises(ValueError, match="out_features=6 must be a positive multiple"):
        ColumnParallelLinear(H, 6, rank=0, world=4)
    with pytest.raises(ValueError, match="in_features=6"):
        RowParallelLinear(6, H, rank=0, world=4)
    with pytest.raises(ValueError, match=r"p=1\.0"):
        MegatronMLP(H, F, p=1.0, rank=0, world=2)
    with pytest.raises(ValueError, match="chunks=0"):
        MegatronMLP(H, F, chunks=0, rank=0, world=2)
    mlp = MegatronMLP(H, F, rank=0, world=2)
    with pytest.raises(ValueError, match="must end with hidden=16"):
        mlp(torch.randn(4, H + 1))
    with pytest.raises(ValueError, match="float64"):
        mlp(torch.randn(4, H, dtype=torch.float64))
    with pytest.raises(TypeError, match="must be a tensor"):
        mlp([1.0] * H)
    row = RowParallelLinear(F, H, rank=1, world=2)
    with pytest.raises(ValueError, match="this rank's 16 features"):
        row(torch.randn(3, F))  # the full input instead of this rank's slice
    with pytest.raises(ValueError, match="do not form hidden->ffn->hidden"):
        MegatronMLP.from_dense(nn.Linear(H, F), nn.Linear(F, H + 2), 0, 2)


def test_chunks_default_follows_the_device():
    from cocosync.nn.parallel import check_chunks, resolve_chunks

    assert resolve_chunks(None, "cpu") == 1 and resolve_chunks(None, "cuda") == 2  # overlap where comm has its engine
    assert resolve_chunks(3, "cpu") == 3
    with pytest.raises(ValueError, match=r"chunks=1\.5 must be an int >= 1, None .* or .auto."):
        check_chunks("RowParallelLinear", 1.5)


def _default_chunk_steps():
    import torch.distributed as dist

    rank, P = dist.get_rank(), dist.get_world_size()
    fc1, fc2 = _dense()
    x, dout = _inputs((8,), seed=9)
    results, steps = [], []
    for chunks in (None, 2):  # None: 1 on CPU (GEMM + epilogue steps, no overlap), 2: the overlap steps
        mlp = MegatronMLP.from_dense(fc1, fc2, rank, P, p=0.25, seed=5, chunks=chunks)
        xr = x.clone().requires_grad_()
        out = mlp(xr)
        out.backward(dout)
        results.append((out.detach(), xr.grad, _grads(mlp)))
        plans = [*mlp._plans.plans.values(), *mlp._backward_plans.plans.values()]
        steps.append([str(s) for plan in plans for s in plan.plan.steps])
    return results, steps


def test_default_chunks_on_cpu_match_overlap_and_skip_it(rank_pool):
    for (default, overlap), (default_steps, overlap_steps) in rank_pool(2).run(_default_chunk_steps):
        assert not any(s.startswith("overlap(") for s in default_steps), default_steps
        # small enough to reduce one-shot: the all_reduces stay whole (forward and backward), no RS/AG pair
        assert sum(s.startswith("collective(") and s.endswith("= all_reduce)") for s in default_steps) == 2, \
            default_steps
        assert not any("reduce_scatter" in s for s in default_steps), default_steps
        assert any(s.startswith("overlap(") for s in overlap_steps), overlap_steps  # chunks=2 really overlapped
        torch.testing.assert_close(default[0], overlap[0], **TOL)
        torch.testing.assert_close(default[1], overlap[1], **TOL)
        for name in default[2]:
            torch.testing.assert_close(default[2][name], overlap[2][name], **TOL, msg=name)


def test_tp_schedule_keeps_small_all_reduces_whole_without_overlap():
    """chunks=1: an all_reduce the shared-memory runtime reduces one-shot stays whole (the epilogue runs once on
    the reduced rows); a larger one is split into reduce_scatter -> epilogue on slices -> all_gather; chunks>1
    always splits (the overlap pipelines matmul -> RS -> epilogue -> AG)."""
    from cocosync.nn.parallel import tp_schedule
    from cocosync.runtime.comm.collectives import DEFAULT_ONE_SHOT_BYTES

    def ops(rows, hidden, chunks, world=2):
        return [s.op for s in tp_schedule(mlp_program(rows, hidden, 64), chunks, rows, world).program.stages]

    small = ops(8, 16, 1)
    assert "all_reduce" in small and "reduce_scatter" not in small
    rows = DEFAULT_ONE_SHOT_BYTES // (4 * 256) + 2  # (world - 1) x bytes just above the one-shot limit
    assert "reduce_scatter" in ops(rows, 256, 1) and "all_reduce" not in ops(rows, 256, 1)
    assert "reduce_scatter" in ops(rows // 4 * 2, 256, 1, world=4)  # 3 peers' copies to read: split sooner
    assert "reduce_scatter" in ops(8, 16, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_keep_mask_is_the_dsl_dropout_mask(dtype):
    from cocosync.nn.parallel import scaled_keep_mask

    got = scaled_keep_mask((33, 17), 0.3, 12, dtype)
    want = dropout_mask((33, 17), 0.3, 12).to(dtype) / 0.7
    assert got.dtype == dtype and torch.equal(got, want)
    assert 0 < (got == 0).sum() < got.numel()  # some dropped, some kept


def _auto_chunks():
    import torch.distributed as dist

    rank, P = dist.get_rank(), dist.get_world_size()
    fc1, fc2 = _dense()
    x, dout = _inputs((64,), seed=11)  # 64 rows: 1, 2 and 4 chunks are three different plans
    out = []
    for chunks in ("auto", 1, "auto"):  # the second "auto" layer reads the first one's choice from the cache
        mlp = MegatronMLP.from_dense(fc1, fc2, rank, P, p=0.25, seed=5, chunks=chunks)
        xr = x.clone().requires_grad_()
        y = mlp(xr)
        y.backward(dout)
        out.append((y.detach(), xr.grad, _grads(mlp), dict(mlp._plans.chosen), dict(mlp._backward_plans.chosen)))
    return out


def test_auto_chunks_measures_the_candidates_and_agrees_with_fixed_chunks(rank_pool):
    results = rank_pool(2).run(_auto_chunks)
    for r in results:  # the cached choice: the same chunks, nothing timed
        again = [(c, {}) for c, _ in r[0][3].values()], [(c, {}) for c, _ in r[0][4].values()]
        assert (list(r[2][3].values()), list(r[2][4].values())) == again
    chosen = [(list(r[0][3].values()), list(r[0][4].values())) for r in results]
    assert chosen[0] == chosen[1]  # every rank runs the same plan: the slowest rank's medians decide
    forward, backward = chosen[0]
    assert len(forward) == 1 and len(backward) == 1
    for c, medians in (forward[0], backward[0]):
        assert sorted(medians) == [1, 2, 4] and c == min(medians, key=medians.get)
    for (auto, fixed, _) in results:
        for a, b in zip(auto[:2], fixed[:2]):
            torch.testing.assert_close(a, b, **TOL)
        for name in auto[2]:
            torch.testing.assert_close(auto[2][name], fixed[2][name], **TOL, msg=name)
