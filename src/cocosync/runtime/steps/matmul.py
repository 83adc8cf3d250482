"""The fast form of a Kernel step that starts with a 2-D matmul: the matmul and its elementwise epilogue.

A bias add right after the matmul goes into the GEMM (`torch.addmm`), and relu, written either DSL way, runs in
place on the GEMM's output: `maximum(t, 0)` as `relu_` (both propagate NaN), `where(gt(t, 0), t, 0)` as `relu_` +
`nan_to_num_` (where() turns NaN into 0). What else follows becomes one fused kernel (runtime.steps.codegen) when it
can,
else runs stage by stage (e.g. backward's where(gt(h, 0), dz @ w2^T, 0): the GEMM, then one kernel).

Why: right after a GEMM of any size, the next torch call runs with cold caches: a compiled kernel then costs
~0.25-0.3 ms and an eager op ~0.1 ms, even on a few KB (measured on these 2-core machines). Folding the
Megatron block's `x @ w1 + b1 -> relu` into the GEMM call removes that call from every forward.
"""

from __future__ import annotations

import torch

from cocosync.dsl.ir import Node, Program
from cocosync.lower.plan import Kernel
from cocosync.runtime.reference.stage import StageComm, run_stage
from cocosync.runtime.steps.codegen import build_kernel, can_fuse
from cocosync.runtime.steps.common import Runner, StepOptions, eager_work, local_ranks_of, put_consts

__all__ = ["matmul_runner"]
_INF = float("inf")


def _is_zero(n: Node) -> bool:
    return n.op == "const" and float(n.attr("value")) == 0.0


def _readers(stages: list[Node], n: Node) -> list[Node]:
    return [s for s in stages if any(a is n for a in s.args)]


def _relu_fold(tail: list[Node], head: Node, outside: set[int]) -> tuple[Node | None, bool, int]:
    """(the stage whose value is relu(head), whether NaN must become 0, how many tail stages it takes) or None."""
    if not tail or id(head) in outside:
        return None, False, 0
    readers = {id(r) for r in _readers(tail, head)}
    mx = tail[0]
    # (relu_ keeps head's dtype: the relu stage must have it too)
    if mx.op == "maximum" and mx.args[0] is head and _is_zero(mx.args[1]) and readers == {id(mx)} \
            and mx.dtype == head.dtype:
        return mx, False, 1
    if len(tail) >= 2:
        gt, wh = tail[0], tail[1]
        if (gt.op == "gt" and gt.args[0] is head and _is_zero(gt.args[1]) and id(gt) not in outside
                and wh.op == "where" and wh.args[0] is gt and wh.args[1] is head and _is_zero(wh.args[2])
                and _readers(tail, gt) == [wh] and readers <= {id(gt), id(wh)} and wh.dtype == head.dtype):
            return wh, True, 2
    return None, False, 0


def matmul_runner(step: Kernel, program: Program, comm: StageComm, options: StepOptions,
                  outside: set[int]) -> Runner | None:
    """A runner for [matmul, epilogue...] steps, or None (reference). outside: ids of the step's stages read
    outside it (or program outputs)."""
    stages = list(step.stages)
    mm, rest = stages[0], stages[1:]
    if mm.op != "matmul" or not rest or any(a.ndim != 2 for a in mm.args):
        return None
    head, bias = mm, None
    first = rest[0]
    if first.op == "add" and id(mm) not in outside and _readers(rest, mm) == [first] and first.shape == mm.shape:
        other = first.args[1] if first.args[0] is mm else first.args[0]
        replicated_into_slice = first.layout.is_sliced and other.layout.is_replicated
        same_dtype = other.dtype == mm.dtype == first.dtype  # addmm does not promote
        if other is not mm and other.ndim == 1 and other.op != "const" and not replicated_into_slice and same_dtype:
            head, bias = first, other
    tail = [s for s in rest if s is not head]
    relu, nan_to_zero, taken = _relu_fold(tail, head, outside)
    tail = tail[taken:]
    fusable = bool(tail) and all(can_fuse(s) and s.op != "update" and s.shape == mm.shape for s in tail)
    if head is mm and relu is None and not fusable:
        return None  # nothing folds and nothing fuses: the reference runs the stages as they are
    outs = [s for s in tail if id(s) in outside]
    kernel = build_kernel(tail, outs, options.kernels, name=f"k_{mm.name}_epilogue",
                          eager_work=eager_work(options, local_ranks_of(comm))) if fusable else None
    a_id, b_id = id(mm.args[0]), id(mm.args[1])

    def run(env: dict) -> None:
        a, b = env[a_id], env[b_id]
        t = torch.addmm(env[id(bias)], a, b) if bias is not None else a @ b
        if relu is None:
            env[id(head)] = t
        else:  # head has no other reader: relu in place
            t = t.relu_()
            env[id(relu)] = t.nan_to_num_(nan=0.0, posinf=_INF) if nan_to_zero else t
        if kernel is not None:
            put_consts(kernel.inputs, env)
            for node, val in zip(outs, kernel(*(env[id(n)] for n in kernel.inputs))):
                env[id(node)] = val
        else:
            for s in tail:  # e.g. the scatter of an input merged into this step: as the reference runs it
                run_stage(s, env, comm)
    run.folds = ("bias",) * (bias is not None) + ("relu",) * (relu is not None)  # type: ignore[attr-defined]
    return run
