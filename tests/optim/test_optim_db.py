"""torch's own optimizer database (`torch.testing._internal.common_optimizers.optim_db`) driven through ours: every
input of Adam, AdamW and SGD trains like torch's optimizer on averaged gradients, at world size 1 (the local path)
and 2 (the fused collective); every error input raises the exception type torch's does. `optim_db_exceptions.py`
names each input we do not support and why: those must be refused with a clear error, never accepted silently."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db

from cocosync.optim import DistributedAdam, DistributedAdamW, DistributedSGD
from tests.optim.optim_db_exceptions import UNSUPPORTED, UNSUPPORTED_ERRORS

OURS = {"Adam": DistributedAdam, "AdamW": DistributedAdamW, "SGD": DistributedSGD}
INFOS = {o.optim_cls.__name__: o for o in optim_db if o.optim_cls.__name__ in OURS}
STEPS = 3


def _cases(kind: str) -> list:
    out = []
    for name, info in INFOS.items():
        func = info.optim_inputs_func if kind == "inputs" else info.optim_error_inputs_func
        for i, case in enumerate(func("cpu", torch.float32)):
            desc = case.desc if kind == "inputs" else case.optimizer_error_input.desc
            out.append(pytest.param(name, i, id=f"{name}-{desc}"))
    return out


def _input(name: str, i: int):
    return INFOS[name].optim_inputs_func("cpu", torch.float32)[i]


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3)
    return [lin.weight, lin.bias]


def _grad(p: torch.Tensor, step: int, rank: int, i: int) -> torch.Tensor:
    return torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + 10 * i + rank))


def _ours_trajectory(name: str, i: int) -> list[torch.Tensor]:
    """Runs on every rank (or alone): ours on this rank's gradients."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    params = _params()
    opt = OURS[name](params, **_input(name, i).kwargs)
    for step in range(STEPS):
        for k, p in enumerate(params):
            p.grad = _grad(p, step, rank, k)
        opt.step()
    return [p.detach().clone() for p in params]


def _torch_trajectory(name: str, i: int, world: int) -> list[torch.Tensor]:
    params = _params()
    opt = INFOS[name].optim_cls(params, **_input(name, i).kwargs)
    for step in range(STEPS):
        for k, p in enumerate(params):
            p.grad = sum(_grad(p, step, r, k) for r in range(world)) / world
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("name, i", _cases("inputs"))
def test_every_optim_db_input_trains_as_torch(rank_pool, name, i):
    desc = _input(name, i).desc
    if (name, desc) in UNSUPPORTED:
        kwarg = UNSUPPORTED[(name, desc)][0]
        with pytest.raises((TypeError, ValueError), match=kwarg):  # refused by name, never silently ignored
            OURS[name](_params(), **_input(name, i).kwargs)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a default that differs from torch's would warn
        alone = _ours_trajectory(name, i)
    for a, b in zip(alone, _torch_trajectory(name, i, 1)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    want = _torch_trajectory(name, i, 2)
    for got in rank_pool(2).run(_ours_trajectory, name, i):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _error_input(name: str, i: int):
    return INFOS[name].optim_error_inputs_func("cpu", torch.float32)[i]


@pytest.mark.parametrize("name, i", _cases("errors"))
def test_every_optim_db_error_input_raises_as_torch(name, i):
    err = _error_input(name, i)
    case = err.optimizer_error_input
    if (name, case.desc) in UNSUPPORTED_ERRORS:
        pytest.skip(UNSUPPORTED_ERRORS[(name, case.desc)])
    params = case.params if case.params is not None else _params()

    def run() -> None:
        opt = OURS[name](params, **case.kwargs)
        if err.error_on == OptimizerErrorEnum.STEP_ERROR:
            for p in opt.param_groups[0]["params"]:
                p.grad = torch.ones_like(p)
            opt.step()

    if issubclass(err.error_type, Warning):
        with pytest.warns(err.error_type, match=err.error_regex):
            run()
    else:
        with pytest.raises(err.error_type, match=err.error_regex):
            run()
