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
