"""What the tuner tunes: a program at the size to time, the same program small for the oracle, the state its
schedules may keep sliced, and values for its scalars. Built-ins for the paper's workloads; FILE.py for others.

FILE.py defines `program` (a Program) and optionally `small` (the same program at a size the interpreter checks
quickly; default: `program`), `internal` (state tensors a schedule may keep sliced, e.g. ("m", "v")) and `scalars`
(values of its Scalar inputs; default 0.5).
"""

from __future__ import annotations

import runpy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from cocosync.dsl.ir import Program
from cocosync.interp import rank_inputs

__all__ = ["Workload", "BUILTIN", "workload", "global_inputs", "local_inputs"]


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], Program]
    small: Callable[[], Program]
    internal: tuple[str, ...] = ()
    scalars: dict[str, float] = field(default_factory=dict)
    source: str = ""  # how to rebuild it in another process: a built-in name, or the file's path


def _adam(n: int) -> Program:
    from cocosync.programs.optimizers import adam_program
    return adam_program(n)


def _lamb(n: int) -> Program:
    from cocosync.programs.lamb import lamb_program
    return lamb_program(n)


def _sgd(n: int) -> Program:
    from cocosync.programs.optimizers import sgd_program
    return sgd_program(n, momentum=True)


def _megatron(batch: int, hidden: int, ffn: int) -> Program:
    from cocosync.programs.model_parallel import megatron_mlp_program
    return megatron_mlp_program(batch, hidden, ffn)


def _bmuf(n: int) -> Program:
    from cocosync.programs.sync import bmuf_program
    return bmuf_program(n)


_ADAM_SCALARS = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "wd": 0.01, "c1": 0.1, "c2": 0.001}

#: name -> (builder at the timed size, at the oracle's size, internal state, scalars); sizes: 16 MB optimizer
#: vectors, and the Megatron block of BENCHMARKS.md's tp section at batch 64
BUILTIN: dict[str, tuple[Callable[[], Program], Callable[[], Program], tuple[str, ...], dict[str, float]]] = {
    "adam": (lambda: _adam(4 << 20), lambda: _adam(96), ("m", "v"), _ADAM_SCALARS),
    "lamb": (lambda: _lamb(4 << 20), lambda: _lamb(96), ("m", "v"), _ADAM_SCALARS),
    "sgd": (lambda: _sgd(4 << 20), lambda: _sgd(96), ("buf",), {"lr": 0.1, "mu": 0.9}),
    "megatron": (lambda: _megatron(64, 1024, 4096), lambda: _megatron(12, 8, 24), (), {}),
    "bmuf": (lambda: _bmuf(4 << 20), lambda: _bmuf(96), ("glob", "delta"), {"mom": 0.5, "blr": 1.0, "nm": 0.5}),
}


def workload(target: str) -> Workload:
    """A built-in name or a FILE.py (ValueError naming what is accepted)."""
    if target in BUILTIN:
        build, small, internal, scalars = BUILTIN[target]
        return Workload(target, build, small, internal, scalars, source=target)
    if not target.endswith(".py"):
        raise ValueError(f"{target!r} is neither a .py file nor a built-in workload ({', '.join(BUILTIN)})")
    path = Path(target)
    if not path.is_file():
        raise ValueError(f"file {target!r} does not exist")
    ns = runpy.run_path(str(path))
    if not isinstance(ns.get("program"), Program):
        raise ValueError(f"{target} must define `program`, a cocosync Program")
    program, small = ns["program"], ns.get("small", ns["program"])
    return Workload(program.name, lambda: program, lambda: small, tuple(ns.get("internal", ())),
                    dict(ns.get("scalars", {})), source=str(path.resolve()))


def global_inputs(program: Program, world: int, scalars: dict[str, float], seed: int = 0) -> dict[str, Any]:
    """Interpreter-style inputs: uniform [0, 1) tensors (non-negative, so second moments stay valid), a Local tensor
    as one per rank, scalars from `scalars` (0.5 otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for n in program.inputs:
        if n.attr("kind") != "tensor":
            out[n.name] = float(scalars.get(n.name, 0.5))
        elif n.layout.is_local:
            out[n.name] = [torch.rand(n.shape, generator=gen).to(n.dtype) for _ in range(world)]
        else:
            out[n.name] = torch.rand(n.shape, generator=gen).to(n.dtype)
    return out


def local_inputs(program: Program, world: int, inputs: dict[str, Any], rank: int) -> dict[str, Any]:
    """This rank's part of `inputs` for `program` (a scheduled program: its sliced state gets the rank's slice)."""
    return rank_inputs(program, world, inputs, rank)
