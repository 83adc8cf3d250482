"""GPU paths (skipped without CUDA; CI has none): fused kernels through Inductor/Triton and the executor on an
NCCL process group, both against the interpreter on CPU."""

import datetime

import pytest
import torch

import cocosync as cs
from cocosync.programs.optimizers import adam_program, adam_scalars
from cocosync.runtime.steps.codegen import build_kernel, can_fuse

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
N = 1 << 16


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return {"g": [torch.randn(N, generator=gen)], "w": torch.randn(N, generator=gen), "m": torch.rand(N, generator=gen),
            "v": torch.rand(N, generator=gen), **adam_scalars(3, lr=0.01)}


def test_inductor_kernel_on_cuda_matches_interpreter():
    p = adam_program(N)
    k = build_kernel([s for s in p.stages if can_fuse(s)], [p.updates[n] for n in ("w", "m", "v")],
                     backend="inductor", name="adam_cuda")
    inputs = _inputs()
    want = cs.interpret(p, 1, inputs)[0]
    env = {n: (torch.tensor(v) if isinstance(v, float) else v) for n, v in inputs.items() if n != "g"}
    env["all_reduce1"] = inputs["g"][0]
    got = k(*(env[a.name].cuda() for a in k.inputs))
    for name, t in zip(("w", "m", "v"), got):
        assert t.is_cuda
        torch.testing.assert_close(t.cpu(), want[name], rtol=1e-5, atol=1e-6)


def test_executor_on_nccl_matches_interpreter(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.cuda.set_device(0)
        inputs = _inputs()
        want = cs.interpret(adam_program(N), 1, inputs)[0]
        for fn in (cs.compile(adam_program(N)), cs.compile_scheduled(cs.schedule.adam_schedule(adam_program(N)))):
            assert fn.comm.backend == "torch"
            local = {k: (v[0] if k == "g" else v).cuda() if not isinstance(v, float) else v for k, v in inputs.items()}
            out = fn(**local)
            torch.testing.assert_close(out["w"].cpu(), want["w"], rtol=1e-5, atol=1e-6)
            assert out["w"].is_cuda and local["w"].data_ptr() == out["w"].data_ptr()  # updated in place
    finally:
        dist.destroy_process_group()
