"""``cocosync bench dp``: data-parallel optimizer steps and a full train step, ours vs what PyTorch users run today.

Two ranks (RankPool, one intra-op thread each), the same model and the same gradients for every implementation,
timed round-robin within every repeat (a change of machine load hits all of them alike); one sample is the
slowest rank of that iteration; medians are reported.

- **adam**: gradient averaging + Adam step over `layers` x Linear(width, width) (16 x 1024 x 1024: 16.8M params):
  ours (``cocosync.optim.DistributedAdam``: fused shared-memory RS -> Adam -> AG), the runtime primitive it is built
  on (``AdamSlice`` on flat arena buffers), DDP-style (bucketed gloo all_reduce + ``torch.optim.Adam(fused=True)``),
  ZeRO-1 (the same all_reduce + ``ZeroRedundancyOptimizer(Adam)``), FSDP2 (``fully_shard``, a batch-1
  forward/backward/step with the local forward/backward time, measured in the same run, subtracted).
- **lamb**: ours (``DistributedLAMB``: one trust ratio per parameter tensor, as published) vs bucketed gloo
  all_reduce + LAMB with torch._foreach ops computing the same thing; and both with one global ratio.
- **sgd**: ours (``DistributedSGD(momentum=0.9)``) vs bucketed gloo all_reduce + ``torch.optim.SGD(momentum=0.9,
  fused=True)``; its bound is (P + 4) * N * 4 bytes (no second moment).
- **train**: a full step (forward + backward + step) of a small transformer LM: torch DDP + Adam(fused) vs ours
  (the plain model + DistributedAdam, no DDP).

Adam rows are also reported as the fraction of the memory-traffic bound (P + 6) * N * 4 bytes at the memory
bandwidth measured in the same run (both ranks copying at once).
"""

from __future__ import annotations

import os
import statistics
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import click
import torch
import torch.distributed as dist

from cocosync.bench.common import (
    bound_seconds,
    copy_bandwidth,
    fmt_ratio,
    fmt_seconds,
    markdown_table,
    parse_size,
    print_table,
    stats,
    time_interleaved,
    write_json,
)
from cocosync.bench.dp_chart import OURS_OF, SECTIONS, write_png
from cocosync.bench.dp_sweep import parse_batches, show_sweep, sweep_png

__all__ = ["DpConfig", "QUICK", "run_dp", "table_rows", "quick_dp_comparison", "write_png", "dp_cmd"]

OURS = "ours"
LABELS = {
    "ours": "ours: DistributedAdam (fused shm RS->Adam->AG)",
    "adamslice": "runtime AdamSlice (arena grads, node-shared params)",
    "ddp": "DDP-style: bucketed all_reduce(gloo) + Adam(fused)",
    "ddp_cocosync": "DDP-style on the cocosync backend: bucketed all_reduce + Adam(fused)",
    "naive": "one all_reduce(gloo) of all grads, then Adam (foreach, torch's default)",
    "zero": "ZeRO-1: all_reduce(gloo) + ZeroRedundancyOptimizer(Adam)",
    "fsdp2": "FSDP2 fully_shard (fwd/bwd/step b=1 minus local fwd/bwd)",
    "fsdp2_cocosync": "FSDP2 fully_shard on the cocosync backend (the same, minus local fwd/bwd)",
    "lamb_ours": "ours: DistributedLAMB (per-tensor trust ratios)",
    "lamb_base": "bucketed all_reduce(gloo) + foreach LAMB (per-tensor ratios)",
    "lamb_ours_global": "ours: DistributedLAMB(per_tensor=False) (one global ratio)",
    "lamb_base_global": "bucketed all_reduce(gloo) + foreach LAMB (one global ratio)",
    "sgd_ours": "ours: DistributedSGD(momentum=0.9) (fused shm RS->SGD->AG)",
    "sgd_ddp": "DDP-style: bucketed all_reduce(gloo) + SGD(momentum=0.9, fused)",
    "train_ours": "ours: model + DistributedAdam (no DDP)",
    "train_ddp": "torch DDP + Adam(fused)",
}
BASELINE_OF = {"adam": "ddp", "lamb": "lamb_base", "sgd": "sgd_ddp", "train": "train_ddp"}


