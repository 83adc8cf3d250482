"""State dicts cross between ours and torch.optim in both directions; a saved setting we do not implement is refused
(not silently ignored); torch.optim's state-dict hooks run."""

from __future__ import annotations

import pytest
import torch

from cocosync.optim import DistributedAdam, DistributedAdamW, DistributedSGD


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))


def _steps(model, opt, steps, seed):
    for s in range(steps):
        g = torch.Generator().manual_seed(seed + s)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("ours_cls, torch_cls, kw", [
    (DistributedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (DistributedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=False)),
    (DistributedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.1)),
])
def test_our_state_dict_continues_in_torch_optim_and_back(ours_cls, torch_cls, kw):
    model = _model()
    ours = ours_cls(model.parameters(), **kw)
    _steps(model, ours, 3, seed=0)
    saved = ours.state_dict()
    twin = _model()
    twin.load_state_dict(model.state_dict())
    ref = torch_cls(twin.parameters(), **kw)
    ref.load_state_dict(saved)  # torch's keys are there: it loads, with our semantics (AdamW's decoupled decay)
    _steps(model, ours, 2, seed=10)
    _steps(twin, ref, 2, seed=10)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    back = ours_cls(_model().parameters(), **kw)
    back.load_state_dict(ref.state_dict())  # and torch's loads into ours
    if ours_cls is not DistributedSGD:  # (torch's SGD keeps no step count)
        assert back.steps == ours.steps


@pytest.mark.parametrize("key, value, needle", [("amsgrad", True, "'amsgrad': True"),
                                                ("decoupled_weight_decay", False, "decoupled_weight_decay=False")])
def test_a_setting_that_selects_another_update_is_refused(key, value, needle):
    model = _model()
    ref_cls = torch.optim.AdamW if key == "amsgrad" else torch.optim.Adam  # one difference at a time
    ref = ref_cls(model.parameters(), lr=1e-3, weight_decay=0.1, **{key: value})
    _steps(model, ref, 1, seed=0)
    ours = DistributedAdamW(_model().parameters(), lr=1e-3, weight_decay=0.1)  # no amsgrad; decoupled decay
    with pytest.raises(ValueError, match=needle):
        ours.load_state_dict(ref.state_dict())


def test_state_dict_hooks_run():
    opt = DistributedAdam(_model().parameters(), lr=1e-3)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    sd = opt.state_dict()
    assert sd["extra"] == 1 and calls == ["pre"]
    opt.load_state_dict(sd)
    assert calls == ["pre", "load_pre", "load_post"]


def test_add_param_group_after_construction_trains_as_torch():
    """The new group gets its own fused update, with its own hyperparameters (here: no weight decay)."""
    model, twin = _model(), _model()
    ours = DistributedAdamW(model[0].parameters(), lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(twin[0].parameters(), lr=1e-2, weight_decay=0.1)
    ours.add_param_group({"params": list(model[1].parameters()), "weight_decay": 0.0})
    ref.add_param_group({"params": list(twin[1].parameters()), "weight_decay": 0.0})
    _steps(model, ours, 3, seed=5)
    _steps(twin, ref, 3, seed=5)
    assert len(ours.param_groups) == 2
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_adam_weight_decay_forms_match_torch():
    """decoupled_weight_decay=False (the default) is torch.optim.Adam's L2 decay, True AdamW's."""
    for decoupled, ref_cls in ((False, torch.optim.Adam), (True, torch.optim.AdamW)):
        model, twin = _model(), _model()
        ours = DistributedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=decoupled)
        ref = ref_cls(twin.parameters(), lr=1e-2, weight_decay=0.1)
        _steps(model, ours, 4, seed=3)
        _steps(twin, ref, 4, seed=3)
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    model, twin = _model(), _model()  # the default is torch.optim.Adam's (L2), with no warning
    ours, ref = DistributedAdam(model.parameters(), weight_decay=0.1), torch.optim.Adam(twin.parameters(),
                                                                                       weight_decay=0.1)
    _steps(model, ours, 2, seed=4)
    _steps(twin, ref, 2, seed=4)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _l2_adam_on_rank():
    import torch.distributed as dist

    model = _model()
    opt = DistributedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=False)
    r, P = dist.get_rank(), dist.get_world_size()
    for s in range(3):
        for i, p in enumerate(model.parameters()):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * s + 10 * i + r))
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.compiled.fast_steps, P


def test_l2_adam_on_two_ranks_is_one_fused_collective_and_matches_torch_adam(rank_pool):
    got = rank_pool(2).run(_l2_adam_on_rank)
    ref_model = _model()
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    for s in range(3):  # torch on the averaged gradients
        for i, p in enumerate(ref_model.parameters()):
            p.grad = sum(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * s + 10 * i + r))
                         for r in range(2)) / 2
        ref.step()
    for params, fast, _ in got:
        assert any(f.startswith("fused_collective") for f in fast), fast
        for a, b in zip(params, ref_model.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def _per_parameter_state_on_rank():
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model()
    opt = DistributedAdam(model.parameters(), lr=1e-2)
    r = dist.get_rank()
    first = next(model.parameters())
    empty_before = len(opt.state) == 0 and first not in opt.state
    for s in range(3):
        for i, p in enumerate(model.parameters()):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * s + 10 * i + r))
        opt.step()
    full = opt.state_dict()
    views = {}  # this rank's part of each parameter's exp_avg, and where it sits in the full flat tensor
    start = opt._updates[0].slice.start
    for i, p in enumerate(model.parameters()):
        e = opt.state[p]
        lo = opt.flat.offsets[i]
        a = max(lo, start) - lo
        views[i] = (float(e["step"]), e["exp_avg"].clone(), full["state"][i]["exp_avg"].reshape(-1)[a:a + e[
            "exp_avg"].numel()].clone(), e["exp_avg"].numel())
    model.zero_grad()  # grads None: DCP would run its initialising fake step if opt.state looked empty
    _, osd = get_state_dict(model, opt)
    after = opt.state_dict()
    unchanged = opt.steps == 3 and all(torch.equal(full["state"][i]["exp_avg"], after["state"][i]["exp_avg"])
                                       for i in full["state"])
    dist.barrier()  # every rank has read the state before any rank writes into its slice below
    e = opt.state[first]  # a view: writing into it changes the optimizer's state
    if e["exp_avg"].numel():
        e["exp_avg"].fill_(7.0)
    a = max(0, start)  # parameter 0 starts at offset 0: this rank's part is [start, start + n) of it
    part = opt.state_dict()["state"][0]["exp_avg"].reshape(-1)[a:a + e["exp_avg"].numel()]
    written = bool((part == 7.0).all())
    return empty_before, views, unchanged, written, len(osd["state"])


def test_opt_state_holds_views_of_this_ranks_slices_and_dcp_takes_no_step(rank_pool):
    for empty_before, views, unchanged, written, n_state in rank_pool(2).run(_per_parameter_state_on_rank):
        assert empty_before and unchanged and written and n_state == 4
        for step, view, full_part, n in views.values():
            assert step == 3.0 and torch.equal(view, full_part)
    covered = [sum(v[3] for v in r[1].values()) for r in rank_pool(2).run(_per_parameter_state_on_rank)]
    assert sum(covered) == sum(p.numel() for p in _model().parameters())  # the slices cover every element once
