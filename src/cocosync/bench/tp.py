"""``cocosync bench tp``: the Megatron MLP block (tensor parallel) on 2 local ranks, one intra-op thread each.

    out = dropout(all_reduce(relu(x @ w1) @ w2) + b) + x       (w1 column-sliced, w2 row-sliced)

Compared side by side, round-robin in the same run (median of the per-iteration max over ranks):

- eager:    plain torch ops + gloo all_reduce + torch dropout (what a Megatron layer does without cocosync);
- plan c=1: our plan of `megatron_schedule` with chunks=1: reduce_scatter / epilogue on slices / all_gather on
            shared memory, stage by stage (no overlap);
- plan:     the same plan with `--chunks` chunks: the overlap step pipelines matmul -> RS -> epilogue -> AG by
            column chunks, communication on a background thread;
- compute:  the eager block without its all_reduce (each rank's partial sums): a bound on what any communication
            optimization can reach (eager / compute is the largest possible speedup);
- nn c=1 / nn: the `cocosync.nn.MegatronMLP` module (training mode, no_grad forward) with the same weights,
            chunks=1 and `--chunks`, its fused kernels compiled by Inductor (the default; the plan columns use eager
            kernels): its program adds b1 (zero here) and draws a new dropout mask per call.

A second table times a training step of the block, forward + backward (input, weight and bias gradients):
eager torch autograd with Megatron's two communication functions (all_reduce in the forward, identity in its
backward; identity in the forward, all_reduce of dX in the backward) vs `MegatronMLP` with its default chunks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import torch
import torch.distributed as dist

from cocosync.bench.common import (
    fmt_ratio,
    fmt_seconds,
    markdown_table,
    parse_shapes,
    print_table,
    stats,
    time_interleaved,
    write_json,
)

COLUMNS = ["batch x hidden x ffn", "eager+gloo", "compute only", "plan c=1 (shm)", "plan overlap (shm)", "nn c=1",
           "nn overlap", "eager/compute (max)", "eager/plan c=1", "eager/plan", "eager/nn c=1", "eager/nn overlap",
           "overlap fast"]
CASES = {"eager": "eager+gloo", "compute": "compute only (no all_reduce)", "plan1": "plan c=1", "plan": "plan overlap",
         "nn1": "nn.MegatronMLP c=1", "nn": "nn.MegatronMLP overlap"}
TRAIN_CASES = {"train_eager": "fwd+bwd eager+gloo", "train_compute": "fwd+bwd compute only",
               "train_nn": "fwd+bwd nn.MegatronMLP"}
TRAIN_COLUMNS = ["batch x hidden x ffn", "eager+gloo", "compute only", "nn.MegatronMLP", "eager/compute (max)",
                 "eager/nn"]


class _ReduceForward(torch.autograd.Function):
    """Megatron's g: all_reduce in the forward, identity in the backward."""

    @staticmethod
    def forward(ctx, x):
        z = x.clone()
        dist.all_reduce(z)
        return z

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ReduceBackward(torch.autograd.Function):
    """Megatron's f: identity in the forward, all_reduce of the gradient in the backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        g = grad.clone()
        dist.all_reduce(g)
        return g


def _eager_train_step(x, b, w1, w2, comm: bool = True):
    """The eager training step (fwd + bwd) with or without its two all_reduces."""
    w1e, w2e = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    b1e, b2e = torch.zeros(w1.shape[1], requires_grad=True), b.clone().requires_grad_()
    dout = torch.ones_like(x)

    def step() -> None:
        for p in (w1e, w2e, b1e, b2e):
            p.grad = None
        xr = x.clone().requires_grad_()
        a = _ReduceBackward.apply(xr) if comm else xr
        z = torch.relu(a @ w1e + b1e) @ w2e
        z = _ReduceForward.apply(z) if comm else z
        out = torch.nn.functional.dropout(z + b2e, 0.1, training=True) + xr
        out.backward(dout)
    return step


def _breakdown(block, x, train_step, repeats: int) -> dict[str, list[dict[str, Any]]]:
    """Per-step times of the module's forward and backward plans over `repeats` training steps (after a barrier of
    the ranks before each step, so collectives show their own time)."""
    fwd = block._plans.get((x.shape[0], x.dtype, True), x.device)
    bwd = block._backward_plans.get((x.shape[0], x.dtype, True), x.device)
    with fwd.profile(sync=True) as pf, bwd.profile(sync=True) as pb:
        for _ in range(repeats):
            train_step()
    return {"forward": pf.rows(), "backward": pb.rows()}


def _bench_rank(shapes: list[tuple[int, int, int]], chunks: int, repeats: int,
                breakdown: bool = False) -> dict[str, Any]:
    from cocosync import compile_plan, lower
    from cocosync.nn import MegatronMLP
    from cocosync.programs.model_parallel import megatron_mlp_program
    from cocosync.schedule.standard import megatron_schedule

    rank, P = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for B, H, F in shapes:
        gen = torch.Generator().manual_seed(0)
        x, b = torch.randn(B, H, generator=gen), torch.randn(H, generator=gen)
        w1 = (torch.randn(H, F, generator=gen) / H ** 0.5).chunk(P, 1)[rank].contiguous()
        w2 = (torch.randn(F, H, generator=gen) / F ** 0.5).chunk(P, 0)[rank].contiguous()
        program = megatron_mlp_program(B, H, F, p=0.1)
        plan1 = compile_plan(lower(megatron_schedule(program, chunks=1)), backend="shm", kernels="eager")
        planc = compile_plan(lower(megatron_schedule(program, chunks=chunks)), backend="shm", kernels="eager")

        def eager() -> torch.Tensor:
            z = torch.relu(x @ w1) @ w2
            dist.all_reduce(z)
            return torch.nn.functional.dropout(z + b, 0.1, training=True) + x

        def compute() -> torch.Tensor:  # the eager block without its all_reduce: no comm optimization beats it
            z = torch.relu(x @ w1) @ w2
            return torch.nn.functional.dropout(z + b, 0.1, training=True) + x

        cases = {"eager": eager, "compute": compute, "plan1": lambda: plan1(x=x, w1=w1, w2=w2, b=b),
                 "plan": lambda: planc(x=x, w1=w1, w2=w2, b=b)}
        for key, c in (("nn1", 1), ("nn", chunks)):
            block = MegatronMLP(H, F, p=0.1, chunks=c, backend="shm")  # default kernels: Inductor (as users get)
            with torch.no_grad():
                block.w1.copy_(w1), block.w2.copy_(w2), block.b2.copy_(b)
            cases[key] = lambda block=block: block(x)
        with torch.no_grad():
            samples = time_interleaved(cases, repeats, warmup=2, before=dist.barrier)
        block = MegatronMLP(H, F, p=0.1)  # chunks=None: the CPU default
        with torch.no_grad():
            block.w1.copy_(w1), block.w2.copy_(w2), block.b2.copy_(b)
        dout = torch.ones_like(x)

        def nn_train() -> None:
            block.zero_grad(set_to_none=True)
            xr = x.clone().requires_grad_()
            block(xr).backward(dout)
        train = {"train_eager": _eager_train_step(x, b, w1, w2),
                 "train_compute": _eager_train_step(x, b, w1, w2, comm=False), "train_nn": nn_train}
        samples.update(time_interleaved(train, repeats, warmup=2, before=dist.barrier))
        out[f"{B}x{H}x{F}"] = {"samples": samples, "fast": planc.fast_steps}
        if breakdown:
            out[f"{B}x{H}x{F}"]["breakdown"] = _breakdown(block, x, nn_train, repeats)
    return out


def run_tp(shapes: list[tuple[int, int, int]], chunks: int, repeats: int, P: int = 2,
           breakdown: bool = False) -> dict[str, Any]:
    from cocosync.testing.launch import RankPool

    with RankPool(P, threads=1, timeout=1800) as pool:
        per_rank = pool.run(_bench_rank, shapes, chunks, repeats, breakdown, timeout=1800)
    result: dict[str, Any] = {"P": P, "chunks": chunks, "repeats": repeats, "rows": {}}
    for key in per_rank[0]:
        row = {}
        for case in per_rank[0][key]["samples"]:
            per_iter = [max(r[key]["samples"][case][i] for r in per_rank) for i in range(repeats)]
            st = stats(per_iter)
            row[case], row[f"{case}_p10"], row[f"{case}_p90"] = st.median, st.p10, st.p90
        row["fast"] = any(s.startswith("overlap(") for s in per_rank[0][key]["fast"])
        if breakdown:
            row["breakdown"] = {part: _slower_rank([r[key]["breakdown"][part] for r in per_rank])
                                for part in ("forward", "backward")}
        result["rows"][key] = row
    return result


TARGET = 1.5  # the block (forward) >= 1.5x faster than eager + gloo


def targets(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per shape: the module's speedup (nn c=1, the CPU default) against the target, and the largest speedup any
    communication optimization could give there (eager / compute only): a target above it cannot be met."""
    out = {}
    for key, r in result["rows"].items():
        speedup, bound = r["eager"] / r["nn1"], r["eager"] / r["compute"]
        out[key] = {"target": TARGET, "speedup": speedup, "met": speedup >= TARGET, "comm_bound": bound,
                    "reachable": bound >= TARGET}
    return out