@dataclass(kw_only=True, slots=True)
class DpConfig:
    """What `cocosync bench dp` measures."""

    layers: int = 16
    """Linear(width, width) layers of the optimizer-step model."""
    width: int = 1024
    """Width of those layers (16 x 1024 x 1024 + biases = 16.8M parameters)."""
    repeats: int = 7
    """Timed repeats per case (after 2 warm-up rounds)."""
    bucket_mb: float = 25.0
    """DDP-style bucket size in MB (DDP's default)."""
    tf_layers: int = 2
    """Small transformer: encoder layers."""
    tf_dim: int = 256
    """Small transformer: model width."""
    tf_seq: int = 64
    """Small transformer: sequence length."""
    tf_batch: int = 8
    """Small transformer: per-rank batch size."""
    tf_vocab: int = 1024
    """Small transformer: vocabulary size."""
    sections: tuple[str, ...] = SECTIONS
    """Which comparisons to run (adam, lamb, train)."""
    baselines: tuple[str, ...] = ("naive", "zero", "fsdp2", "adamslice", "lamb_global", "ddp_cocosync",
                                  "fsdp2_cocosync")
    """Optional rows (ours and the DDP-style / same-math LAMB baselines always run)."""
    kernels: str | None = None
    """Fused-kernel backend of ours (COCOSYNC_KERNELS: inductor or eager); None: the environment's (inductor)."""
    P: int = 2
    """Ranks (all on this machine)."""
    nnodes: int = 1
    """Simulated nodes (torchrun numbering, P / nnodes ranks each): > 1 exercises the cross-node paths (gloo between
    the "nodes"), on this one machine; the memory-traffic bound is then not reported."""
    bw_bytes: int = 256 << 20
    """Bytes each rank copies to measure the memory bandwidth (well above the L3 cache)."""

    def __post_init__(self) -> None:
        for name in ("layers", "width", "repeats", "tf_layers", "tf_dim", "tf_seq", "tf_batch", "tf_vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"DpConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.tf_dim % 4:
            raise ValueError(f"DpConfig.tf_dim={self.tf_dim} must be divisible by the 4 attention heads")
        bad = set(self.sections) - set(SECTIONS)
        if bad:
            raise ValueError(f"DpConfig.sections: unknown {sorted(bad)}; choose from {list(SECTIONS)}")
        bad = set(self.baselines) - {"naive", "zero", "fsdp2", "adamslice", "lamb_global", "ddp_cocosync",
                                     "fsdp2_cocosync"}
        if bad:
            raise ValueError(f"DpConfig.baselines: unknown {sorted(bad)}; choose from naive, zero, fsdp2, "
                             "adamslice, lamb_global, ddp_cocosync, fsdp2_cocosync")
        if self.kernels not in (None, "inductor", "eager"):
            raise ValueError(f"DpConfig.kernels={self.kernels!r}: expected 'inductor', 'eager' or None")
        if self.P < 2:
            raise ValueError(f"DpConfig.P={self.P}: data parallelism needs at least 2 ranks")
        if self.nnodes < 1 or self.P % self.nnodes:
            raise ValueError(f"DpConfig.nnodes={self.nnodes} must be >= 1 and divide P={self.P}")

    @property
    def params(self) -> int:
        return self.layers * (self.width * self.width + self.width)


QUICK = DpConfig(repeats=7, sections=("adam", "train"), baselines=("zero",))
"""The --quick run (and the demo): the full 16.8M-parameter Adam step and the transformer train step, 7 repeats
(3 gave medians that swung 3.0-3.9x between runs);
no LAMB, FSDP2 or AdamSlice rows."""


# ----------------------------------------------------------------------------------------------- per-rank side

def mlp(cfg: DpConfig) -> torch.nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(cfg.width, cfg.width) for _ in range(cfg.layers)])


def set_grads(model: torch.nn.Module, grads: list[torch.Tensor]) -> None:
    """Give every parameter these gradients, in place where .grad already exists (it may be a bucket or arena view)."""
    for p, g in zip(model.parameters(), grads):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)


