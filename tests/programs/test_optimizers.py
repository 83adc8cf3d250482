"""The paper's SGD and Adam programs on real ranks match torch.optim on the same (averaged) gradients."""

import pytest
import torch

import cocosync as cs
from cocosync.programs.optimizers import adam_program, adam_scalars, sgd_program

N, STEPS = 64, 5


def _grads(step, rank):
    return torch.randn(N, generator=torch.Generator().manual_seed(1000 * step + rank))


def _run_on_rank(kind):
    import torch.distributed as dist

    rank = dist.get_rank()
    w = torch.linspace(-1, 1, N)
    if kind == "adam":
        fn, state = cs.compile(adam_program(N)), {"m": torch.zeros(N), "v": torch.zeros(N)}
        for step in range(1, STEPS + 1):
            fn(g=_grads(step, rank), w=w, **state, **adam_scalars(step, lr=0.01, weight_decay=0.1))
    else:
        fn, buf = cs.compile(sgd_program(N, momentum=True)), torch.zeros(N)
        for step in range(1, STEPS + 1):
            fn(g=_grads(step, rank), w=w, buf=buf, lr=0.1, mu=0.9)
    return w


def _reference(kind, P):
    w = torch.linspace(-1, 1, N).requires_grad_()
    opt = (torch.optim.AdamW([w], lr=0.01, weight_decay=0.1) if kind == "adam"
           else torch.optim.SGD([w], lr=0.1, momentum=0.9))
    for step in range(1, STEPS + 1):
        w.grad = torch.stack([_grads(step, r) for r in range(P)]).mean(0)
        opt.step()
    return w.detach()


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_matches_torch_optim(rank_pool, kind):
    got = rank_pool(2).run(_run_on_rank, kind)
    want = _reference(kind, 2)
    for w in got:
        torch.testing.assert_close(w, want, rtol=1e-5, atol=1e-6)


def test_interpreter_agrees_with_torch_adam():
    p = adam_program(N)
    w, m, v = torch.linspace(-1, 1, N), torch.zeros(N), torch.zeros(N)
    for step in range(1, STEPS + 1):
        out = cs.interpret(p, 2, {"g": [_grads(step, 0), _grads(step, 1)], "w": w, "m": m, "v": v,
                                  **adam_scalars(step, lr=0.01, weight_decay=0.1)})
        w, m, v = out[0]["w"], out[0]["m"], out[0]["v"]
    torch.testing.assert_close(w, _reference("adam", 2), rtol=1e-5, atol=1e-6)
