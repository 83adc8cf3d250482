"""Clipping by the global norm of the averaged gradient over every parameter group: `max_grad_norm=` with several
groups (the recipe: no decay on biases + clipping) and `opt.clip_grad_norm_(max_norm)` before step() both equal
torch.optim.AdamW after torch.nn.utils.clip_grad_norm_ on averaged gradients, on 2 ranks and alone; the returned
norm is the same on every rank and equals torch's."""

from __future__ import annotations

import pytest
import torch

from cocosync.optim import DistributedAdamW

MAX_NORM = 0.3
STEPS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _grad(p: torch.Tensor, step: int, rank: int, i: int) -> torch.Tensor:
    return torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + 10 * i + rank))


def _ours(api: str) -> tuple[list[torch.Tensor], list[float]]:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    model = _model()
    kw = {"max_grad_norm": MAX_NORM} if api == "max_grad_norm" else {}
    opt = DistributedAdamW(_groups(model), lr=1e-2, **kw)
    norms = []
    for step in range(STEPS):
        for i, p in enumerate(model.parameters()):
            p.grad = _grad(p, step, rank, i)
        if api == "clip_grad_norm_":
            norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
        if api == "max_grad_norm":
            norms.append(float(opt.last_grad_norm))
    return [p.detach().clone() for p in model.parameters()], norms


def _torch(world: int) -> tuple[list[torch.Tensor], list[float]]:
    model = _model()
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    norms = []
    for step in range(STEPS):
        for i, p in enumerate(model.parameters()):
            p.grad = sum(_grad(p, step, r, i) for r in range(world)) / world
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    return [p.detach().clone() for p in model.parameters()], norms


@pytest.mark.parametrize("api", ["max_grad_norm", "clip_grad_norm_"])
def test_global_norm_clipping_over_groups_equals_torch(rank_pool, api):
    want, want_norms = _torch(2)
    for params, norms in rank_pool(2).run(_ours, api):
        assert norms == pytest.approx(want_norms, rel=1e-5)  # the same norm on every rank: the averaged gradient's
        assert all(n > MAX_NORM for n in want_norms)  # clipping was active
        for a, b in zip(params, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    alone, alone_norms = _ours(api)
    ref, ref_norms = _torch(1)
    assert alone_norms == pytest.approx(ref_norms, rel=1e-5)
    for a, b in zip(alone, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_clip_grad_norm_refuses_other_norms():
    opt = DistributedAdamW(_model().parameters())
    with pytest.raises(ValueError, match="norm_type=1.0"):
        opt.clip_grad_norm_(1.0, norm_type=1.0)


def _local_clip_warns() -> list[str]:
    import warnings

    from cocosync.optim import clip

    clip._WARNED.clear()  # once per process: this pool's ranks may have warned in an earlier test
    model = _model()
    opt = DistributedAdamW(_groups(model), lr=1e-2)
    for i, p in enumerate(model.parameters()):
        p.grad = _grad(p, 0, 0, i)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # still clips (this rank's gradient)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # warned once per process
    opt.step()
    assert float(norm) > MAX_NORM
    return [str(w.message) for w in caught]


def test_torch_clip_grad_norm_on_our_parameters_warns_once_what_it_does(rank_pool):
    for messages in rank_pool(2).run(_local_clip_warns):
        assert len(messages) == 1 and "clips each rank's own gradient" in messages[0]
        assert "opt.clip_grad_norm_(max_norm)" in messages[0]
