"""torch.amp.GradScaler across ranks: an inf gradient on ONE rank makes every rank skip the step together (no rank
is left waiting in the fused collective), the scale backs off as torch's rules say, and the next steps train exactly
as torch.optim.Adam on averaged, unscaled gradients with the same skips."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cocosync.testing.launch import RankPool


def _train(inf_rank: int, unscale_first: bool) -> dict:
    from cocosync.optim import DistributedAdam

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
    ref.load_state_dict(model.state_dict())
    opt = DistributedAdam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    scales, skipped = [], []
    for step in range(4):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        model.zero_grad()
        ref.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        ref(x).square().mean().backward()
        if step == 1 and rank == inf_rank:
            model.weight.grad[0, 0] = float("inf")
            ref.weight.grad[0, 0] = float("inf")
        if unscale_first:  # the clipping recipe: unscale_ -> (clip) -> step
            scaler.unscale_(opt)
        before = model.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        skipped.append(torch.equal(before, model.weight.detach()))
        scales.append(scaler.get_scale())
        # the reference: gradients averaged over ranks (an inf anywhere makes the average inf), then torch's rule
        bad = torch.zeros(1)
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
            bad += (~torch.isfinite(p.grad)).any().float()
        if bad.item() == 0:
            ref_opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"skipped": skipped, "scales": scales, "diff": diff, "steps": opt.steps}


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale-then-step"])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(unscale_first):
    with RankPool(2, timeout=90) as pool:
        res = pool.run(_train, 1, unscale_first, timeout=60)
    for r in res:
        assert r["skipped"] == [False, True, False, False]  # every rank skipped step 1, none hung
        assert r["steps"] == 3
        assert r["diff"] < 1e-6, r["diff"]  # the steps taken are torch's on averaged, unscaled gradients
    # rank 1 saw the inf: its scale backed off (x0.5) where rank 0's grew (growth_interval=1), by torch's rules
    assert res[1]["scales"][1] == res[1]["scales"][0] * 0.5 and res[0]["scales"][1] == res[0]["scales"][0] * 2


def _low_precision(dtype_name: str) -> dict:
    """A model in fp16/bf16 with fp32 master weights under the scaler; an inf on rank 1 at step 1; the reference is
    torch.optim.Adam on fp32 copies of the weights with the averaged unscaled gradients."""
    from cocosync.optim import DistributedAdam

    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).to(dtype)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]  # the reference's weights
    opt = DistributedAdam(model.parameters(), lr=1e-2, master_dtype=torch.float32)
    ref_opt = torch.optim.Adam(master, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    skipped = []
    for step in range(4):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        model.zero_grad()
        scaler.scale(model(x.to(dtype)).float().square().mean()).backward()
        grads = [p.grad.detach().float() / scaler.get_scale() for p in model.parameters()]  # what was scaled
        if step == 1 and rank == 1:
            model.weight.grad[0, 0] = float("inf")
            grads[0][0, 0] = float("inf")
        before = model.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        skipped.append(torch.equal(before, model.weight.detach()))
        bad = torch.zeros(1)
        for p, g in zip(master, grads):  # the reference: averaged unscaled gradients, fp32 master weights
            dist.all_reduce(g)
            p.grad = g / world
            bad += (~torch.isfinite(p.grad)).any().float()
        if bad.item() == 0:
            ref_opt.step()
    # the model holds the master weights rounded to its precision
    diff = max((a.float() - b.to(dtype).float()).abs().max().item() for a, b in zip(model.parameters(), master))
    ulp = torch.finfo(dtype).eps * max(p.detach().float().abs().max().item() for p in model.parameters())
    return {"skipped": skipped, "diff": diff, "ulp": ulp, "dtype": str(model.weight.dtype)}


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_low_precision_models_with_fp32_master_weights_under_the_scaler(dtype_name):
    with RankPool(2, timeout=90) as pool:
        res = pool.run(_low_precision, dtype_name, timeout=60)
    for r in res:
        assert r["skipped"] == [False, True, False, False]  # the inf on one rank skipped the step on both
        assert r["dtype"] == f"torch.{dtype_name}"
        # the low-precision weights are the fp32 master weights, rounded (fp16 gradients unscaled in fp16 may
        # round a weight to the neighbouring value: within one unit in the last place of the largest weight)
        assert r["diff"] <= r["ulp"], r
