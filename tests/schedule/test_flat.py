"""Flat slicing (CoCoNeT slices flat): a tensor no dimension of which divides by the group size is sliced as runs of
its elements. A 2-D momentum update with dropout, split flat, reordered, kept sliced and fused, equals the program as
written under the interpreter and on real ranks (fused fast form and stage by stage); the errors name the rule."""

import pytest
import torch

import cocosync as cs
from cocosync import FLAT, Local
from cocosync.dsl import DslError
from cocosync.interp import rank_inputs
from cocosync.schedule import Schedule, ScheduleError

SHAPE = (6, 10)  # on 4 ranks: 6 % 4 and 10 % 4 != 0, 60 % 4 == 0


def _program(shape=SHAPE, dropout=True):
    g, w, m = cs.Tensor("g", shape, layout=Local), cs.Tensor("w", shape), cs.Tensor("m", shape)
    r, lr = cs.Tensor("r", shape), cs.Scalar("lr")
    g1 = cs.all_reduce(g, "mean") + r
    g1 = cs.dropout(g1, 0.25, 7) if dropout else g1
    m1 = cs.update(m, 0.9 * m + g1)
    return cs.Program("mom2d", [g, w, m, r, lr], [cs.update(w, w - lr * m1), m1])


def _schedule(program):
    s = Schedule(program)
    rs, ag = s.split("all_reduce1", dim=FLAT)
    s.reorder(s.movable(ag), ag)
    s.as_slice(["m"])
    s.fuse(s.stages())
    return s


def _inputs(P, shape=SHAPE):
    gen = torch.Generator().manual_seed(3)
    rand = lambda: torch.randn(shape, generator=gen)  # noqa: E731
    return {"g": [rand() for _ in range(P)], "w": rand(), "m": rand(), "r": rand(), "lr": 0.1}


def _want(P, dropout=True):
    """The program as written, per rank, with m as this rank's flat slice (as the schedule keeps it)."""
    want = cs.interpret(_program(dropout=dropout), P, _inputs(P))
    return [{"w": o["w"], "m": o["m"].reshape(-1).chunk(P)[r]} for r, o in enumerate(want)]


@pytest.mark.parametrize("P", [2, 4])
def test_flat_schedule_matches_interpreter(P):
    s = _schedule(_program())
    assert str(s.program.stage("all_reduce1_rs").layout) == "S[flat]"
    got = cs.interpret(s.program, P, _inputs(P))
    for r, want in enumerate(_want(P)):
        assert got[r]["m"].shape == (60 // P,)
        for k in want:
            torch.testing.assert_close(got[r][k], want[k], msg=lambda m: f"{k} rank {r}: {m}")


def _on_rank(fast: bool):
    """fast: the fused form (its kernels hold no dropout: the program without it); else stage by stage, dropout's
    mask cut flat like the values."""
    import torch.distributed as dist

    P, rank = dist.get_world_size(), dist.get_rank()
    s = _schedule(_program(dropout=not fast))
    fn = cs.compile_scheduled(s, fast=fast)
    out = fn(**rank_inputs(s.program, P, _inputs(P), rank))
    return {"out": {k: v.clone() for k, v in out.items()}, "fast": fn.fast_steps}


@pytest.mark.parametrize("P", [2, 4])
def test_flat_schedule_on_real_ranks(rank_pool, P):
    pool = rank_pool(P)
    for fast in (True, False):
        got = pool.run(_on_rank, fast)
        for r, want in enumerate(_want(P, dropout=not fast)):
            if fast:  # the fused shared-memory collective runs flat slices as it runs dim-0 slices
                assert any(x.startswith("fused_collective(") for x in got[r]["fast"]), got[r]["fast"]
            for k in want:
                torch.testing.assert_close(got[r]["out"][k], want[k], msg=lambda m: f"fast={fast} {k} rank {r}: {m}")


def test_flat_slices_of_a_vector_are_dim_0():
    assert cs.Tensor("v", 8, layout=cs.Sliced(FLAT)).layout == cs.Sliced(0)
    assert cs.reduce_scatter(cs.Tensor("g", 8, layout=Local), dim=FLAT).layout == cs.Sliced(0)


def test_flat_errors():
    with pytest.raises(DslError, match="must be an int >= 0 or 'flat'"):
        cs.Sliced("rows")
    # a bias broadcast over rows cannot meet a run of elements
    g, b = cs.Tensor("g", SHAPE, layout=Local), cs.Tensor("b", SHAPE[1:])
    p = cs.Program("bias", [g, b], {"y": cs.all_reduce(g) + b})
    s = Schedule(p)
    rs, ag = s.split("all_reduce1", dim=FLAT)
    with pytest.raises(ScheduleError, match=r"reorder: stage 'add1' cannot run on slices: .*would be broadcast"):
        s.reorder(["add1"], ag)
    with pytest.raises(DslError, match="matmul: .* is sliced flat"):
        cs.reduce_scatter(g, dim=FLAT) @ cs.Tensor("w", (10, 3))
    # 15 elements do not split over 2 ranks; the error says so
    odd = Schedule(_program((5, 3)))
    odd.split("all_reduce1", dim=FLAT)
    with pytest.raises(DslError, match="15 elements; make the element count a multiple of 2"):
        cs.interpret(odd.program, 2, _inputs(2, (5, 3)))
    # slicing along a dim that does not divide suggests flat slicing when the element count does
    rows = Schedule(_program())
    rows.split("all_reduce1")
    with pytest.raises(DslError, match=r"slice flat \(split\(..., dim=FLAT\)\)"):
        cs.interpret(rows.program, 4, _inputs(4))


def test_tuner_space_slices_flat_where_no_dim_divides():
    from cocosync.schedule import replay
    from cocosync.tune.space import schedule_space

    program = _program(dropout=False)
    space = schedule_space(program, ("m",), world=4)
    assert [c.name for c in space][-1] == "split+reorder+as_slice+fuse"
    assert all(c.directives[0].dim == FLAT for c in space[1:])
    assert schedule_space(program, ("m",), world=2)[1].directives[0].dim == 0  # 6 rows split over 2 ranks
    want = _want(4, dropout=False)
    for c in space:
        got = cs.interpret(replay(program, c.directives), 4, _inputs(4))
        for r in range(4):
            m = got[r]["m"] if got[r]["m"].ndim == 1 else got[r]["m"].reshape(-1).chunk(4)[r]
            torch.testing.assert_close(m, want[r]["m"], msg=lambda x: f"{c.name} rank {r}: {x}")
            torch.testing.assert_close(got[r]["w"], want[r]["w"], msg=lambda x: f"{c.name} rank {r}: {x}")
