"""``cocosync bench collectives``: shared-memory collectives vs gloo on the local ranks of one node.

Two ranks (RankPool, one intra-op thread each) run, size by size: all_reduce, reduce_scatter and all_gather with
ours on plain tensors (copied in and out of the arena; all_reduce through the native loops, and again through their
Python reference path), ours on arena tensors (zero-copy), DeepSpeed's shared-memory all_reduce where it installs
(bench/peers.py), the same collectives through torch.distributed on a `cocosync` backend group (what DDP and other
clients call), and gloo. The memory bandwidth is measured in the same run (both ranks copying at once), and every
row is also reported as the fraction of its memory-traffic bound reached. Then the fused reduce-scatter + Adam +
all-gather over N fp32 parameters is timed against its (P + 6) * N * 4 bytes bound, and against the unfused
baseline (gloo all_reduce + torch Adam).
"""

from __future__ import annotations

import statistics
from typing import Any

import click
import torch
import torch.distributed as dist

from cocosync.bench.common import (
    bound_seconds,
    copy_bandwidth,
    fmt_bytes,
    fmt_ratio,
    fmt_seconds,
    markdown_table,
    parse_size,
    print_table,
    stats,
    time_interleaved,
    write_json,
)
from cocosync.bench.peers import deepspeed_all_reduce, deepspeed_cleanup
from cocosync.runtime.comm.backend import register

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"
QUICK_SIZES = "4K,64K,1M,16M"
COLUMNS = ["op", "size", "ours", "ours (arena)", "ours (Python path)", "DeepSpeed", "DeepSpeed/ours", "backend", "gloo",
           "gloo/ours", "gloo/arena", "gloo/backend", "bound", "bound/ours", "bound/arena"]


def traffic_bytes(op: str, nbytes: int, P: int) -> float:
    """Bytes that all P ranks together must read + write for the zero-copy form of `op` on an nbytes tensor
    (all_gather: nbytes is the gathered size)."""
    if op == "all_reduce":  # reduce own slice: read P slices, write 1; gather: read + write P-1 slices
        return (3 * P - 1) * nbytes
    if op == "reduce_scatter":
        return (P + 1) * nbytes
    if op == "all_gather":
        return 2 * (P - 1) * nbytes
    raise ValueError(op)


def _repeats_for(nbytes: int, repeats: int) -> int:
    return max(3, min(repeats * 10, int(repeats * (16 << 20) / max(nbytes, 1 << 20))))