def _agree(ok: bool) -> bool:
    """True when the case set up on every rank (a case that failed anywhere is dropped everywhere)."""
    t = torch.tensor([0 if ok else 1])
    dist.all_reduce(t)
    return int(t) == 0


class Cases:
    """Set-up of the cases of one section: each either becomes a timed callable or an 'n/a: reason' note."""

    def __init__(self) -> None:
        self.fns: dict[str, Callable[[], Any]] = {}
        self.notes: dict[str, str] = {}

    def add(self, key: str, make: Callable[[], Callable[[], Any]]) -> None:
        fn, err = None, None
        try:
            fn = make()
            fn()  # one trial step: errors surface here, not in the timed loop
        except Exception as e:  # noqa: BLE001 - reported in the table
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
            self.notes[key + ":traceback"] = traceback.format_exc()[-2000:]
        if _agree(err is None):
            self.fns[key] = fn
        else:
            self.notes[key] = "n/a: " + (err or "failed on another rank")


def note_fast(cases: Cases, key: str, opt: Any) -> None:
    """Record which steps of our compiled plan run in a fast (fused) form: the first thing to look at when slow."""
    compiled = getattr(opt, "compiled", None)
    cases.notes[key + ":fast_steps"] = repr(getattr(compiled, "fast_steps", None))


def _ours_adam():
    from cocosync.optim import DistributedAdam  # noqa: PLC0415 - imported on the ranks only

    return DistributedAdam


