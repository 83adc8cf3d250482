"""Overlap steps run pipelined by chunks (runtime.steps.overlap) equal the interpreter on the unscheduled program:
the Megatron MLP chain on 2 and 4 ranks (shared memory), the pipeline boundary on 2 groups x 2 ranks (torch
backend, send), uneven chunks, bf16; and a chain with no safe chunk dim falls back to the reference."""

import pytest
import torch

import cocosync as cs
from cocosync.dsl import Local, Program, Replicated, Tensor, all_reduce, dropout
from cocosync.interp import rank_inputs
from cocosync.lower import lower
from cocosync.programs.model_parallel import megatron_mlp_program, pipeline_program
from cocosync.runtime.steps.overlap import choose_dim
from cocosync.schedule.standard import megatron_schedule, pipeline_schedule

B, H, F = 8, 48, 64


def _rand(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _flat_program(n=48):
    """all_reduce of a 1-D gradient + bias + dropout: reduce_scatter and all_gather work along the only dim."""
    g, b = Tensor("g", (n,), layout=Local), Tensor("b", (n,), layout=Replicated)
    return Program("flat", [g, b], {"out": dropout(all_reduce(g) + b, 0.2, 3)})


def _fused_megatron(program, chunks):
    """CoCoNeT's ol_MM_fuse_RS_C_AG: the RS -> epilogue -> AG fused collective as one unit of the overlap."""
    return megatron_schedule(program, chunks, fuse=True)


def _cases():
    """name -> (program, schedule function, chunks, global inputs builder(P))."""
    def mlp_inputs(P, dtype=torch.float32):
        return {"x": _rand((B, H), 1, dtype), "w1": _rand((H, F), 2, dtype) / 8, "w2": _rand((F, H), 3, dtype) / 8,
                "b": _rand((H,), 4, dtype)}
    return {
        "megatron": (lambda: megatron_mlp_program(B, H, F, p=0.25, seed=5), megatron_schedule, 4, mlp_inputs),
        "megatron_uneven": (lambda: megatron_mlp_program(B, H, F, p=0.25, seed=6), megatron_schedule, 5, mlp_inputs),
        "megatron_fused": (lambda: megatron_mlp_program(B, H, F, p=0.25, seed=11), _fused_megatron, 3, mlp_inputs),
        "megatron_bf16": (lambda: megatron_mlp_program(B, H, F, p=0.25, seed=7, dtype=torch.bfloat16),
                          megatron_schedule, 3, lambda P: mlp_inputs(P, torch.bfloat16)),
        "pipeline": (lambda: pipeline_program(B, H, p=0.25, seed=8), pipeline_schedule, 4,
                     lambda P: {"y": [_rand((B, H), 10 + r) for r in range(P)], "b": _rand((H,), 9)}),
        "flat": (_flat_program, pipeline_schedule, 4,
                 lambda P: {"g": [_rand((48,), 20 + r) for r in range(P)], "b": _rand((48,), 19)}),
    }


def _record_threads(comm):
    """Wrap comm's collectives to record the names of the threads that call them."""
    import threading

    seen = set()
    for op in ("all_reduce", "reduce_scatter", "all_gather", "send"):
        def wrapped(*a, _f=getattr(comm, op), **k):
            seen.add(threading.current_thread().name.split("_")[0])
            return _f(*a, **k)
        setattr(comm, op, wrapped)
    return seen


def _record_compute_threads():
    """Which thread runs each stage the overlap runner evaluates: stage name -> set of thread names."""
    import threading

    from cocosync.runtime.steps import overlap as mod

    seen: dict = {}
    orig = mod._Pipelined._eval

    def wrapped(self, s, i, env, local):
        seen.setdefault(s.name, set()).add(threading.current_thread().name.split("_")[0])
        return orig(self, s, i, env, local)
    mod._Pipelined._eval = wrapped
    return seen


def _on_rank(names):
    import torch.distributed as dist

    from cocosync import compile_plan, lower

    rank, P = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in names:
        make, sched, chunks, inputs = _cases()[name]
        program = make()
        fn = compile_plan(lower(sched(program, chunks=chunks)))
        given = rank_inputs(program, P, inputs(P), rank)
        threads = _record_threads(fn.comm)
        compute_threads = _record_compute_threads() if name == "megatron_fused" else None
        first = fn(**given)
        again = fn(**given)  # second call: cached masks, same comm thread
        where = compute_threads and {k: set(v) for k, v in compute_threads.items()}
        out[name] = {"out": first, "again": again, "fast": fn.fast_steps, "backend": fn.comm.backend,
                     "threads": threads, "compute_threads": where}
    return out


def _check(got, names, P):
    for name in names:
        make, _, _, inputs = _cases()[name]
        program = make()
        want = cs.interpret(program, P, inputs(P))
        bf16 = program.inputs[0].dtype == torch.bfloat16
        tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-5, atol=1e-5)
        for r, res in enumerate(got):
            overlap = [s for s in res[name]["fast"] if s.startswith("overlap(")]
            if name == "flat":
                assert overlap == [], res[name]["fast"]  # no safe chunk dim: the reference runs it
            else:
                assert len(overlap) == 1, (name, res[name]["fast"])
                assert res[name]["threads"] == {"cocosync-comm"}  # collectives only on the comm thread
            if name == "megatron_fused":  # the epilogue runs inside the fused unit, on the comm thread
                where = res[name]["compute_threads"]
                assert where["matmul2"] == {"MainThread"}, where
                assert where["add1"] == where["dropout1"] == where["add2"] == {"cocosync-comm"}, where
                assert "fused_collective(" in res[name]["fast"][-1], res[name]["fast"]
            for key in ("out", "again"):
                for o in want[r]:
                    torch.testing.assert_close(res[name][key][o], want[r][o], **tol, msg=lambda m: f"{name} r{r}: {m}")


@pytest.mark.parametrize("P, names", [(2, ["megatron", "megatron_uneven", "megatron_fused", "megatron_bf16", "flat"]),
                                      (4, ["megatron", "megatron_uneven", "megatron_fused", "pipeline", "flat"])])
def test_overlap_steps_match_oracle(rank_pool, P, names):
    got = rank_pool(P).run(_on_rank, names)
    _check(got, names, P)
    assert got[0]["megatron"]["backend"] == "shm"
    if "pipeline" in got[0]:
        assert got[0]["pipeline"]["backend"] == "shm"  # each stage's 2 ranks share this node


def test_chunk_dim_choice():
    mlp = lower(megatron_schedule(megatron_mlp_program(B, H, F)))
    step = next(s for s in mlp.steps if str(s).startswith("overlap("))
    d, cuts = choose_dim(step.stages, step.chunks)
    assert d == 1  # the output columns: dim 0 is reduce-scattered / all-gathered
    assert cuts[0] == (None, 1)  # matmul2: maximum1 whole, columns of w2
    flat = lower(pipeline_schedule(_flat_program()))
    step = next(s for s in flat.steps if str(s).startswith("overlap("))
    assert choose_dim(step.stages, step.chunks) is None
