"""The fast form of an Overlap step: a producer/consumer chain run pipelined by chunks.

The chain (e.g. matmul -> reduce_scatter(dim 0) -> bias + dropout + residual on slices -> all_gather(dim 0)) is cut
into `step.chunks` chunks along one dimension `d` that every stage keeps independent: no stage's value is Sliced
along `d`, no collective works along it, and each op computes an output element at position j along `d` from
operand elements at position j only (elementwise ops, dropout, cast, scatter, the collectives, and matmul when `d`
is one of its output's last two dims). The chain then splits into alternating compute and communication segments:

    C0 -> M0 -> C1 -> M1 -> ...      (C: local stages, main thread; M: collectives, the comm thread)

and chunk i's C_j runs on the main thread while earlier chunks' communications run on one background thread
(runtime.comm.fused.CommThread), in the same order on every rank. Only the comm thread calls collectives while the step
runs, and the step waits for all of them before it returns.

Operands from outside the chain are cut to the chunk along their aligned dim (Replicated operands that broadcast
along `d` stay whole); dropout takes the chunk of the exact mask the reference would use; the values of stages read
outside the step are assembled into whole tensors in `env`. When no dimension qualifies, or a stage is not one of
the ops above, `overlap_runner` returns None and the step runs by its reference implementation.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from cocosync.dsl.ir import Node, Program
from cocosync.dsl.registry import names
from cocosync.interp import ELEMENTWISE
from cocosync.lower.plan import FusedCollective, Overlap
from cocosync.runtime.reference.stage import COMM_RULES, StageComm, eval_stage, local_shape, rank_dropout_mask
from cocosync.runtime.steps.common import Runner, outside_readers

__all__ = ["overlap_runner", "overlap_reason", "CommThread", "overlap_chunks", "comm_thread", "choose_dim",
           "chunk_plan", "segments"]

#: collectives that act elementwise along any dimension other than the one they scatter/gather
COMM_OPS = names(lambda d: d.pipelined)
#: local stages with one operand of the stage's shape, cut like the stage
_UNARY = names(lambda d: d.cut_like_output)


class CommThread:
    """One background thread that runs communication calls in submission order."""

    def __init__(self) -> None:
        self._ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cocosync-comm")

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        return self._ex.submit(fn, *args, **kwargs)

    def close(self) -> None:
        self._ex.shutdown(wait=True)

    def __enter__(self) -> "CommThread":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def overlap_chunks(produce: Callable[[int], Any], communicate: Callable[[int, Any], Any], n_chunks: int, *,
                   thread: CommThread | None = None) -> list[Any]:
    """For i in range(n_chunks): ``c = produce(i)`` on this thread while ``communicate(i - 1, c_prev)`` runs on the
    background thread. Communications run one at a time, in order (every rank issues them in the same order).
    Returns the communicate results in chunk order; an exception in either is raised here after the
    in-flight communication finished."""
    if n_chunks < 0:
        raise ValueError(f"n_chunks={n_chunks} must be >= 0")
    own = thread is None
    th = thread or CommThread()
    results: list[Any] = []
    pending: Future | None = None
    try:
        for i in range(n_chunks):
            try:
                c = produce(i)
            except BaseException:
                if pending is not None:
                    pending.exception()  # let the in-flight communication finish before unwinding
                raise
            if pending is not None:
                results.append(pending.result())
            pending = th.submit(communicate, i, c)
        if pending is not None:
            results.append(pending.result())
    finally:
        if own:
            th.close()
    return results

_THREAD: list[CommThread] = []
_THREAD_LOCK = threading.Lock()


def comm_thread() -> CommThread:
    """The process's comm thread for overlap steps (created on first use, shared: steps run one at a time)."""
    with _THREAD_LOCK:
        if not _THREAD:
            _THREAD.append(CommThread())
        return _THREAD[0]


def _sliced_at(n: Node, dim: int) -> bool:
    """Whether n's slices cut `dim` (a flat slice cuts every dim)."""
    return n.layout.is_sliced and (n.layout.is_flat or n.layout.dim == dim)


def _arg_cuts(s: Node, d: int) -> tuple[int | None, ...] | None:
    """For stage `s` chunked along its dim `d`: each operand's dim to cut (None: whole), or None if unsupported."""
    if s.op in COMM_OPS or s.op in _UNARY:
        a = s.args[0]
        return (d,) if a.shape == s.shape and len(s.args) == 1 else None
    if s.op in ELEMENTWISE:
        cuts: list[int | None] = []
        for a in s.args:
            da = d - (s.ndim - a.ndim)
            if a.ndim == 0 or da < 0 or a.shape[da] == 1 and s.shape[d] != 1:
                cuts.append(None)  # broadcast along d: every chunk reads all of it
            elif a.shape[da] == s.shape[d]:
                cuts.append(da)
            else:
                return None
        return tuple(cuts)
    if s.op == "matmul":
        a, b = s.args
        if a.ndim < 2 or b.ndim < 2:
            return None
        if d == s.ndim - 1:
            return (None, b.ndim - 1)  # output columns: columns of b
        if d == s.ndim - 2:
            return (a.ndim - 2, None)  # output rows: rows of a
        return None  # batch dims: not supported
    return None  # norm, reduce_tensor, update, broadcast, reduce, ...: whole-tensor or untested here


