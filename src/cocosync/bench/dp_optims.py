"""The optimizer sections of `cocosync bench dp` beyond Adam: LAMB and SGD with momentum, each ours vs the same math
after a bucketed gloo all_reduce (DDP-style), on the same model and gradients as the Adam section."""

from __future__ import annotations

from typing import Any

import torch

from cocosync.bench.dp import Cases, DpConfig, mlp, note_fast, set_grads

__all__ = ["lamb_cases", "sgd_cases"]


def lamb_cases(cfg: DpConfig, grads: list[torch.Tensor]) -> Cases:
    """DistributedLAMB (per-tensor ratios, and one global ratio) vs bucketed gloo all_reduce + foreach LAMB."""
    from cocosync.bench.baselines import ForeachLAMB, GradBuckets

    cases = Cases()
    keep: list[Any] = []

    def ours(per_tensor: bool, key: str):
        from cocosync.optim import DistributedLAMB

        model = mlp(cfg)
        opt = DistributedLAMB(model.parameters(), lr=1e-4, per_tensor=per_tensor)
        set_grads(model, grads)
        keep.append((model, opt))
        note_fast(cases, key, opt)
        return opt.step

    def base(per_tensor: bool):
        model = mlp(cfg)
        set_grads(model, grads)
        buckets = GradBuckets(model.parameters(), int(cfg.bucket_mb * (1 << 20)))
        opt = ForeachLAMB(model.parameters(), lr=1e-4, per_tensor=per_tensor)
        keep.append((model, buckets, opt))

        def step():
            buckets.all_reduce_mean()
            opt.step()
        return step

    cases.add("lamb_ours", lambda: ours(True, "lamb_ours"))
    cases.add("lamb_base", lambda: base(True))
    if "lamb_global" in cfg.baselines:
        cases.add("lamb_ours_global", lambda: ours(False, "lamb_ours_global"))
        cases.add("lamb_base_global", lambda: base(False))
    cases.keep = keep  # type: ignore[attr-defined]
    return cases


def sgd_cases(cfg: DpConfig, grads: list[torch.Tensor]) -> Cases:
    """DistributedSGD(momentum=0.9) vs bucketed gloo all_reduce + torch.optim.SGD(momentum=0.9, fused=True)."""
    from cocosync.bench.baselines import GradBuckets
    from cocosync.optim import DistributedSGD

    cases = Cases()
    keep: list[Any] = []

    def ours():
        model = mlp(cfg)
        opt = DistributedSGD(model.parameters(), lr=1e-3, momentum=0.9)
        set_grads(model, grads)
        keep.append((model, opt))
        note_fast(cases, "sgd_ours", opt)
        return opt.step

    def ddp():
        model = mlp(cfg)
        set_grads(model, grads)
        buckets = GradBuckets(model.parameters(), int(cfg.bucket_mb * (1 << 20)))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, fused=True)
        keep.append((model, buckets, opt))

        def step():
            buckets.all_reduce_mean()
            opt.step()
        return step

    cases.add("sgd_ours", ours)
    cases.add("sgd_ddp", ddp)
    cases.keep = keep  # type: ignore[attr-defined]
    return cases
