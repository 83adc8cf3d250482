"""The programs and schedules behind the golden listings: each returns 'before', the directives and 'after'."""

from __future__ import annotations

import cocosync as cs
from cocosync import Local
from cocosync.lower import lower
from cocosync.programs.model_parallel import megatron_mlp_program, pipeline_program
from cocosync.programs.optimizers import adam_program, sgd_program
from cocosync.schedule import adam_schedule, as_slice, dce, fuse, overlap, reorder, split


def momentum_program():
    g, w, buf = cs.Tensor("g", 8, layout=Local), cs.Tensor("w", 8), cs.Tensor("buf", 8)
    lr, mu = cs.Scalar("lr"), cs.Scalar("mu")
    g1 = cs.all_reduce(g, "mean")
    b1 = cs.update(buf, mu * buf + g1)
    return cs.Program("momentum", [g, w, buf, lr, mu], [cs.update(w, w - lr * b1), b1])


def _pair(before, after, what):
    return f"{before}\n--- {what}\n{after}"


def case_split():
    p = momentum_program()
    q, rs, ag = split(p, "all_reduce1")
    return _pair(p, q, f"split(all_reduce1) -> {rs}, {ag}")


def case_split_flat():
    g, w = cs.Tensor("g", (6, 10), layout=Local), cs.Tensor("w", (6, 10))
    p = cs.Program("flat", [g, w], [cs.update(w, w - 0.1 * cs.all_reduce(g, "mean"))])
    q, rs, ag = split(p, "all_reduce1", dim=cs.FLAT)
    q = reorder(q, ["mul1", "sub1", "w_new"], ag)
    return _pair(p, q, f"split(all_reduce1, dim=FLAT) -> {rs}, {ag}; reorder([mul1, sub1, w_new], {ag})")


def case_reorder():
    p, _, ag = split(momentum_program(), "all_reduce1")
    q = reorder(p, ["mul1", "add1", "buf_new", "mul2", "sub1", "w_new"], ag)
    return _pair(p, q, f"reorder([...], {ag})")


def case_as_slice():
    p, _, ag = split(momentum_program(), "all_reduce1")
    p = reorder(p, ["mul1", "add1", "buf_new", "mul2", "sub1", "w_new"], ag)
    return _pair(p, as_slice(p, ["buf"]), "as_slice([buf])")


def case_fuse():
    p, _, ag = split(momentum_program(), "all_reduce1")
    p = as_slice(reorder(p, ["mul1", "add1", "buf_new", "mul2", "sub1", "w_new"], ag), ["buf"])
    return _pair(p, fuse(p, [s.name for s in p.stages]), "fuse(all stages)")


def case_fuse_kernel():
    p = sgd_program(8)
    return _pair(p, fuse(p, ["mul1", "sub1", "w_new"]), "fuse([mul1, sub1, w_new])")


def case_overlap():
    p = megatron_mlp_program(8, 8, 16)
    return _pair(p, overlap(p, ["matmul2", "all_reduce1", "add1", "dropout1", "add2"], chunks=2),
                 "overlap([matmul2, all_reduce1, add1, dropout1, add2], chunks=2)")


def case_overlap_fused():
    from cocosync.schedule import megatron_schedule

    p = megatron_mlp_program(8, 8, 16)
    s = megatron_schedule(p, chunks=2, fuse=True)
    return f"{p}\n--- {s}\n{s.program}\n--- lower\n{lower(s.program)}"


def case_dce():
    x = cs.Tensor("x", 8, layout=Local)
    y = cs.scatter(cs.all_gather(cs.reduce_scatter(x)))
    p = cs.Program("dce", [x], {"y": y * 2.0, "z": cs.all_reduce(x)})
    return _pair(p, dce(p, keep=["y"]), "dce(keep=[y])")


def case_adam():
    p = adam_program(8)
    s = adam_schedule(p)
    return f"{p}\n--- {s}\n{s.program}\n--- lower\n{lower(s.program)}"


def case_pipeline():
    from cocosync.schedule import pipeline_schedule

    p = pipeline_program(8, 8)
    s = pipeline_schedule(p)
    return f"{p}\n--- {s}\n{s.program}\n--- lower\n{lower(s.program)}"


CASES = {name[5:]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}
