"""One test per precondition: each ScheduleError names the directive, the stage and the rule broken."""

import pytest

import cocosync as cs
from cocosync import Local
from cocosync.programs.model_parallel import megatron_mlp_program, pipeline_program
from cocosync.programs.optimizers import adam_program, sgd_program
from cocosync.schedule import Schedule, ScheduleError, as_slice, dce, fuse, overlap, reorder, split
from tests.schedule.golden_cases import momentum_program


def _raises(fn, *parts):
    with pytest.raises(ScheduleError) as e:
        fn()
    for p in parts:
        assert p in str(e.value), str(e.value)
    return e.value


def _split_sgd():
    p, rs, ag = split(sgd_program(8), "all_reduce1")
    return p, rs, ag


def test_unknown_stage():
    _raises(lambda: split(sgd_program(8), "nope"), "split", "'nope'", "not a stage")


def test_split_not_all_reduce():
    _raises(lambda: split(sgd_program(8), "mul1"), "split: stage 'mul1'", "is a mul, not an all_reduce")


def test_split_scalar_all_reduce():
    x = cs.Tensor("x", 8, layout=Local)
    p = cs.Program("s", [x], [cs.all_reduce(cs.norm(x))])
    _raises(lambda: split(p, "all_reduce1"), "scalar all_reduce")


def test_split_bad_dim():
    _raises(lambda: split(sgd_program(8), "all_reduce1", dim=1), "dim=1 is out of range")


def test_reorder_not_all_gather():
    p, rs, ag = _split_sgd()
    _raises(lambda: reorder(p, ["mul1"], rs), f"stage {rs!r}", "not an all_gather")


def test_reorder_through_local():
    g, w = cs.Tensor("g", 8, layout=Local), cs.Tensor("w", 8)
    ar = cs.all_reduce(g)
    p, _, ag = split(cs.Program("p", [g, w], {"y": ar + g}), "all_reduce1")
    _raises(lambda: reorder(p, ["add1"], ag), "reorder: stage 'add1'", "Local tensor 'g'")


def test_reorder_not_connected():
    p, _, ag = split(adam_program(8), "all_reduce1")
    _raises(lambda: reorder(p, ["mul4", "mul6"], ag), "stage 'mul6'", "not connected")  # beta2 * v: no path
    assert reorder(p, ["mul4", "div2"], ag)  # endpoints: the stages between them are taken (schedule/endpoints.py)


def test_reorder_non_elementwise():
    p = megatron_mlp_program(8, 8, 16)
    p, rs, ag = split(p, "all_reduce1")
    _raises(lambda: reorder(p, ["add1", "matmul1"], ag), "stage 'matmul1'", "is a matmul")


def test_reorder_the_all_gather_itself():
    p, _, ag = _split_sgd()
    _raises(lambda: reorder(p, [ag], ag), "is the all_gather itself")


def test_as_slice_not_replicated():
    p = sgd_program(8)
    _raises(lambda: as_slice(p, ["g"]), "as_slice: stage 'g'", "is L, not Replicated")


def test_as_slice_not_an_input():
    _raises(lambda: as_slice(sgd_program(8), ["mul1"]), "stage 'mul1'", "re-declares a Replicated tensor input")


def test_as_slice_read_as_replicated():
    p, _, ag = split(momentum_program(), "all_reduce1")
    _raises(lambda: as_slice(p, ["buf"]), "as_slice: stage 'mul1'", "reads 'buf' as Replicated")


def test_as_slice_replicated_update_value():
    x = cs.Tensor("x", 8)
    p = cs.Program("p", [x], [cs.update(x, cs.all_gather(cs.scatter(x)) + 1.0)])
    _raises(lambda: as_slice(p, ["x"]), "stage 'x_new'", "Replicated value 'add1'")


def test_fuse_cycle():
    p = sgd_program(8)
    g, w = cs.Tensor("g", 8, layout=Local), cs.Tensor("w", 8)
    a = w * 2.0
    b = cs.all_reduce(g * a)  # a -> mul(g, a) -> all_reduce -> c
    p = cs.Program("cyc", [g, w], {"c": a + b})
    _raises(lambda: fuse(p, ["mul1", "add1"]), "fuse: stage", "would form a cycle")