def chunk_plan(stages: tuple[Node, ...], d: int) -> list[tuple[int | None, ...]] | None:
    """Per stage, the cut of each operand when the chain is chunked along `d`; None if `d` is not safe."""
    inside = {id(s) for s in stages}
    shape = stages[-1].shape
    plan = []
    for s in stages:
        if s.shape != shape or _sliced_at(s, d):
            return None
        cuts = _arg_cuts(s, d)
        if cuts is None:
            return None
        for a, c in zip(s.args, cuts):
            if id(a) in inside:
                if c != d:
                    return None  # a chain value is only available chunk by chunk, along d
            elif c is not None and _sliced_at(a, c):
                return None  # cutting a rank's slice along its sliced dim: keep it simple, do not guess
        plan.append(cuts)
    return plan


def choose_dim(stages: tuple[Node, ...], chunks: int) -> tuple[int, list] | None:
    """The safe chunk dim with the most elements (ties: the later dim) and its per-stage cuts, or None."""
    shape = stages[-1].shape
    for d in sorted(range(len(shape)), key=lambda k: (-shape[k], -k)):
        if shape[d] < 2:
            break
        plan = chunk_plan(stages, d)
        if plan is not None:
            return d, plan
    return None


def overlap_reason(step: Overlap) -> str | None:
    """Why the step runs stage by stage (None: it runs pipelined by chunks)."""
    stages = tuple(step.stages)
    # one chunk: nothing to overlap
    if not stages or step.chunks < 2:
        return f"chunks={step.chunks}: nothing to overlap"
    # we run each stage after the chain values it reads
    inside, seen = {id(s) for s in stages}, set()
    for s in stages:
        if any(id(a) in inside and id(a) not in seen for a in s.args):
            return f"{s.name} reads a later stage of the chain"
        seen.add(id(s))
    # every stage must keep chunks along one dimension independent
    if choose_dim(stages, step.chunks) is None:
        return (f"no dimension along which every stage of the chain can be cut into {step.chunks} chunks "
                "(a stage Sliced or communicating along it, or an op that mixes positions)")
    return None


def overlap_runner(step: Overlap, program: Program, comm: StageComm) -> Runner | None:
    """A runner `run(env)` executing the Overlap step pipelined by chunks, or None (reference fallback).
    The chunks' local stages run as torch ops."""
    if overlap_reason(step) is not None:
        return None
    stages = tuple(step.stages)
    inside = {id(s) for s in stages}
    chosen = choose_dim(stages, step.chunks)
    assert chosen is not None
    d, cuts = chosen
    needed = [s for s in stages if id(s) in outside_readers(program, inside) and id(s) not in comm.pruning.dead]
    return _Pipelined(stages, d, cuts, step.chunks, needed, comm, step.inner)


def segments(stages: tuple[Node, ...], inner: tuple = ()) -> tuple[list[list[Node]], list[list[Node]]]:
    """(compute, comms): C0, M0, C1, M1, ... where compute[j] runs before comms[j]; C0 may be empty, and
    len(comms) is len(compute) or len(compute) - 1. The stages of a fused collective in `inner` (its computations
    included) form one communication unit: they run together on the comm thread, chunk by chunk."""
    fused = {id(x) for step in inner if isinstance(step, FusedCollective) for x in step.stages}
    compute: list[list[Node]] = [[]]
    comms: list[list[Node]] = []
    for s in stages:
        if s.op in COMM_OPS or id(s) in fused:
            if len(comms) < len(compute):
                comms.append([])
            comms[-1].append(s)
        else:
            if len(comms) == len(compute):
                compute.append([])
            compute[-1].append(s)
    return compute, comms


