"""A parameter without a gradient on a step (a branch used only sometimes) is skipped as torch.optim skips it on
DDP(find_unused_parameters=True)-averaged gradients: untouched when no rank used it, averaged with zeros when some
did; its step count (bias correction, SGD's first-step dampening) advances only when it steps."""

from __future__ import annotations

import pytest
import torch

from cocosync.optim import DistributedAdam, DistributedAdamW, DistributedSGD

#: per step: which ranks use the conditional head (all, none, rank 0 only, none, all, ...)
USES = [(0, 1), (), (0,), (), (0, 1), (1,), (0, 1)]
CASES = {
    "adam_l2": (DistributedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05)),
    "adamw_amsgrad": (DistributedAdamW, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
    "sgd_dampening": (DistributedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.3)),
}


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.head, self.rare = torch.nn.Linear(4, 6), torch.nn.Linear(6, 1), torch.nn.Linear(6, 1)

    def forward(self, x, use_rare: bool):
        h = torch.tanh(self.trunk(x))
        return (self.head(h) + self.rare(h) if use_rare else self.head(h)).pow(2).mean()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _ours(case: str, set_to_none: bool) -> tuple[list[torch.Tensor], dict]:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    model = Branchy()
    cls, _, kw = CASES[case]
    opt = cls(model.parameters(), **kw)
    for step, users in enumerate(USES):
        model.zero_grad(set_to_none=True) if set_to_none else opt.zero_grad()
        model(_batch(step, rank), rank in users).backward()
        opt.step()
    steps = {k: float(v["step"]) for k, v in opt.state_dict()["state"].items()}
    return [p.detach().clone() for p in model.parameters()], steps


def _torch(case: str, world: int) -> tuple[list[torch.Tensor], dict]:
    """torch.optim on DDP's averages: a parameter no rank used keeps grad None; else the mean, zeros for the
    ranks that did not use it."""
    model = Branchy()
    _, cls, kw = CASES[case]
    opt = cls(model.parameters(), **kw)
    for step, users in enumerate(USES):
        grads = []
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            model(_batch(step, rank), rank in users).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            got = [g[i] for g in grads if g[i] is not None]
            p.grad = sum(got) / world if got else None
        opt.step()
    steps = {k: float(v["step"]) if "step" in v else None for k, v in opt.state_dict()["state"].items()}
    return [p.detach().clone() for p in model.parameters()], steps


@pytest.mark.parametrize("case", list(CASES))
def test_unused_parameters_are_skipped_as_torch_does(rank_pool, case):
    want, want_steps = _torch(case, 2)
    for set_to_none in (False, True):
        for params, steps in rank_pool(2).run(_ours, case, set_to_none):
            if case != "sgd_dampening":  # torch's SGD keeps no step count
                assert steps == want_steps
            assert steps[4] == 5.0  # rare.weight: some rank used it on 5 of the 7 steps
            for a, b in zip(params, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    alone, _ = _ours(case, False)
    for a, b in zip(alone, _torch(case, 1)[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_skipped_parameter_is_untouched_and_has_no_state_until_used():
    model = Branchy()
    opt = DistributedAdam(model.parameters(), lr=0.1)
    before = model.rare.weight.detach().clone()
    for step in range(3):
        opt.zero_grad()
        model(_batch(step, 0), False).backward()
        opt.step()
    assert torch.equal(model.rare.weight, before)
    assert model.rare.weight not in opt.state and model.head.weight in opt.state
    assert sorted(opt.state_dict()["state"]) == [0, 1, 2, 3]  # trunk and head; rare (4, 5) never stepped
    opt.zero_grad()
    model(_batch(3, 0), True).backward()
    opt.step()
    assert not torch.equal(model.rare.weight, before)
    assert float(opt.state[model.rare.weight]["step"]) == 1.0 and float(opt.state[model.head.weight]["step"]) == 4.0


def _bf16(skip_by_freezing: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    import torch.distributed as dist

    model = Branchy().to(torch.bfloat16)
    init = model.rare.weight.detach().clone()
    model.rare.requires_grad_(not skip_by_freezing)
    opt = DistributedAdamW(model.parameters(), lr=1e-2, master_dtype=torch.float32)
    for step in range(3):
        opt.zero_grad()
        model(_batch(step, dist.get_rank()).to(torch.bfloat16), False).backward()
        opt.step()
    return [p.detach().float() for p in (*model.trunk.parameters(), *model.head.parameters())], \
        torch.equal(model.rare.weight, init)


def test_bf16_with_float32_master_weights_skips_through_the_masked_program(rank_pool):
    """The masked fused program with master weights: the unused head keeps its bf16 weights bit for bit, and the
    rest trains as with that head frozen (left out of the optimizer)."""
    masked = rank_pool(2).run(_bf16, False)
    frozen = rank_pool(2).run(_bf16, True)
    for (params, untouched), (ref, _) in zip(masked, frozen):
        assert untouched
        for a, b in zip(params, ref):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


def test_a_gradient_written_in_place_counts_wherever_its_nonzeros_are():
    """No backward, gradients copied into the optimizer's views (as a benchmark or a custom reducer does): a view
    counts when any element is nonzero, also when only its last one is (the check looks at a prefix first)."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(32, 16), torch.nn.Linear(32, 16)  # 512 weights each: past the prefix
    opt = DistributedAdam([a.weight, b.weight], lr=0.1)
    (a(torch.randn(2, 32)).sum() + b(torch.randn(2, 32)).sum()).backward()
    opt.step()  # the gradients are the optimizer's views from here
    a.weight.grad.zero_()
    b.weight.grad.zero_()
    a.weight.grad.view(-1)[-1] = 1.0  # nonzero only at the end
    wa, wb = a.weight.detach().clone(), b.weight.detach().clone()
    opt.step()
    assert not torch.equal(a.weight, wa) and torch.equal(b.weight, wb)
    assert float(opt.state[a.weight]["step"]) == 2.0 and float(opt.state[b.weight]["step"]) == 1.0  # b: skipped