def test_fuse_not_connected():
    _raises(lambda: fuse(adam_program(8), ["mul1", "mul3"]), "fuse", "is not connected")


def test_fuse_bad_collective():
    # an all_reduce fuses with computations (split implicitly); a send inside the group does not
    _raises(lambda: fuse(pipeline_program(8, 8), ["all_reduce1", "send1"]), "stage 'send1'", "is a send",
            "one reduce_scatter")


def test_fuse_matmul():
    p = megatron_mlp_program(8, 8, 16)
    _raises(lambda: fuse(p, ["matmul1", "maximum1"]), "stage 'matmul1'", "is a matmul")


def test_fuse_twice():
    p = fuse(sgd_program(8), ["mul1", "sub1"])
    _raises(lambda: fuse(p, ["sub1", "w_new"]), "stage 'sub1'", "already in group")


def test_fuse_reads_all_gather_inside():
    p, rs, ag = _split_sgd()
    _raises(lambda: fuse(p, [rs, ag, "mul1"]), "stage 'mul1'", f"reads all_gather {ag!r} inside the group")


def test_fuse_too_small():
    _raises(lambda: fuse(sgd_program(8), ["mul1"]), "at least 2 stages")


def test_overlap_not_a_chain():
    p = megatron_mlp_program(8, 8, 16)
    _raises(lambda: overlap(p, ["matmul2", "add1"]), "overlap: stage 'add1'", "does not read 'matmul2'")


def _megatron_fused_rs_ag():
    s = Schedule(megatron_mlp_program(8, 8, 16))
    rs, ag = s.split("all_reduce1")
    s.reorder(s.movable(ag), ag)
    return s, rs, s.stages(ops=["all_gather"])[0]


def test_overlap_takes_a_fuse_group_whole():
    s, rs, ag = _megatron_fused_rs_ag()
    s.fuse([rs, ag])
    s.overlap(["matmul2", rs], chunks=2)  # naming one stage of the fuse group takes all of it
    over = next(g for g in s.program.groups if g.kind == "overlap")
    assert over.stages == ("matmul2", rs, "add1", "dropout1", "x_s", "add2", ag)


def test_fuse_partly_inside_an_overlap():
    s, rs, ag = _megatron_fused_rs_ag()
    s.overlap(["matmul2", rs, "add1", "dropout1", "add2", ag], chunks=2)
    # the fused collective takes scatter(x), which the overlapped chain does not hold
    _raises(lambda: s.fuse([rs, ag]), "fuse: stage 'all_reduce1_rs'", "already in group overlap",
            "fuse first, then overlap")


def test_overlap_crossing_a_fuse_kernel():
    p = fuse(megatron_mlp_program(8, 8, 16), ["add1", "dropout1"])
    # a fuse group whose stages the chain takes whole is one unit; the chain must still read unit after unit
    _raises(lambda: overlap(p, ["matmul2", "dropout1"]), "overlap: stage 'add1'", "does not read 'matmul2'")


def test_overlap_without_communication():
    _raises(lambda: overlap(sgd_program(8), ["mul1", "sub1"]), "has no communication")


def test_overlap_unchunkable():
    x = cs.Tensor("x", 8, layout=Local)
    p = cs.Program("p", [x], [cs.norm(cs.all_reduce(x))])
    _raises(lambda: overlap(p, ["all_reduce1", "norm1"]), "stage 'norm1'", "cannot run by chunks")


def test_overlap_bad_chunks():
    _raises(lambda: overlap(megatron_mlp_program(8, 8, 16), ["matmul2", "all_reduce1"], chunks=0), "chunks")


def test_dce_unknown_output():
    _raises(lambda: dce(sgd_program(8), keep=["q"]), "dce: stage 'q'", "is not an output")


def test_schedule_records_failed_directive_nowhere():
    s = Schedule(sgd_program(8))
    with pytest.raises(ScheduleError):
        s.split("mul1")
    assert s.directives == [] and s.program is s.original