class _Pipelined:
    """The runner: chunk i's compute segment j on the calling thread; the communication segments on the comm
    thread, in submission order (the same on every rank). At tick t, compute segment j works on chunk t - j, so
    C0 of chunk t overlaps the communications of chunks t - 1, t - 2, ... submitted at earlier ticks."""

    def __init__(self, stages, d: int, cuts, chunks: int, needed: list[Node], comm, inner=()):
        self.d, self.comm, self.needed = d, comm, needed
        self.inside = {id(s) for s in stages}
        self.cut_of = {id(s): c for s, c in zip(stages, cuts)}
        self.consts = [a for s in stages for a in s.args if a.op == "const"]
        size = stages[-1].shape[d]
        n = min(chunks, size)
        self.bounds = [(i * size // n, (i + 1) * size // n) for i in range(n)]
        self.compute, self.comms = segments(stages, inner)
        self.dropouts = [s for s in stages if s.op == "dropout"]
        self.masks: dict[int, torch.Tensor] = {}  # dropout stage -> this rank's keep mask, as s.dtype

    def _args(self, s: Node, i: int, env: dict, local: dict) -> list[torch.Tensor]:
        lo, hi = self.bounds[i]
        out = []
        for a, c in zip(s.args, self.cut_of[id(s)]):
            if id(a) in self.inside:
                out.append(local.get(id(a)))  # None: pruned on this rank (the last group's send argument)
            else:
                v = env[id(a)]
                out.append(v if c is None else v.narrow(c, lo, hi - lo))
        return out

    def _mask(self, s: Node) -> torch.Tensor:
        m = self.masks.get(id(s))
        # exactly the mask the reference (runtime.reference.stage) uses, computed once (it depends on seed/shape/rank)
        if m is None:
            m = self.masks[id(s)] = _reference_mask(s, self.comm)
        return m

    def _pruned(self, s: Node, i: int, local: dict) -> bool:
        """Whether this rank skips `s` (runtime.reference.prune); zero stages get their chunk of zeros."""
        pr = self.comm.pruning
        if not pr.touches((s,)):
            return False
        if id(s) in pr.zero:
            device = next((local[id(a)].device for a in s.args if id(a) in local), self.comm.device)
            local[id(s)] = torch.zeros(self._chunk_shape(s, i), dtype=s.dtype, device=device)
        return True

    def _chunk_shape(self, s: Node, i: int) -> tuple[int, ...]:
        shape = list(local_shape(s, self.comm.group_size))
        shape[self.d] = self.bounds[i][1] - self.bounds[i][0]
        return tuple(shape)

    def _eval(self, s: Node, i: int, env: dict, local: dict) -> None:
        if self._pruned(s, i, local):
            return
        args = self._args(s, i, env, local)
        if s.op in COMM_OPS:
            if args[0] is None:  # the last group's send: only receives
                local[id(s)] = self.comm.send(None, self._chunk_shape(s, i), s.dtype)
            else:
                local[id(s)] = COMM_RULES[s.op](s, args[0], self.comm)
        elif s.op == "dropout":  # the reference's formula on the chunk of the reference's mask
            lo, hi = self.bounds[i]
            local[id(s)] = args[0] * self._mask(s).narrow(self.d, lo, hi - lo) / (1.0 - s.attr("p"))
        else:
            local[id(s)] = eval_stage(s, args, self.comm)

    def _run_compute(self, j: int, i: int, env: dict, local: dict) -> None:
        for s in self.compute[j]:
            self._eval(s, i, env, local)

    def _run_comm(self, j: int, i: int, env: dict, local: dict) -> None:
        for s in self.comms[j]:  # collectives, and a fused collective's computations
            self._eval(s, i, env, local)

    def __call__(self, env: dict) -> None:
        for a in self.consts:
            env.setdefault(id(a), torch.tensor(a.attr("value"), dtype=a.dtype))
        for s in self.dropouts:  # made here, once: dropouts may run on either thread
            if not self.comm.pruning.touches((s,)):
                self._mask(s)
        n, ncomp = len(self.bounds), len(self.compute)
        chunks: list[dict] = [{} for _ in range(n)]
        th = comm_thread()
        pending: dict[tuple[int, int], Future] = {}
        order: list[Future] = []
        try:
            for t in range(n + ncomp - 1):
                for j in range(ncomp):
                    i = t - j
                    if not 0 <= i < n:
                        continue
                    if j > 0:
                        pending.pop((j - 1, i)).result()
                    self._run_compute(j, i, env, chunks[i])
                    if j < len(self.comms):
                        pending[(j, i)] = f = th.submit(self._run_comm, j, i, env, chunks[i])
                        order.append(f)
            for f in order:
                f.result()
        except BaseException:
            for f in order:  # let in-flight communication finish before unwinding
                f.exception()
            raise
        for s in self.needed:
            env[id(s)] = torch.cat([c[id(s)] for c in chunks], dim=self.d)


def _reference_mask(s: Node, comm: StageComm) -> torch.Tensor:
    """The keep mask (as s.dtype) the reference (runtime.reference.stage) applies to this rank's value of dropout
    stage `s`."""
    return rank_dropout_mask(s, comm).to(s.dtype).contiguous()
