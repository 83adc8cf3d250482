"""ShadowSync's collective sync algorithms as DSL programs (one runtime for both halves of the product).

A trainer passes a snapshot `x` of its dense replica (Local: each trainer's differs); the program averages it over
the trainers and computes the point every trainer restarts from, `s` (Replicated: the same on all). The trainer then
writes back the delta `s - x` into its live replica, keeping the Hogwild updates made meanwhile (sync/base.py).

Scheduled like the optimizers (schedule/standard.py, sharded_update_schedule): the all-reduce splits into a
reduce-scatter and an all-gather, the update runs on each trainer's slice, and BMUF's global model and block
momentum stay **sliced** across the trainers (ZeRO-style: each holds 1/T of them, where the hand-written class held
both in full on every trainer), all in one fused collective.
"""

from __future__ import annotations

import torch

from cocosync.dsl import Local, Program, ReduceOp, Replicated, Scalar, Tensor, all_reduce, float32, update

__all__ = ["ma_program", "bmuf_program", "easgd_program"]


def ma_program(n: int, dtype: torch.dtype = float32) -> Program:
    """Model averaging: s <- mean over trainers of x, written as the step from the last round's point
    (s + (avg - s)): a value computed from the reduced slice, so the sharded schedule fuses it into one collective
    (a bare copy of the reduce-scatter's output has no fused form)."""
    x, s = Tensor("x", n, dtype, Local), Tensor("s", n, dtype, Replicated)
    return Program("ma", [x, s], [update(s, s + (all_reduce(x, ReduceOp.MEAN) - s))])


def bmuf_program(n: int, dtype: torch.dtype = float32) -> Program:
    """Blockwise model-update filtering (Chen & Huo 2016), `s` being the point the block started from:

        avg    = mean over trainers of x
        delta <- mom * delta + blr * (avg - s)
        glob  <- glob + delta
        s     <- glob + nm * delta        (nm = mom for Nesterov block momentum while a trainer trains, else 0)
    """
    x = Tensor("x", n, dtype, Local)
    s, glob, delta = (Tensor(name, n, dtype, Replicated) for name in ("s", "glob", "delta"))
    mom, blr, nm = Scalar("mom"), Scalar("blr"), Scalar("nm")
    avg = all_reduce(x, ReduceOp.MEAN)
    delta1 = update(delta, mom * delta + blr * (avg - s))
    glob1 = update(glob, glob + delta1)
    s1 = update(s, glob1 + nm * delta1)
    return Program("bmuf", [x, s, glob, delta, mom, blr, nm], [s1, glob1, delta1])


def easgd_program(n: int, dtype: torch.dtype = float32) -> Program:
    """Elastic averaging SGD (Zhang et al. 2015) of one trainer against the centre `c` (one copy in the node's shared
    memory, which every trainer moves in turn, Hogwild):

        d  = alpha * (x - c)
        x <- x - d
        c <- c + d

    No collective: each trainer runs it alone (a world of one, whenever its shadow thread likes), so both are Local
    to it; the centre is the same memory for every trainer. Compiled it is one generated loop reading x and c once
    and writing both, where the hand-written update made five passes over the vector."""
    x, c, alpha = Tensor("x", n, dtype, Local), Tensor("c", n, dtype, Local), Scalar("alpha")
    d = alpha * (x - c)
    return Program("easgd", [x, c, alpha], [update(x, x - d), update(c, c + d)])
