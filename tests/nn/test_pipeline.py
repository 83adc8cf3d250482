"""PipelineSend on 4 ranks (2 stages x 2) equals the single-process computation: the next stage receives
dropout(sum of the partials + bias), the first stage receives zeros; backward sends gradients back (slices +
all_gather) and gives dy = dRecv * mask, db = sum(dRecv * mask). The mask-input program equals the paper's
pipeline program (DSL dropout) under the interpreter."""

import pytest
import torch

import cocosync as cs
from cocosync.interp import dropout_mask
from cocosync.nn import PipelineSend, pipeline_send_program
from cocosync.programs.model_parallel import pipeline_program

H, P, G = 16, 4, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def _y(rank, rows):
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(10 + rank))


def _bias():
    return torch.randn(H, generator=torch.Generator().manual_seed(9))


def _c(rows):
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(7))


def _on_rank():
    import torch.distributed as dist

    rank = dist.get_rank()
    stage = rank // G
    mod = PipelineSend(H, stages=2, p=0.25, seed=4, chunks=2)
    with torch.no_grad():
        mod.bias.copy_(_bias())
    out = []
    for rows in (8, 5):  # 5: rows not divisible by the stage size -> whole all_reduce, full send
        y = (_y(rank, rows) if stage == 0 else torch.zeros(rows, H)).requires_grad_()
        mod.bias.grad = None
        recv = mod(y)
        recv.backward(_c(rows) if stage == 1 else torch.zeros_like(recv))  # stage 1's loss: (recv * c).sum()
        out.append({"recv": recv.detach(), "dy": y.grad, "db": mod.bias.grad.clone()})
    with torch.no_grad():
        ev = mod.eval()(_y(rank, 8) if stage == 0 else torch.zeros(8, H))
    fast = [s for plan in mod._plans.plans.values() for s in plan.fast_steps]
    return {"calls": out, "eval": ev, "fast": fast}


def test_pipeline_send_2x2_matches_single_process(rank_pool):
    got = rank_pool(P).run(_on_rank)
    for i, rows in enumerate((8, 5)):
        mask = dropout_mask((rows, H), 0.25, 4 + i).float() / 0.75
        y = [_y(r, rows).requires_grad_() for r in range(G)]
        b = _bias().requires_grad_()
        recv = (y[0] + y[1] + b) * mask
        (recv * _c(rows)).sum().backward()
        for r in range(P):
            res = got[r]["calls"][i]
            if r < G:
                torch.testing.assert_close(res["recv"], torch.zeros(rows, H))
                torch.testing.assert_close(res["dy"], y[r].grad, **TOL)
                torch.testing.assert_close(res["db"], b.grad, **TOL)
            else:
                torch.testing.assert_close(res["recv"], recv.detach(), **TOL)
                torch.testing.assert_close(res["dy"], torch.zeros(rows, H))
                torch.testing.assert_close(res["db"], torch.zeros(H))
    want_eval = _y(0, 8) + _y(1, 8) + _bias()
    for r in range(G, P):
        torch.testing.assert_close(got[r]["eval"], want_eval, **TOL)
        assert any(s.startswith("overlap(") for s in got[r]["fast"]), got[r]["fast"]


def _bad_stages():
    with pytest.raises(ValueError, match="stages=3 must be >= 2 and divide the world size 4"):
        PipelineSend(H, stages=3)
    return True


def test_pipeline_send_bad_inputs(rank_pool):
    assert rank_pool(P).run(_bad_stages) == [True] * P
    with pytest.raises(RuntimeError, match="not initialized"):
        PipelineSend(H)


def test_pipeline_send_program_equals_paper_program():
    rows, p, seed = 8, 0.25, 5
    ys = [torch.randn(rows, H, generator=torch.Generator().manual_seed(r)) for r in range(P)]
    b = _bias()
    want = cs.interpret(pipeline_program(rows, H, p=p, seed=seed), P, {"y": ys, "b": b})
    mask = dropout_mask((rows, H), p, seed).float() / (1 - p)
    got = cs.interpret(pipeline_send_program(rows, H, 2), P, {"y": ys, "b": b, "mask": mask})
    for r in range(P):
        torch.testing.assert_close(got[r]["recv"], want[r]["recv"], **TOL)
