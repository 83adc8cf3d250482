"""`cocosync demo`: the main job on the embedded default, end to end on local processes."""

from __future__ import annotations

import contextlib
import sys

import torch
from rich.console import Console
from rich.table import Table

import cocosync as cs
from cocosync.lower import lower
from cocosync.programs.optimizers import adam_program, adam_scalars
from cocosync.schedule.standard import adam_schedule
from cocosync.testing.launch import spawn

N, STEPS, P = 4096, 10, 2


def _inputs(step: int, rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(step * 100 + rank))


def _adam_on_rank() -> dict[str, torch.Tensor]:
    """Runs on each of the P real ranks: STEPS Adam steps of the paper's program, as written (stage by stage) and
    with its schedule (one fused shared-memory reduce-scatter -> sliced update -> all-gather)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for name, fn, sliced in (("as written", cs.compile(adam_program(N)), False),
                             ("scheduled (fused)", cs.compile_scheduled(adam_schedule(adam_program(N)),
                                                                        kernels="eager"), True)):
        w = torch.linspace(-1, 1, N)
        m, v = (torch.zeros(N // P if sliced else N) for _ in range(2))
        for step in range(1, STEPS + 1):
            fn(g=_inputs(step, rank), w=w, m=m, v=v, **adam_scalars(step, lr=1e-2))
        out[name] = w
    return out


def dsl_adam_demo(console: Console) -> bool:
    program = adam_program(N)
    console.rule("[bold]CoCoNeT DSL: data-parallel Adam (AllReduce + Update) on 2 local processes")
    console.print(str(program), highlight=False, markup=False)
    schedule = adam_schedule(program)
    console.print(f"\n{schedule}\n\n{lower(schedule)}\n", highlight=False, markup=False)
    got = spawn(_adam_on_rank, P, timeout=120)
    w, m, v = torch.linspace(-1, 1, N), torch.zeros(N), torch.zeros(N)
    for step in range(1, STEPS + 1):  # the oracle: the interpreter on P simulated ranks
        out = cs.interpret(program, P, {"g": [_inputs(step, r) for r in range(P)], "w": w, "m": m, "v": v,
                                        **adam_scalars(step, lr=1e-2)})
        w, m, v = out[0]["w"], out[0]["m"], out[0]["v"]
    table = Table(title=f"{STEPS} Adam steps over {N} parameters: real ranks vs the reference interpreter")
    for col in ("rank", "program"):
        table.add_column(col)
    table.add_column("max |w - w_oracle|", justify="right"), table.add_column("ok")
    ok = True
    for r, per_rank in enumerate(got):
        for name, wr in per_rank.items():
            err = (wr - w).abs().max().item()
            ok &= err < 1e-5
            table.add_row(str(r), name, f"{err:.2e}", "[green]yes" if err < 1e-5 else "[red]NO")
    console.print(table)
    return ok


def shadowsync_demo(console: Console) -> bool:
    """The main job: `cocosync train` on its embedded default (2 trainers, Shadow-BMUF, synthetic data)."""
    from cocosync.shadowsync.cli.train import train

    console.rule("[bold]ShadowSync: CTR training with background dense sync (`cocosync train`)")
    try:  # `cocosync train` writes to stderr; the demo's whole story goes where the demo writes (`demo > file`)
        with contextlib.redirect_stderr(sys.stdout):
            train.main(args=[], standalone_mode=False)
    except SystemExit as e:  # click reports failures as exit codes
        return not e.code
    return True


def dp_demo(console: Console) -> bool:
    """A short `cocosync bench dp --quick`: DistributedAdam vs DDP-style gloo all_reduce + fused Adam and ZeRO-1."""
    from cocosync.bench.dp import quick_dp_comparison

    console.rule("[bold]Data-parallel Adam step on 2 ranks: cocosync.optim vs PyTorch (`cocosync bench dp --quick`)")
    quick_dp_comparison(console)
    return True


def run_demo() -> bool:
    console = Console(width=None if sys.stdout.isatty() else 150)  # piped (make demo | tee): keep tables readable
    ok = shadowsync_demo(console)
    ok &= dsl_adam_demo(console)
    ok &= dp_demo(console)
    return ok
