"""`cocosync bench dp`: the LAMB baseline equals the reference, buckets are DDP-like, the suite runs end to end."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from cocosync.bench.baselines import ForeachLAMB, GradBuckets, adam_fused_ok, foreach_lamb_step, small_transformer
from cocosync.bench.dp import DpConfig, dp_cmd
from cocosync.programs.lamb import lamb_reference


def _have_ours() -> bool:
    try:
        from cocosync.optim import DistributedAdam, DistributedLAMB  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_foreach_lamb_equals_reference(wd):
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(7, 5, generator=gen), torch.randn(300, generator=gen), torch.zeros(4)]  # a zero tensor: ratio 1
    ms, vs = [torch.zeros_like(w) for w in ws], [torch.zeros_like(w) for w in ws]
    ref = [(w.clone(), m.clone(), v.clone()) for w, m, v in zip(ws, ms, vs)]
    for step in range(1, 5):
        gs = [torch.randn(w.shape, generator=gen) for w in ws]
        foreach_lamb_step(ws, gs, ms, vs, step=step, lr=1e-2, weight_decay=wd)
        ref = [lamb_reference(w, m, v, g, step, lr=1e-2, wd=wd) for (w, m, v), g in zip(ref, gs)]
    for got, want in zip(zip(ws, ms, vs), ref):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_foreach_lamb_global_ratio_equals_reference_on_the_flat_vector():
    """per_tensor=False is DistributedLAMB's math: lamb_reference on all parameters as one flat vector."""
    gen = torch.Generator().manual_seed(1)
    ws = [torch.randn(6, 4, generator=gen), torch.randn(50, generator=gen)]
    ms, vs = [torch.zeros_like(w) for w in ws], [torch.zeros_like(w) for w in ws]
    flat = [torch.cat([w.reshape(-1) for w in ws]), torch.zeros(74), torch.zeros(74)]
    for step in range(1, 4):
        gs = [torch.randn(w.shape, generator=gen) for w in ws]
        foreach_lamb_step(ws, gs, ms, vs, step=step, lr=1e-2, weight_decay=0.01, per_tensor=False)
        flat = list(lamb_reference(*flat, torch.cat([g.reshape(-1) for g in gs]), step, lr=1e-2, wd=0.01))
    torch.testing.assert_close(torch.cat([w.reshape(-1) for w in ws]), flat[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([v.reshape(-1) for v in vs]), flat[2], rtol=1e-5, atol=1e-6)


def test_foreach_lamb_optimizer_equals_reference():
    model = torch.nn.Linear(6, 3)
    w0 = [p.detach().clone() for p in model.parameters()]
    opt = ForeachLAMB(model.parameters(), lr=1e-2, weight_decay=0.1)
    state = [(w, torch.zeros_like(w), torch.zeros_like(w)) for w in w0]
    for step in range(1, 4):
        grads = [torch.randn_like(w) for w in w0]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        state = [lamb_reference(w, m, v, g, step, lr=1e-2, wd=0.1) for (w, m, v), g in zip(state, grads)]
    for p, (w, _, _) in zip(model.parameters(), state):
        torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="betas"):
        ForeachLAMB(model.parameters(), betas=(1.0, 0.9))


def test_grad_buckets_are_ddp_like_views():
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])  # 4 x (16 KB weight + 256 B bias)
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)
    b = GradBuckets(model.parameters(), bucket_bytes=32 << 10)
    assert len(b.buffers) == 2  # filled back to front; a bucket closes once it holds >= 32 KB (2 layers here)
    assert b.buffers[0].numel() == 2 * (64 * 64 + 64)
    assert sum(x.numel() for x in b.buffers) == sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        assert p.grad.eq(2.0).all()
        assert any(p.grad.data_ptr() >= x.data_ptr() and p.grad.data_ptr() < x.data_ptr() + x.numel() * 4
                   for x in b.buffers)


def test_fused_adam_runs_on_cpu_and_transformer_is_seeded():
    assert adam_fused_ok()  # the DDP-style baseline uses Adam(fused=True); no silent fallback
    a, b = small_transformer(d=32, layers=1, seq=8, vocab=50), small_transformer(d=32, layers=1, seq=8, vocab=50)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert a(torch.randint(0, 50, (2, 8))).shape == (2, 8, 50)


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="sections.*'bogus'"):
        DpConfig(sections=("adam", "bogus"))
    with pytest.raises(ValueError, match="tf_dim=30"):
        DpConfig(tf_dim=30)
    with pytest.raises(ValueError, match="nnodes=3 must be >= 1 and divide P=4"):
        DpConfig(P=4, nnodes=3)


def test_bench_dp_end_to_end_writes_json_and_png(tmp_path):
    path = tmp_path / "dp.json"
    res = CliRunner().invoke(dp_cmd, ["--quick", "--layers", "2", "--width", "128", "--repeats", "1", "--tf",
                                      "1,32,8,2", "--bw-size", "8M", "--sections", "adam,lamb,sgd,train",
                                      "--kernels", "eager", "--json", str(path)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    data = json.loads(path.read_text())
    assert data["suite"] == "dp" and data["params"] == 2 * (128 * 128 + 128)
    assert data["bandwidth_Bps"] > 0 and data["bound_s"] > 0 and data["kernels"] == "eager"
    cases = {r["case"]: r for r in data["rows"]}
    for case in ("ddp", "zero", "lamb_base", "sgd_ddp", "train_ddp"):
        assert cases[case]["median_s"] > 0, (case, cases[case])
    assert cases["ddp"]["base_over"] == pytest.approx(1.0)
    # cocosync.optim: measured when present, else an n/a row
    for case in ("ours", "lamb_ours", "sgd_ours", "train_ours"):
        if _have_ours():
            assert cases[case]["median_s"] > 0 and cases[case]["over_ours"] == pytest.approx(1.0), cases[case]
        else:
            assert cases[case]["note"].startswith("n/a: "), cases[case]
    if _have_ours():
        assert cases["ours"]["bound_over"] > 0
        # SGD's bound moves fewer bytes than Adam's: (P + 4) vs (P + 6) per parameter
        assert cases["sgd_ours"]["bound_over"] == pytest.approx(
            data["sgd_bound_s"] / cases["sgd_ours"]["median_s"]) and data["sgd_bound_s"] < data["bound_s"]
        assert set(data["targets"]) == {"adam", "lamb", "train"}
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "DDP-style" in res.output


def test_bench_dp_train_sweep_end_to_end(tmp_path):
    path = tmp_path / "sweep.json"
    res = CliRunner().invoke(dp_cmd, ["--tf", "1,32,8,2", "--tf-batches", "1,3", "--repeats", "1", "--kernels", "eager",
                                      "--json", str(path)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    data = json.loads(path.read_text())
    assert data["suite"] == "dp-train-sweep" and [r["batch"] for r in data["rows"]] == [1, 3]
    assert [r["tokens"] for r in data["rows"]] == [8, 24]
    for r in data["rows"]:
        assert r["ddp_s"] > 0 and (r["ours_s"] > 0 if _have_ours() else r["ours_s"] is None), r
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    bad = CliRunner().invoke(dp_cmd, ["--tf-batches", "1,x"])
    assert bad.exit_code != 0 and "expected comma-separated positive integers" in bad.output
