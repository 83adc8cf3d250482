"""Ranks that disagree fail at once, naming both ranks and the first difference: different models at construction
(one all_gather of a signature), different hyperparameters at the step (a hash in the fused collective's header)."""

from __future__ import annotations

import time

import torch

from cocosync.testing import RankPool


def _different_models():
    import torch.distributed as dist

    from cocosync.optim import DistributedAdam

    width = 16 if dist.get_rank() == 0 else 24
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Linear(width, 1))
    t0 = time.monotonic()
    try:
        DistributedAdam(model.parameters(), lr=1e-3)
    except ValueError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, "", time.monotonic() - t0


def _different_lr():
    import torch.distributed as dist

    from cocosync.optim import DistributedAdam

    torch.manual_seed(0)
    model = torch.nn.Linear(32, 8)
    opt = DistributedAdam(model.parameters(), lr=1e-3)
    if dist.get_rank() == 1:  # e.g. a scheduler stepped on one rank only
        opt.param_groups[0]["lr"] = 1.0
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    t0 = time.monotonic()
    try:
        opt.step()
    except ValueError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, "", time.monotonic() - t0


def _same_lr_changed_together():
    """An lr scheduler that changes lr on every rank alike is not a disagreement."""
    from cocosync.optim import DistributedAdam

    torch.manual_seed(0)
    model = torch.nn.Linear(32, 8)
    opt = DistributedAdam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    return opt.param_groups[0]["lr"]


def _different_lr_at_construction():
    import torch.distributed as dist

    from cocosync.optim import DistributedAdam

    try:
        DistributedAdam(torch.nn.Linear(4, 4).parameters(), lr=1e-3 if dist.get_rank() == 0 else 1.0)
    except ValueError as e:
        return str(e)
    return ""


def _add_group_on_ranks():
    """add_param_group on 2 ranks: the new group's fused update averages its gradients like the first group's."""
    import torch.distributed as dist

    from cocosync.optim import DistributedAdam

    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)
    opt = DistributedAdam(a.parameters(), lr=1e-2)
    opt.add_param_group({"params": list(b.parameters()), "lr": 1e-3})
    for p in [*a.parameters(), *b.parameters()]:
        p.grad = torch.full_like(p, float(dist.get_rank() + 1))
    opt.step()
    w = b.weight.detach().clone()
    dist.all_reduce(w, op=dist.ReduceOp.MAX)
    return torch.equal(w, b.weight.detach()), float((b.weight.detach() - w).abs().max())


def test_ranks_that_disagree_fail_at_once_naming_the_difference():
    with RankPool(2, timeout=120) as pool:
        models = pool.run(_different_models)
        lrs = pool.run(_different_lr)
        at_construction = pool.run(_different_lr_at_construction)
        assert pool.run(_same_lr_changed_together) == [1.25e-4, 1.25e-4]
        assert [ok for ok, _ in pool.run(_add_group_on_ranks)] == [True, True]
    for kind, msg, seconds in models:
        assert kind == "RanksDisagree" and "group 0 parameter 0" in msg, msg
        assert "(16, 8)" in msg and "(24, 8)" in msg and "global rank 0" in msg and "global rank 1" in msg, msg
        assert seconds < 30, seconds
    for kind, msg, seconds in lrs:
        assert kind == "RanksDisagree" and "lr" in msg and "0.001" in msg and "1.0" in msg, msg
        assert "global rank 0" in msg and "global rank 1" in msg, msg
        assert seconds < 30, seconds
    for msg in at_construction:
        assert "group 0 lr" in msg and "0.001" in msg and "1.0" in msg, msg


def _save_on_rank_0_only():
    import torch.distributed as dist

    from cocosync.optim import DistributedAdam

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = DistributedAdam(model.parameters(), lr=1e-2)
    for step in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step + 10 * dist.get_rank()))
        opt.step()
    mine = opt.local_state["m"].clone()
    saved = opt.state_dict() if dist.get_rank() == 0 else None  # rank 1 does not call it
    for p in model.parameters():  # the next step needs both ranks: nobody waited for the other above
        p.grad = torch.ones_like(p)
    opt.step()
    return mine, saved


def test_state_dict_on_one_rank_only():
    with RankPool(2, timeout=120) as pool:
        (m0, saved), (m1, _) = pool.run(_save_on_rank_0_only)
    full = torch.cat([m0, m1])
    got = torch.cat([saved["state"][0]["exp_avg"].reshape(-1), saved["state"][1]["exp_avg"].reshape(-1)])
    torch.testing.assert_close(got, full[:got.numel()], rtol=0, atol=0)
    assert got.abs().sum() > 0
