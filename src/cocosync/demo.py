"""`cocosync demo`: the main job on the embedded default, end to end on local processes."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

import cocosync as cs
from cocosync.examples.optimizers import adam_program, adam_scalars
from cocosync.runtime.launch import spawn

N, STEPS, P = 4096, 10, 2


def _inputs(step: int, rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(step * 100 + rank))


def _adam_on_rank() -> torch.Tensor:
    """Runs on each of the P real ranks: STEPS Adam steps of the DSL program through torch.distributed."""
    import torch.distributed as dist

    fn = cs.compile(adam_program(N))
    w, m, v = torch.linspace(-1, 1, N), torch.zeros(N), torch.zeros(N)
    for step in range(1, STEPS + 1):
        fn(g=_inputs(step, dist.get_rank()), w=w, m=m, v=v, **adam_scalars(step, lr=1e-2))
    return w


def dsl_adam_demo(console: Console) -> bool:
    program = adam_program(N)
    console.rule("[bold]CoCoNeT DSL: data-parallel Adam (AllReduce + Update) on 2 local processes")
    console.print(str(program), highlight=False)
    got = spawn(_adam_on_rank, P, timeout=120)
    w, m, v = torch.linspace(-1, 1, N), torch.zeros(N), torch.zeros(N)
    for step in range(1, STEPS + 1):  # the oracle: the interpreter on P simulated ranks
        out = cs.interpret(program, P, {"g": [_inputs(step, r) for r in range(P)], "w": w, "m": m, "v": v,
                                        **adam_scalars(step, lr=1e-2)})
        w, m, v = out[0]["w"], out[0]["m"], out[0]["v"]
    table = Table(title=f"{STEPS} Adam steps over {N} parameters: real ranks vs the reference interpreter")
    table.add_column("rank"), table.add_column("max |w - w_oracle|", justify="right"), table.add_column("ok")
    ok = True
    for r, wr in enumerate(got):
        err = (wr - w).abs().max().item()
        ok &= err < 1e-5
        table.add_row(str(r), f"{err:.2e}", "[green]yes" if err < 1e-5 else "[red]NO")
    console.print(table)
    return ok


def run_demo() -> bool:
    console = Console()
    return dsl_adam_demo(console)
