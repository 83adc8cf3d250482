"""The mixed-precision / clipping programs, scheduled and run on 2 real ranks, equal the interpreter on the
unscheduled program; with one dtype and no clipping they are the paper's programs."""

import torch

import cocosync as cs
from cocosync.programs.lamb import lamb_program
from cocosync.programs.mixed_precision import adam_mp_program, grad_norm_program, lamb_mp_program, sgd_mp_program
from cocosync.programs.optimizers import adam_program, adam_scalars, sgd_program
from cocosync.schedule.standard import sharded_update_schedule

N, STEPS, BF = 4096, 3, torch.bfloat16
F32 = torch.float32


def _cases():
    """(program, sliced states, scalars) per case."""
    sc = adam_scalars(1, lr=0.01, weight_decay=0.01)
    return [(adam_mp_program(N, BF, F32), ("master", "m", "v"), sc),
            (adam_mp_program(N, F32, clip=True), ("m", "v"), {**sc, "max_norm": 1.0}),
            (lamb_mp_program(N, F32, clip=True), ("m", "v"), {**sc, "max_norm": 1.0}),
            (lamb_mp_program(N, BF, F32, clip=True), ("master", "m", "v"), {**sc, "max_norm": 1.0}),
            (sgd_mp_program(N, BF, F32, momentum=True, weight_decay=True), ("master", "buf"),
             {"lr": 0.1, "mu": 0.9, "wd": 0.01})]


def _grad(step, rank, dtype):
    return (torch.randn(N, generator=torch.Generator().manual_seed(step * 100 + rank)) * 0.3).to(dtype)


def _init(program):
    """Global initial values of the tensor inputs other than g."""
    out = {}
    for x in program.inputs:
        if x.op == "input" and x.ndim and x.name != "g":
            out[x.name] = (torch.linspace(-1, 1, N) if x.name in ("w", "master") else torch.zeros(N)).to(x.dtype)
    return out


def _on_rank():
    import torch.distributed as dist

    from cocosync import compile_plan, lower

    rank, P = dist.get_rank(), dist.get_world_size()
    sl = slice(rank * N // P, (rank + 1) * N // P)
    results = []
    for program, states, scalars in _cases():
        fn = compile_plan(lower(sharded_update_schedule(program, states)), donate=("g",))
        vals = {k: (v[sl].clone() if k in states else v) for k, v in _init(program).items()}
        for step in range(1, STEPS + 1):
            dtype = program.inputs[0].dtype
            g = fn.comm.shm.arena.empty(N, dtype)
            g.copy_(_grad(step, rank, dtype))
            fn(g=g, **vals, **scalars)
        results.append((vals, fn.fast_steps))
    norm_fn = compile_plan(lower(grad_norm_program(N, BF)))
    results.append(float(next(iter(norm_fn(g=_grad(1, rank, BF)).values()))))
    return results


def test_scheduled_programs_match_interpreter(rank_pool):
    got = rank_pool(2).run(_on_rank)
    for i, (program, states, scalars) in enumerate(_cases()):
        vals = _init(program)
        dtype = program.inputs[0].dtype
        for step in range(1, STEPS + 1):
            out = cs.interpret(program, 2, {"g": [_grad(step, r, dtype) for r in range(2)], **vals, **scalars})[0]
            vals = {k: out[k] for k in vals}
        for r in range(2):
            sl = slice(r * N // 2, (r + 1) * N // 2)
            rank_vals, fast = got[r][i]
            for k, v in vals.items():
                tol = dict(rtol=1e-2, atol=1e-2) if v.dtype == BF else dict(rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(rank_vals[k], v[sl] if k in states else v, **tol, msg=f"{program.name} {k}")
            # every case is one fused shared-memory collective (with norms: in phases,
            # runtime/steps/fused_collective.py)
            assert len(fast) == 1 and fast[0].startswith("fused_collective"), (program.name, fast)
    ref = torch.stack([_grad(1, r, BF).float() for r in range(2)]).mean(0).to(BF).float().norm()
    assert abs(got[0][-1] - float(ref)) < 1e-3 * float(ref) and got[0][-1] == got[1][-1]


def test_paper_programs_when_plain():
    assert str(adam_mp_program(64)).replace("adam", "") == str(adam_program(64)).replace("adam", "")
    assert str(lamb_mp_program(64)) == str(lamb_program(64))
    assert str(sgd_mp_program(64, momentum=True)) == str(sgd_program(64, momentum=True))