def target_lines(result: dict[str, Any]) -> list[str]:
    return [f"{key}: nn c=1 {t['speedup']:.2f}x vs target {t['target']}x ({'met' if t['met'] else 'MISSED'}); "
            f"the most any communication optimization can give here (eager / compute only): {t['comm_bound']:.2f}x"
            + ("" if t["reachable"] else ", below the target") for key, t in targets(result).items()]


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    return [[key, fmt_seconds(r["eager"]), fmt_seconds(r["compute"]), fmt_seconds(r["plan1"]), fmt_seconds(r["plan"]),
             fmt_seconds(r["nn1"]), fmt_seconds(r["nn"]), fmt_ratio(r["eager"] / r["compute"]),
             fmt_ratio(r["eager"] / r["plan1"]), fmt_ratio(r["eager"] / r["plan"]), fmt_ratio(r["eager"] / r["nn1"]),
             fmt_ratio(r["eager"] / r["nn"]), "yes" if r["fast"] else "no"]
            for key, r in result["rows"].items()]


BREAKDOWN_COLUMNS = ["step", "fast form", "median (slower rank)", "share"]


def _slower_rank(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each step's profile row with the slower rank's median, shares recomputed."""
    rows = [{**same[0], "median_ms": max(r["median_ms"] for r in same)} for same in zip(*per_rank)]
    total = sum(r["median_ms"] for r in rows) or 1.0
    return [{**r, "share": r["median_ms"] / total} for r in rows]


def breakdown_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    return [[r["step"], {True: "yes", False: "no", None: ""}[r["fast"]], fmt_seconds(r["median_ms"] / 1e3),
             f"{100 * r['share']:.0f}%"] for r in rows]


def train_rows(result: dict[str, Any]) -> list[list[str]]:
    return [[key, fmt_seconds(r["train_eager"]), fmt_seconds(r["train_compute"]), fmt_seconds(r["train_nn"]),
             fmt_ratio(r["train_eager"] / r["train_compute"]), fmt_ratio(r["train_eager"] / r["train_nn"])]
            for key, r in result["rows"].items()]


@click.command("tp")
@click.option("--shapes", default="64x1024x4096,512x1024x4096", show_default=True,
              help="Comma-separated BATCHxHIDDENxFFN (batch and ffn divisible by 2 * chunks' needs).")
@click.option("--chunks", default=4, show_default=True, type=click.IntRange(2), help="Overlap chunks.")
@click.option("--repeats", default=20, show_default=True, type=click.IntRange(1), help="Timed repeats.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write results as JSON (and a PNG bar chart next to it, same name with .png).")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None, help="Bar chart path (PNG).")
@click.option("--markdown", is_flag=True, help="Also print the table as markdown (for BENCHMARKS.md).")
@click.option("--breakdown", is_flag=True,
              help="Also time each step of nn.MegatronMLP's forward and backward plans (default chunks).")
def tp_cmd(shapes: str, chunks: int, repeats: int, json_path: str | None, png_path: str | None,
           markdown: bool, breakdown: bool) -> None:
    """Megatron MLP block on 2 ranks: eager torch + gloo vs our plan (shm), without and with overlap."""
    result = run_tp(parse_shapes(shapes, 3, "BATCHxHIDDENxFFN"), chunks, repeats, breakdown=breakdown)
    rows = table_rows(result)
    print_table(f"Megatron MLP, P={result['P']}, 1 thread/rank, median of {repeats} (chunks={chunks})", COLUMNS, rows)
    if markdown:
        click.echo(markdown_table(COLUMNS, rows))
    for line in target_lines(result):
        click.echo(line)
    print_table(f"Megatron MLP training step (forward + backward), P={result['P']}, median of {repeats}",
                TRAIN_COLUMNS, train_rows(result))
    if markdown:
        click.echo(markdown_table(TRAIN_COLUMNS, train_rows(result)))
    for key, row in result["rows"].items() if breakdown else ():
        for part in ("forward", "backward"):
            rows = breakdown_rows(row["breakdown"][part])
            print_table(f"nn.MegatronMLP {part} plan, {key}: per step, after a barrier (median of {repeats})",
                        BREAKDOWN_COLUMNS, rows)
            if markdown:
                click.echo(markdown_table(BREAKDOWN_COLUMNS, rows))
    if json_path:
        click.echo(f"wrote {write_json(json_path, {'suite': 'tp', **result, 'targets': targets(result)})}")
        png_path = png_path or str(Path(json_path).with_suffix(".png"))
    if png_path:
        from cocosync.bench.pp import bar_png

        title = "tp: Megatron MLP block, 2 ranks"
        click.echo(f"wrote {bar_png(result, png_path, CASES, {'plan1', 'plan', 'nn1', 'nn'}, title)}")
