"""Plans with fast steps (fused kernels, fused shared-memory RS -> compute -> AG) equal the interpreter on the
unscheduled program, on 2 and 4 ranks and on the 2 x 2 hierarchical layout."""

import pytest
import torch

import cocosync as cs
from cocosync.programs.model_parallel import megatron_mlp_program  # noqa: F401 - importable by ranks
from cocosync.programs.optimizers import adam_program, adam_scalars, sgd_program
from cocosync.schedule.standard import adam_schedule, sgd_schedule

N, STEPS = 4096, 3


def _grad(step, rank, dtype, n=N):
    return torch.randn(n, generator=torch.Generator().manual_seed(step * 100 + rank)).to(dtype)


def _adam_on_rank(dtype, nnodes):
    import torch.distributed as dist

    from cocosync import compile_plan, lower

    rank, P = dist.get_rank(), dist.get_world_size()
    fn = compile_plan(lower(adam_schedule(adam_program(N, dtype))))
    sl = slice(rank * N // P, (rank + 1) * N // P)
    w = torch.linspace(-1, 1, N).to(dtype)
    m, v = torch.zeros(N, dtype=dtype)[sl].clone(), torch.zeros(N, dtype=dtype)[sl].clone()
    for step in range(1, STEPS + 1):
        fn(g=_grad(step, rank, dtype), w=w, m=m, v=v, **adam_scalars(step, lr=0.01, weight_decay=0.01))
    # the same with gradients in shared memory, donated: reduced in place (zero-copy)
    donated = compile_plan(lower(adam_schedule(adam_program(N, dtype))), donate=("g",))
    g_arena = donated.comm.shm.arena.empty(N, dtype)
    w2, m2, v2 = torch.linspace(-1, 1, N).to(dtype), torch.zeros_like(m), torch.zeros_like(v)
    for step in range(1, STEPS + 1):
        g_arena.copy_(_grad(step, rank, dtype))
        donated(g=g_arena, w=w2, m=m2, v=v2, **adam_scalars(step, lr=0.01, weight_decay=0.01))
    sgd = compile_plan(lower(sgd_schedule(sgd_program(N, dtype, momentum=True))))
    ws, buf = torch.linspace(-1, 1, N).to(dtype), torch.zeros(N, dtype=dtype)[sl].clone()  # buf is sliced
    for step in range(1, STEPS + 1):
        sgd(g=_grad(step, rank, dtype), w=ws, buf=buf, lr=0.1, mu=0.9)
    return {"w": w, "m": m, "v": v, "ws": ws, "donated": (w2, m2, v2), "fast": fn.fast_steps,
            "fast_sgd": sgd.fast_steps,
            "backend": fn.comm.backend}


def _oracle(P, dtype, n=N):
    adam, sgd = adam_program(n, dtype), sgd_program(n, dtype, momentum=True)
    w, m, v = torch.linspace(-1, 1, n).to(dtype), torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
    ws, buf = torch.linspace(-1, 1, n).to(dtype), torch.zeros(n, dtype=dtype)
    for step in range(1, STEPS + 1):
        gs = [_grad(step, r, dtype, n) for r in range(P)]
        o = cs.interpret(adam, P, {"g": gs, "w": w, "m": m, "v": v, **adam_scalars(step, lr=0.01, weight_decay=0.01)})
        w, m, v = o[0]["w"], o[0]["m"], o[0]["v"]
        o = cs.interpret(sgd, P, {"g": gs, "w": ws, "buf": buf, "lr": 0.1, "mu": 0.9})
        ws, buf = o[0]["w"], o[0]["buf"]
    return w, m, v, ws


@pytest.mark.parametrize("P, nnodes, dtype", [(2, 1, torch.float32), (4, 1, torch.float32), (4, 2, torch.float32),
                                              (2, 1, torch.bfloat16)])
def test_scheduled_plans_match_oracle(rank_pool, P, nnodes, dtype):
    got = rank_pool(P, nnodes=nnodes).run(_adam_on_rank, dtype, nnodes)
    w, m, v, ws = _oracle(P, dtype)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    for r, out in enumerate(got):
        sl = slice(r * N // P, (r + 1) * N // P)
        torch.testing.assert_close(out["w"], w, **tol)
        torch.testing.assert_close(out["m"], m[sl], **tol)
        torch.testing.assert_close(out["v"], v[sl], **tol)
        torch.testing.assert_close(out["ws"], ws, **tol)
        for a, b in zip(out["donated"], (out["w"], out["m"], out["v"])):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert out["backend"] == "shm"
        assert out["fast"], out["fast"]  # across nodes too: hierarchical reduce-scatter, kernel, all-gather


def _fused_reduction_on_rank(dtype, fuse, n):
    """The Adam plan as DistributedAdam runs it (gradients donated in the arena, w node-shared), with the reduction
    inside the kernel (fuse) or before it."""
    import torch.distributed as dist

    from cocosync import compile_plan, lower

    rank = dist.get_rank()
    plan = compile_plan(lower(adam_schedule(adam_program(n, dtype))), donate=("g",), fuse_reduction=fuse)
    shm = plan.comm.shm
    g, w = shm.arena.empty(n, dtype), shm.arena.shared_empty(n, dtype)
    w.copy_(torch.linspace(-1, 1, n).to(dtype))
    shm.barrier()
    m, v = (torch.zeros(n // dist.get_world_size(), dtype=dtype) for _ in range(2))
    untouched = True
    for step in range(1, STEPS + 1):
        g.copy_(_grad(step, rank, dtype, n))
        plan(g=g, w=w, m=m, v=v, **adam_scalars(step, lr=0.01, weight_decay=0.01))
        untouched &= bool(torch.equal(g, _grad(step, rank, dtype, n)))  # no reduced values written back into g
    return {"w": w.clone(), "m": m, "v": v, "g_untouched": untouched, "fast": plan.fast_steps}


@pytest.mark.parametrize("P, dtype", [(2, torch.float32), (3, torch.float32), (2, torch.bfloat16)])
def test_reduction_inside_the_fused_kernel_gives_the_same_bits(rank_pool, P, dtype):
    """Within a node the fused step's kernel reads every rank's gradients and sums them itself (fuse_reduction): the
    same bits as reducing into the gradient buffer first, g left as it was, and the interpreter's result."""
    n = N - N % P  # 4095 on 3 ranks: a mean scaled by 1/3
    fused = rank_pool(P).run(_fused_reduction_on_rank, dtype, True, n)
    first = rank_pool(P).run(_fused_reduction_on_rank, dtype, False, n)
    w, m, v = _oracle(P, dtype, n)[:3]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    for r, (a, b) in enumerate(zip(fused, first)):
        assert any(s.startswith("fused_collective") for s in a["fast"]), a["fast"]
        assert a["g_untouched"] and not b["g_untouched"]
        for k in ("w", "m", "v"):
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
        sl = slice(r * n // P, (r + 1) * n // P)
        torch.testing.assert_close(a["w"], w, **tol)
        torch.testing.assert_close(a["m"], m[sl], **tol), torch.testing.assert_close(a["v"], v[sl], **tol)


def _norm_step_on_rank(fuse):
    """DistributedAdam and DistributedLAMB with clipping (the phased fused collective,
    runtime/steps/fused_collective.py) with
    phase 0's kernel reducing the gradients itself (fuse) or the collective reducing them first."""
    import os

    import torch.distributed as dist

    import cocosync.runtime.steps.fused_collective as ns
    from cocosync.optim import DistributedAdam, DistributedLAMB

    built = []
    real = ns.build_kernel

    def recording(*a, **kw):
        built.append(kw.get("name"))
        return real(*a, **kw)
    ns.build_kernel = recording
    os.environ["COCOSYNC_FUSE_REDUCTION"] = "1" if fuse else "0"  # the optimizers' plans take the default
    try:
        out = {}
        for cls in (DistributedAdam, DistributedLAMB):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 7))
            opt = cls(model.parameters(), lr=1e-2, max_grad_norm=0.05)
            for step in range(3):
                gen = torch.Generator().manual_seed(10 * step + dist.get_rank())
                for p in model.parameters():
                    p.grad.copy_(torch.randn(p.shape, generator=gen))
                opt.step()
            out[cls.__name__] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    finally:
        ns.build_kernel = real
        os.environ.pop("COCOSYNC_FUSE_REDUCTION")
    out["one_pass_kernels"] = sum(1 for n in built if n and n.endswith("_0_src"))
    return out


def test_phased_fused_collective_reducing_in_its_first_kernel_gives_the_same_bits(rank_pool):
    """With norms (clipping, LAMB), phase 0's kernel sums the ranks' gradient chunks, writes the sum for the later
    phases and takes the partial norms in the same loop: bitwise what reducing first gives."""
    fused = rank_pool(2).run(_norm_step_on_rank, True)
    first = rank_pool(2).run(_norm_step_on_rank, False)
    for a, b in zip(fused, first):
        assert a["one_pass_kernels"] == 2 and b["one_pass_kernels"] == 0, (a, b)
        for k in ("DistributedAdam", "DistributedLAMB"):
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