def _adam_cases(cfg: DpConfig, grads: list[torch.Tensor]) -> Cases:
    cases = Cases()
    bucket = int(cfg.bucket_mb * (1 << 20))
    keep: list[Any] = []  # objects the closures need alive

    def ours():
        model = mlp(cfg)
        opt = _ours_adam()(model.parameters(), lr=1e-4)
        set_grads(model, grads)
        keep.append((model, opt))
        note_fast(cases, "ours", opt)
        return opt.step

    def adamslice():
        from cocosync.bench.adam_slice import AdamSlice
        from cocosync.runtime.comm.collectives import ShmCommunicator

        comm = ShmCommunicator()
        N = cfg.params
        g = comm.arena.empty(N)
        g.copy_(torch.cat([x.reshape(-1) for x in grads]))
        w = comm.arena.shared_empty(N)
        if comm.local_rank == 0:
            w.copy_(torch.cat([p.detach().reshape(-1) for p in mlp(cfg).parameters()]))
        comm.barrier()
        opt = AdamSlice(comm, N, lr=1e-4)
        keep.append((comm, g, w, opt))
        return lambda: opt.step(g, w)

    def bucketed(bucket_bytes: int, make_opt, group=None):
        """A DDP-style step: bucketed all_reduce (mean) of the gradients, then a torch optimizer."""
        from cocosync.bench.baselines import GradBuckets

        model = mlp(cfg)
        set_grads(model, grads)
        buckets = GradBuckets(model.parameters(), bucket_bytes, group=group)
        opt = make_opt(model.parameters())
        keep.append((model, buckets, opt, group))

        def step():
            buckets.all_reduce_mean()
            opt.step()
        return step

    fused_adam = lambda ps: torch.optim.Adam(ps, lr=1e-4, fused=True)  # noqa: E731
    ddp = lambda: bucketed(bucket, fused_adam)  # noqa: E731

    def ddp_cocosync():  # the same, with the gradient all-reduces through the cocosync torch.distributed backend
        from cocosync.runtime.comm.backend import register

        register()
        return bucketed(bucket, fused_adam, group=dist.new_group(backend="cocosync"))

    # what the collectives suite's "gloo all_reduce + torch Adam" row does: one flat all_reduce, foreach Adam
    naive = lambda: bucketed(1 << 62, lambda ps: torch.optim.Adam(ps, lr=1e-4))  # noqa: E731

    def zero():
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return bucketed(bucket, lambda ps: ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.Adam, lr=1e-4,
                                                                   fused=True))

    def fsdp2(backend: str | None = None):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = None
        if backend is not None:  # a mesh over a group of this backend (else the default group's, gloo here)
            from cocosync.runtime.comm.backend import register

            register()
            mesh = DeviceMesh.from_group(dist.new_group(backend=backend), "cpu")
        model = mlp(cfg)
        for layer in model:  # 1 all-gather + 1 reduce-scatter per step, as all_reduce
            fully_shard(layer, reshard_after_forward=False, mesh=mesh)
        fully_shard(model, reshard_after_forward=False, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
        x = torch.randn(1, cfg.width)
        keep.append((model, opt))

        def step():
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        return step

    def local_fwd_bwd():  # subtracted from FSDP2's time: the compute of its batch-1 forward/backward
        model = mlp(cfg)
        x = torch.randn(1, cfg.width)
        keep.append(model)

        def step():
            model(x).sum().backward()
            model.zero_grad()
        return step

    cases.add("ours", ours)
    if "adamslice" in cfg.baselines:
        cases.add("adamslice", adamslice)
    cases.add("ddp", ddp)
    if "ddp_cocosync" in cfg.baselines:
        cases.add("ddp_cocosync", ddp_cocosync)
    if "naive" in cfg.baselines:
        cases.add("naive", naive)
    if "zero" in cfg.baselines:
        cases.add("zero", zero)
    if "fsdp2" in cfg.baselines:
        cases.add("fsdp2", fsdp2)
    if "fsdp2_cocosync" in cfg.baselines:
        cases.add("fsdp2_cocosync", lambda: fsdp2("cocosync"))
    if "fsdp2" in cases.fns or "fsdp2_cocosync" in cases.fns:
        cases.add("fsdp2_local", local_fwd_bwd)
    cases.keep = keep  # type: ignore[attr-defined]
    return cases


def _train_cases(cfg: DpConfig) -> Cases:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cocosync.bench.baselines import small_transformer

    cases = Cases()
    keep: list[Any] = []
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    tokens = torch.randint(0, cfg.tf_vocab, (cfg.tf_batch, cfg.tf_seq), generator=gen)
    targets = torch.randint(0, cfg.tf_vocab, (cfg.tf_batch, cfg.tf_seq), generator=gen)
    loss_fn = torch.nn.CrossEntropyLoss()
    make_model = lambda: small_transformer(vocab=cfg.tf_vocab, d=cfg.tf_dim, layers=cfg.tf_layers,  # noqa: E731
                                           seq=cfg.tf_seq)

    def train_step(model, opt):
        def step():
            opt.zero_grad()
            loss = loss_fn(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            opt.step()
            return loss
        return step

    def ours():
        model = make_model()
        opt = _ours_adam()(model.parameters(), lr=1e-4)
        keep.append((model, opt))
        note_fast(cases, "train_ours", opt)
        return train_step(model, opt)

    def ddp():
        model = DDP(make_model(), gradient_as_bucket_view=True)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
        keep.append((model, opt))
        return train_step(model, opt)

    cases.add("train_ours", ours)
    cases.add("train_ddp", ddp)
    cases.keep = keep  # type: ignore[attr-defined]
    return cases


def _lamb_cases(cfg: DpConfig, grads: list[torch.Tensor]) -> Cases:
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


def _sgd_cases(cfg: DpConfig, grads: list[torch.Tensor]) -> Cases:
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


def _bench_rank(cfg: DpConfig) -> dict[str, Any]:
    """Runs on every rank; returns this rank's samples per section and case, notes, and bandwidth samples."""
    out: dict[str, Any] = {"samples": {}, "notes": {}, "bandwidth": []}
    bw = out["bandwidth"]
    bw.append(copy_bandwidth(cfg.bw_bytes, repeats=3, before=dist.barrier))
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    shapes = [p.shape for p in mlp(cfg).parameters()]
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    for section in cfg.sections:
        if section == "adam":
            cases = _adam_cases(cfg, grads)
        elif section in ("lamb", "sgd"):
            cases = (_lamb_cases if section == "lamb" else _sgd_cases)(cfg, grads)
        else:
            cases = _train_cases(cfg)
        out["notes"].update(cases.notes)
        if cases.fns:
            out["samples"][section] = time_interleaved(cases.fns, cfg.repeats, warmup=2, before=dist.barrier)
        del cases
        dist.barrier()
        bw.append(copy_bandwidth(cfg.bw_bytes, repeats=1, before=dist.barrier))
    return out


# ----------------------------------------------------------------------------------------------- driver side

def run_dp(cfg: DpConfig) -> dict[str, Any]:
    """Run the suite on cfg.P local ranks and summarize: rows per section, ratios, fraction of the Adam bound."""
    from cocosync.bench.baselines import adam_fused_ok
    from cocosync.testing.launch import RankPool

    kernels = cfg.kernels or os.environ.get("COCOSYNC_KERNELS", "inductor")
    with RankPool(cfg.P, nnodes=cfg.nnodes, threads=1, timeout=3600, env={"COCOSYNC_KERNELS": kernels}) as pool:
        per_rank = pool.run(_bench_rank, cfg, timeout=3600)
    bw_samples = [sum(s) for s in zip(*(pr["bandwidth"] for pr in per_rank))]
    bw = statistics.median(bw_samples)
    N = cfg.params
    bound = bound_seconds((cfg.P + 6) * N * 4, bw)
    sgd_bound = bound_seconds((cfg.P + 4) * N * 4, bw)  # P gradient reads; w and the momentum read and written
    notes: dict[str, str] = {}
    for pr in per_rank:
        for k, v in pr["notes"].items():
            notes.setdefault(k, v)
    rows: list[dict[str, Any]] = []
    for section in cfg.sections:
        samples = per_rank[0]["samples"].get(section, {})
        per_iter = {case: [max(s) for s in zip(*(pr["samples"][section][case] for pr in per_rank))]
                    for case in samples}
        if "fsdp2_local" in per_iter:  # FSDP2 comm + step = its step - the local compute
            compute = stats(per_iter.pop("fsdp2_local"))
            for case in ("fsdp2", "fsdp2_cocosync"):
                if case in per_iter:
                    per_iter[case] = [max(t - compute.median, 1e-9) for t in per_iter[case]]
            notes["fsdp2_local_fwd_bwd_s"] = f"{compute.median:.6f}"
        meds = {case: stats(ts) for case, ts in per_iter.items()}
        ours = meds.get(OURS_OF[section])
        base = meds.get(BASELINE_OF[section])
        keys = [k for k in LABELS if k in meds or k in notes]
        keys = [k for k in keys if _section_of(k) == section]
        for key in keys:
            row: dict[str, Any] = {"section": section, "case": key, "label": LABELS[key]}
            if key in meds:
                s = meds[key]
                row.update(s.as_dict())
                row["over_ours"] = s.median / ours.median if ours else None
                row["base_over"] = base.median / s.median if base else None
                sec_bound = sgd_bound if section == "sgd" else bound
                row["bound_over"] = sec_bound / s.median if section != "train" and cfg.nnodes == 1 else None
            else:
                row.update({"median_s": None, "note": notes[key]})
            rows.append(row)
    targets = _targets(rows)
    return {"suite": "dp", "config": asdict(cfg), "P": cfg.P, "threads_per_rank": 1, "params": N,
            "train_params": _train_params(cfg), "bandwidth_Bps": bw, "bandwidth_samples_Bps": bw_samples,
            "bound_bytes": (cfg.P + 6) * N * 4, "bound_s": bound, "sgd_bound_s": sgd_bound,
            "adam_fused": adam_fused_ok(), "kernels": kernels, "rows": rows,
            "targets": targets, "notes": {k: v for k, v in notes.items()}}


def run_train_sweep(cfg, batches: list[int]) -> dict[str, Any]:
    """cfg: a DpConfig (its transformer shape and repeats); one train-section run per per-rank batch size."""
    rows = []
    for b in batches:
        res = run_dp(replace(cfg, sections=("train",), tf_batch=b, bw_bytes=min(cfg.bw_bytes, 16 << 20)))
        med = {r["case"]: r.get("median_s") for r in res["rows"]}
        rows.append({"batch": b, "tokens": b * cfg.tf_seq, "ours_s": med.get("train_ours"),
                     "ddp_s": med.get("train_ddp"), "notes": res["notes"]})
    return {"suite": "dp-train-sweep", "P": cfg.P, "config": {"tf_layers": cfg.tf_layers, "tf_dim": cfg.tf_dim,
            "tf_seq": cfg.tf_seq, "repeats": cfg.repeats}, "target": TARGETS["train"], "rows": rows}


def _section_of(key: str) -> str:
    return next((s for s in ("lamb", "sgd", "train") if key.startswith(s)), "adam")


def _train_params(cfg: DpConfig) -> int:
    from cocosync.bench.baselines import small_transformer

    m = small_transformer(vocab=cfg.tf_vocab, d=cfg.tf_dim, layers=cfg.tf_layers, seq=cfg.tf_seq)
    return sum(p.numel() for p in m.parameters())


TARGETS = {"adam": 4.0, "lamb": 3.0, "train": 1.3}


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for section, want in TARGETS.items():
        r = next((r for r in rows if r["case"] == BASELINE_OF[section] and r.get("median_s")), None)
        o = next((r for r in rows if r["case"] == OURS_OF[section]), None)
        if r is None or o is None:
            continue
        speedup = r["median_s"] / o["median_s"] if o.get("median_s") else None
        out[section] = {"target": want, "speedup": speedup,
                        "met": None if speedup is None else speedup >= want}
    return out


COLUMNS = ["section", "variant", "median", "p10-p90", "time / ours", "baseline / time", "bound / time"]


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    out = []
    for r in result["rows"]:
        if r.get("median_s") is None:
            out.append([r["section"], r["label"], r["note"], "", "", "", ""])
            continue
        out.append([r["section"], r["label"], fmt_seconds(r["median_s"]),
                    f"{fmt_seconds(r['p10_s'])}-{fmt_seconds(r['p90_s'])}", fmt_ratio(r["over_ours"]),
                    fmt_ratio(r["base_over"]), "-" if r["bound_over"] is None else f"{r['bound_over']:.0%}"])
    return out


def caption(result: dict[str, Any]) -> str:
    cfg = result["config"]
    parts = [f"P={result['P']}, 1 thread/rank, ours' kernels: {result.get('kernels')}; "
             f"adam/lamb: {result['params'] / 1e6:.1f}M params "
             f"({cfg['layers']} x Linear({cfg['width']}, {cfg['width']})); bandwidth "
             f"{result['bandwidth_Bps'] / 1e9:.1f} GB/s; bound = (P+6)*N*4 B at "
             f"copy bandwidth = {fmt_seconds(result['bound_s'])} (write-allocate not counted: can exceed 100%); "
             f"train: {result['train_params'] / 1e6:.2f}M-param transformer ({cfg['tf_layers']} layers, "
             f"d={cfg['tf_dim']}, seq {cfg['tf_seq']}, batch {cfg['tf_batch']}/rank)"]
    if any(r["section"] == "sgd" for r in result["rows"]) and "sgd_bound_s" in result:
        parts.append(f"sgd bound = (P+4)*N*4 B = {fmt_seconds(result['sgd_bound_s'])}")
    for section, t in result["targets"].items():
        if t["speedup"] is not None:
            parts.append(f"{section}: {t['speedup']:.2f}x vs target {t['target']}x "
                         f"({'met' if t['met'] else 'MISSED'})")
    return "; ".join(parts)


def show(result: dict[str, Any], console=None, markdown: bool = False) -> None:
    print_table("dp: gradient averaging + optimizer step, and a full train step (median per step)", COLUMNS,
                table_rows(result), console=console, caption=caption(result))
    if markdown:
        click.echo(markdown_table(COLUMNS, table_rows(result)))


def quick_dp_comparison(console=None, kernels: str | None = None) -> dict[str, Any]:
    """The demo's dp comparison (QUICK: ~30-60 s on a loaded 2-core box): the 16.8M-parameter Adam step (ours,
    DDP-style, ZeRO-1) and the small-transformer train step (ours vs DDP), 7 repeats. Prints the table; returns
    the result dict (see run_dp). kernels: ours' fused-kernel backend ('eager' avoids Inductor's cold compile,
    which can outlast the 60 s collective timeout on a fresh machine); None: $COCOSYNC_KERNELS, else inductor."""
    result = run_dp(replace(QUICK, kernels=kernels))
    show(result, console=console)
    return result


@click.command("dp")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write results as JSON (and a PNG bar chart next to it, same name with .png).")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None, help="Bar chart path (PNG).")
@click.option("--quick", is_flag=True, help="Adam and train only, ZeRO-1 the only extra baseline (the demo's variant).")
@click.option("--repeats", type=click.IntRange(1), default=None, help="Timed repeats (default 7).")
@click.option("--layers", type=click.IntRange(1), default=None, help="Linear layers of the Adam/LAMB model (16).")
@click.option("--width", type=click.IntRange(1), default=None, help="Width of those layers (1024).")
@click.option("--tf", "tf", default=None, metavar="LAYERS,DIM,SEQ,BATCH",
              help="Small transformer shape (default 2,256,64,8).")
@click.option("--sections", default=None,
              help="Which comparisons to run: adam, lamb, sgd, train (default all; --quick adam,train).")
@click.option("--kernels", type=click.Choice(["inductor", "eager"]), default=None,
              help="Fused-kernel backend of ours (default: $COCOSYNC_KERNELS, else inductor).")
@click.option("--bw-size", default="256M", show_default=True, help="Bytes per rank of the bandwidth copy.")
@click.option("--tf-batches", default=None, metavar="B1,B2,...",
              help="Sweep the train step over these per-rank batch sizes (ours vs DDP per tokens per rank).")
@click.option("--ranks", type=click.IntRange(2), default=None, help="Ranks on this machine (2).")
@click.option("--nnodes", type=click.IntRange(1), default=None,
              help="Simulated nodes (ranks / nnodes each; gloo between them): the cross-node paths.")
@click.option("--markdown", is_flag=True, help="Also print the table as markdown (for BENCHMARKS.md).")
def dp_cmd(json_path, png_path, quick, repeats, layers, width, tf, sections, kernels, bw_size, tf_batches, ranks,
           nnodes, markdown) -> None:
    """Data-parallel Adam/LAMB steps and a train step: ours vs DDP-style gloo, ZeRO, FSDP2 (2 ranks)."""
    cfg = QUICK if quick else DpConfig()
    over: dict[str, Any] = {"kernels": kernels} if kernels else {}
    if sections:
        over["sections"] = tuple(s.strip() for s in sections.split(",") if s.strip())
    try:
        over["bw_bytes"] = parse_size(bw_size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--bw-size") from None
    if repeats:
        over["repeats"] = repeats
    if ranks:
        over["P"] = ranks
    if nnodes:
        over["nnodes"] = nnodes
    if layers:
        over["layers"] = layers
    if width:
        over["width"] = width
    if tf:
        try:
            tl, td, ts, tb = (int(v) for v in tf.split(","))
        except ValueError:
            raise click.BadParameter(f"{tf!r}: expected 4 integers LAYERS,DIM,SEQ,BATCH (e.g. 2,256,64,8)",
                                     param_hint="--tf") from None
        over.update(tf_layers=tl, tf_dim=td, tf_seq=ts, tf_batch=tb)
    try:
        cfg = replace(cfg, **over)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if tf_batches:
        sweep = run_train_sweep(cfg, parse_batches(tf_batches))
        show_sweep(sweep, markdown=markdown)
        if json_path:
            click.echo(f"wrote {write_json(json_path, sweep)}")
            png_path = png_path or str(Path(json_path).with_suffix(".png"))
        if png_path:
            click.echo(f"wrote {sweep_png(sweep, png_path)}")
        return
    result = run_dp(cfg)
    show(result, markdown=markdown)
    if json_path:
        write_json(json_path, result)
        click.echo(f"wrote {json_path}")
        png_path = png_path or str(Path(json_path).with_suffix(".png"))
    if png_path:
        write_png(result, png_path)
        click.echo(f"wrote {png_path}")