def _bench_rank(sizes: list[int], repeats: int, fused_numel: int, chunk_bytes: int) -> dict[str, Any]:
    """Runs on every rank; returns this rank's samples (the caller takes the per-iteration max over ranks)."""
    from cocosync.runtime.comm.collectives import ShmCommunicator

    comm = ShmCommunicator(chunk_bytes=chunk_bytes)
    python = ShmCommunicator(chunk_bytes=chunk_bytes, native=False)  # the reference path of the native loops
    ds, ds_why = deepspeed_all_reduce()
    register()
    backend = dist.new_group(backend="cocosync")  # the same collectives through torch.distributed (ordinary tensors)
    P = comm.world
    sync = lambda: comm.flags.barrier("bench")  # noqa: E731
    out: dict[str, Any] = {"P": P, "rows": {}, "deepspeed": ds_why or "deepspeed.comm.inference_all_reduce"}
    bws = [copy_bandwidth(256 << 20, repeats=5, before=sync)]  # measured again after every size (load varies)
    _rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    _ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    for nbytes in sizes:
        n = max(P, nbytes // 4 // P * P)
        reps = _repeats_for(nbytes, repeats)
        x = torch.randn(n)
        xd = x.clone()
        a = comm.arena.empty(n)
        a.copy_(x)
        sl = torch.randn(n // P)
        asl = comm.arena.empty(n // P)
        asl.copy_(sl)
        rs_out = torch.empty(n // P)
        ag_out = torch.empty(n)
        cases = {
            ("all_reduce", "ours"): lambda: comm.all_reduce(x),
            ("all_reduce", "python"): lambda: python.all_reduce(x),
            **({("all_reduce", "deepspeed"): lambda: ds(xd)} if ds is not None else {}),
            ("all_reduce", "arena"): lambda: comm.all_reduce(a),
            ("all_reduce", "gloo"): lambda: dist.all_reduce(x),
            ("all_reduce", "backend"): lambda: dist.all_reduce(x, group=backend),
            ("reduce_scatter", "ours"): lambda: comm.reduce_scatter(x, out=rs_out),
            ("reduce_scatter", "arena"): lambda: comm.reduce_scatter(a, out=rs_out),
            ("reduce_scatter", "gloo"): lambda: _rs(rs_out, x),
            ("reduce_scatter", "backend"): lambda: _rs(rs_out, x, group=backend),
            ("all_gather", "ours"): lambda: comm.all_gather(sl, out=ag_out),
            ("all_gather", "arena"): lambda: comm.all_gather(asl, out=ag_out),
            ("all_gather", "gloo"): lambda: _ag(ag_out, sl),
            ("all_gather", "backend"): lambda: _ag(ag_out, sl, group=backend),
        }
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            x.normal_()  # keep values bounded (all_reduce in place doubles them)
            xd.normal_()
            # ours, arena and gloo round-robin: a change of load during the run hits all three alike
            samples = time_interleaved({k: f for k, f in cases.items() if k[0] == op}, reps, warmup=2, before=sync)
            for (_, impl), ts in samples.items():
                out["rows"][(op, n * 4, impl)] = ts
        cases = a = asl = None  # drop the arena buffers before the next size
        bws.append(copy_bandwidth(256 << 20, repeats=1, before=sync))
    if ds is not None:
        dist.barrier()
        deepspeed_cleanup()  # its shm op leaves its buffers in /dev/shm
    out["bandwidth_per_rank"] = statistics.median(bws)
    out["bandwidth_samples"] = bws
    if fused_numel:
        out["fused"] = _bench_fused(comm, fused_numel, repeats, sync)
    return out


def _bench_fused(comm, N: int, repeats: int, sync) -> dict[str, list[float]]:
    from cocosync.bench.adam_slice import AdamSlice

    reps = max(3, repeats)
    # zero-copy: gradients per rank in the arena, parameters stored once per node (no all-gather within the node)
    grads = comm.arena.empty(N)
    grads.normal_()
    params = comm.arena.shared_empty(N)
    if comm.local_rank == 0:
        params.normal_()
    comm.barrier()
    opt = AdamSlice(comm, N, lr=1e-4)
    # plain tensors: gradients copied in, every rank's parameters all-gathered
    g2, p2 = torch.randn(N), torch.randn(N)
    opt2 = AdamSlice(comm, N, lr=1e-4)
    # unfused baseline: gloo all_reduce of the gradients, then torch.optim.Adam on all parameters on every rank
    p3 = torch.nn.Parameter(torch.randn(N))
    p3.grad = torch.randn(N)
    adam = torch.optim.Adam([p3], lr=1e-4)

    def baseline():
        dist.all_reduce(p3.grad)
        p3.grad.div_(comm.world)
        adam.step()
    dsl = _dsl_adam(N)
    return time_interleaved({"fused (arena grads, node-shared params)": lambda: opt.step(grads, params),
                             "fused (plain tensors)": lambda: opt2.step(g2, p2),
                             "DSL: scheduled adam_program": dsl,
                             "gloo all_reduce + torch Adam": baseline}, reps, warmup=2, before=sync)


def _dsl_adam(N: int):
    """The paper's Adam program with its schedule, lowered to one fused shm collective with a generated kernel
    (arena gradients donated, w Replicated and all-gathered into place, m and v sliced)."""
    from cocosync import compile_plan, lower
    from cocosync.programs.optimizers import adam_program, adam_scalars
    from cocosync.schedule.standard import adam_schedule

    fn = compile_plan(lower(adam_schedule(adam_program(N))), donate=("g",))  # kernels: $COCOSYNC_KERNELS
    P = dist.get_world_size()
    g, w = fn.comm.shm.arena.empty(N), torch.randn(N)
    g.normal_()
    m, v = torch.zeros(N // P), torch.zeros(N // P)
    scalars = adam_scalars(1, lr=1e-4)
    return lambda: fn(g=g, w=w, m=m, v=v, **scalars)


def run(sizes: list[int], repeats: int, fused_numel: int, chunk_bytes: int, P: int = 2) -> dict[str, Any]:
    from cocosync.testing.launch import RankPool

    with RankPool(P, threads=1, timeout=3600) as pool:
        per_rank = pool.run(_bench_rank, sizes, repeats, fused_numel, chunk_bytes, timeout=3600)
    # one sample = the slowest rank of that iteration
    merge = lambda key, part: [max(s) for s in zip(*(pr[part][key] for pr in per_rank))]  # noqa: E731
    bw = sum(pr["bandwidth_per_rank"] for pr in per_rank)
    rows = []
    for (op, nbytes, impl) in per_rank[0]["rows"]:
        if impl != "ours":
            continue
        impls = ("ours", "arena", "backend", "gloo", *(("python",) if op == "all_reduce" else ()),
                 *(("deepspeed",) if op == "all_reduce" and (op, nbytes, "deepspeed") in per_rank[0]["rows"] else ()))
        t = {i: stats(merge((op, nbytes, i), "rows")).median for i in impls}
        bound = bound_seconds(traffic_bytes(op, nbytes, P), bw)
        rows.append({"op": op, "bytes": nbytes, "ours_s": t["ours"], "arena_s": t["arena"], "gloo_s": t["gloo"],
                     "backend_s": t["backend"], "gloo_over_backend": t["gloo"] / t["backend"],
                     "gloo_over_ours": t["gloo"] / t["ours"], "gloo_over_arena": t["gloo"] / t["arena"],
                     "bound_s": bound, "bound_over_ours": bound / t["ours"], "bound_over_arena": bound / t["arena"],
                     "python_s": t.get("python"), "deepspeed_s": t.get("deepspeed"),
                     "deepspeed_over_ours": t["deepspeed"] / t["ours"] if "deepspeed" in t else None})
    fused = None
    if fused_numel:
        fb = bound_seconds((P + 6) * fused_numel * 4, bw)
        fused = {"params": fused_numel, "bound_s": fb, "bound_bytes": (P + 6) * fused_numel * 4, "rows": []}
        for name in per_rank[0]["fused"]:
            med = stats(merge(name, "fused")).median
            fused["rows"].append({"variant": name, "median_s": med, "bound_over_time": fb / med})
    return {"P": P, "threads_per_rank": 1, "bandwidth_Bps": bw, "deepspeed": per_rank[0]["deepspeed"],
            "bandwidth_samples_Bps": [sum(s) for s in zip(*(pr["bandwidth_samples"] for pr in per_rank))],
            "chunk_bytes": chunk_bytes, "rows": rows,
            "fused": fused}


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    return [[r["op"], fmt_bytes(r["bytes"]), fmt_seconds(r["ours_s"]), fmt_seconds(r["arena_s"]),
             fmt_seconds(r.get("python_s")), fmt_seconds(r.get("deepspeed_s")), fmt_ratio(r.get("deepspeed_over_ours")),
             fmt_seconds(r["backend_s"]), fmt_seconds(r["gloo_s"]),
             fmt_ratio(r["gloo_over_ours"]),
             fmt_ratio(r["gloo_over_arena"]), fmt_ratio(r["gloo_over_backend"]), fmt_seconds(r["bound_s"]),
             f"{r['bound_over_ours']:.0%}", f"{r['bound_over_arena']:.0%}"]
            for r in sorted(result["rows"], key=lambda r: (r["op"], r["bytes"]))]


def fused_rows(result: dict[str, Any]) -> list[list[str]]:
    f = result["fused"]
    base = next((r["median_s"] for r in f["rows"] if r["variant"].startswith("gloo")), None)
    return [[r["variant"], fmt_seconds(r["median_s"]), fmt_seconds(f["bound_s"]), f"{r['bound_over_time']:.0%}",
             fmt_ratio(base / r["median_s"]) if base else "-"] for r in f["rows"]]


FUSED_COLUMNS = ["variant", "time", "(P+6)*N*4 B bound", "bound/time", "speed-up vs gloo+Adam"]


@click.command("collectives")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write results as JSON.")
@click.option("--sizes", default=None, help=f"Comma-separated tensor sizes (default {DEFAULT_SIZES}).")
@click.option("--quick", is_flag=True, help=f"Small sweep ({QUICK_SIZES}, fused over 4M params).")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1),
              help="Timed repeats (more for small sizes).")
@click.option("--fused-params", default="16M", show_default=True,
              help="Parameters of the fused RS + Adam + AG (0 to skip); M means 2**20.")
@click.option("--chunk", "chunk", default="256K", show_default=True, help="Reduction chunk size (cache blocking).")
@click.option("--markdown", is_flag=True, help="Also print the tables as markdown (for BENCHMARKS.md).")
def collectives_cmd(json_path, sizes, quick, repeats, fused_params, chunk, markdown) -> None:
    """Shared-memory collectives vs gloo at 2 local ranks, one thread each, with the memory-bandwidth bound."""
    size_list = [parse_size(s) for s in (sizes or (QUICK_SIZES if quick else DEFAULT_SIZES)).split(",")]
    fused_numel = parse_size(fused_params)
    if quick and fused_params == "16M":
        fused_numel = 4 << 20
    result = run(size_list, repeats, fused_numel, parse_size(chunk))
    caption = (f"P=2, 1 thread/rank; memory bandwidth (both ranks copying) {result['bandwidth_Bps'] / 1e9:.1f} GB/s; "
               "ratios > 1: ours faster; bound = zero-copy memory traffic / bandwidth; "
               f"DeepSpeed: {result['deepspeed']}")
    print_table("collectives: median time per call", COLUMNS, table_rows(result), caption=caption)
    if result["fused"]:
        print_table(f"fused reduce-scatter + Adam + all-gather, {result['fused']['params']:,} fp32 params",
                    FUSED_COLUMNS, fused_rows(result))
    if markdown:
        click.echo(markdown_table(COLUMNS, table_rows(result)))
        if result["fused"]:
            click.echo()
            click.echo(markdown_table(FUSED_COLUMNS, fused_rows(result)))
    if json_path:
        write_json(json_path, {"suite": "collectives", **result})
        click.echo(f"wrote {json_path}")
