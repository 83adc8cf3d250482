"""What one stage means on this rank of a real process group: the reference semantics every fast step is tested
against and falls back to.

`StageComm` is the (sub)group a program talks in (shared memory within a node, torch.distributed otherwise);
`eval_stage` computes one stage from this rank's operand values through a rule table keyed by op (one rule per op
of dsl.registry); `run_stage` reads and writes the values in `env` (id(node) -> this rank's tensor) and skips what
this rank prunes (runtime.reference.prune). Values are *local* (a Sliced tensor is this rank's slice), unlike the
interpreter's global values; tests compare the two.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from cocosync.dsl.check import check_world, program_groups, world_independent
from cocosync.dsl.ir import Node, Program
from cocosync.dsl.registry import names
from cocosync.dsl.types import FLAT, ReduceOp, Sliced, local_shape_of, part_of
from cocosync.interp import ELEMENTWISE, dropout_mask, segment_norms
from cocosync.runtime.comm.communicators import group_communicator, shared_communicator
from cocosync.runtime.reference.prune import prune

__all__ = ["StageComm", "local_shape", "eval_stage", "run_stage", "run_stages", "rank_dropout_mask", "COMM_RULES",
           "BACKENDS"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
BACKENDS = ("auto", "shm", "torch")


def local_shape(node: Node, gsize: int) -> tuple[int, ...]:
    """The shape of this rank's part of `node` in a group of `gsize` ranks (a flat slice is 1-D)."""
    return local_shape_of(node.shape, node.layout, gsize)


class StageComm:
    """This rank's view of the (sub)group a program's communication runs in.

    backend 'shm': collectives through the node's shared memory (and torch.distributed between nodes);
    'torch': torch.distributed only; 'auto' (default, or $COCOSYNC_BACKEND): shm on CPU when the program talks
    over the whole world, or over subgroups whose ranks share a node (e.g. the tensor-parallel ranks of a pipeline
    stage); torch otherwise. Point-to-point `send` always goes through torch.distributed (between pipeline stages,
    usually between nodes).
    """

    def __init__(self, program: Program, group: dist.ProcessGroup | None, backend: str | None = None):
        alone = world_independent(program)  # e.g. EASGD's update against its centre: no process group needed
        if not dist.is_initialized() and not alone:
            raise RuntimeError("cocosync.compile: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group (torchrun sets up its environment) first")
        me = dist.get_rank() if dist.is_initialized() else 0
        ranks = [me] if alone else dist.get_process_group_ranks(group or dist.group.WORLD)
        self.world = len(ranks)
        self.group_size = check_world(program, self.world)
        pos = ranks.index(me)
        self.group_rank, self.group_index = pos % self.group_size, pos // self.group_size
        self.global_ranks = ranks
        ngroups = program_groups(program)
        if ngroups == 1:
            self.group, self.members = group, ranks
        else:  # every rank must create every subgroup, in the same order
            subs = [dist.new_group(ranks[g * self.group_size:(g + 1) * self.group_size]) for g in range(ngroups)]
            lo = self.group_index * self.group_size
            self.group, self.members = subs[self.group_index], ranks[lo:lo + self.group_size]
        backend = backend or os.environ.get("COCOSYNC_BACKEND", "auto")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
        whole_world = list(self.members) == list(range(dist.get_world_size() if dist.is_initialized() else 1))
        self.shm = None
        if backend != "torch" and self.group_size > 1:
            self.shm = shared_communicator() if whole_world else group_communicator(self.members, self.group)
        if backend == "shm" and self.shm is None and not alone:
            raise ValueError(f"backend='shm' needs more than one rank and a (sub)group on one node or the whole "
                             f"world; this program's group is global ranks {self.members}: use 'torch' or 'auto'")
        self.backend = "shm" if self.shm is not None else "torch"
        self.pruning = prune(program, self.group_index, ngroups)
        self.device = torch.device("cpu")  # the inputs' device, set by each call
        # roots are numbered in the group; the world communicator takes global ranks, a subgroup's its own
        self._shm_root = (lambda r: self.members[r]) if whole_world else (lambda r: r)

    # each collective works in float32 for low-precision inputs, matching the oracle's accumulation
    def _on_shm(self, x: torch.Tensor) -> bool:
        return self.shm is not None and x.device.type == "cpu"

    def all_reduce(self, x: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        if self._on_shm(x):
            return self.shm.all_reduce(x, op, out=torch.empty_like(x, memory_format=torch.contiguous_format))
        t = x.float() if x.dtype != torch.float32 else x.clone()
        dist.all_reduce(t, op.dist_op, group=self.group)
        if op is ReduceOp.MEAN:
            t /= self.group_size
        return t.to(x.dtype)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp, dim: int) -> torch.Tensor:
        if self._on_shm(x):
            return self.shm.reduce_scatter(x.movedim(dim, 0).contiguous(), op).movedim(0, dim).contiguous()
        t = x.float().movedim(dim, 0).contiguous()
        out = torch.empty((t.shape[0] // self.group_size, *t.shape[1:]), dtype=t.dtype, device=t.device)
        _reduce_scatter(out, t, op.dist_op, group=self.group)
        if op is ReduceOp.MEAN:
            out /= self.group_size
        return out.movedim(0, dim).to(x.dtype).contiguous()

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        t = x.movedim(dim, 0).contiguous()
        if self._on_shm(x):
            return self.shm.all_gather(t).movedim(0, dim).contiguous()
        out = torch.empty((t.shape[0] * self.group_size, *t.shape[1:]), dtype=t.dtype, device=t.device)
        _all_gather(out, t, group=self.group)
        return out.movedim(0, dim).contiguous()

    def broadcast(self, x: torch.Tensor, root: int) -> torch.Tensor:
        t = x.clone(memory_format=torch.contiguous_format)
        if self._on_shm(x):
            return self.shm.broadcast(t, self._shm_root(root))
        dist.broadcast(t, src=self.members[root], group=self.group)
        return t

    def reduce(self, x: torch.Tensor, op: ReduceOp, root: int) -> torch.Tensor:
        if self._on_shm(x):
            return self.shm.reduce(x.clone(memory_format=torch.contiguous_format), op, self._shm_root(root))
        t = x.float() if x.dtype != torch.float32 else x.clone()
        dist.reduce(t, dst=self.members[root], op=op.dist_op, group=self.group)
        if self.group_rank != root:
            return x.clone()
        if op is ReduceOp.MEAN:
            t /= self.group_size
        return t.to(x.dtype)

    def send(self, x: torch.Tensor | None, shape: tuple[int, ...] = (),
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """Send x to the next group, return what the previous group sent (zeros on the first group). x None: the
        last group, whose send only receives (a tensor of `shape`, `dtype`)."""
        pos = self.group_index * self.group_size + self.group_rank
        out = torch.zeros(shape, dtype=dtype, device=self.device) if x is None else torch.zeros_like(x)
        reqs = []
        if pos + self.group_size < self.world:
            if x is None:
                raise RuntimeError(f"send on global rank {self.global_ranks[pos]}: nothing to send to the next group")
            reqs.append(dist.isend(x.contiguous(), self.global_ranks[pos + self.group_size]))
        if pos - self.group_size >= 0:
            reqs.append(dist.irecv(out, self.global_ranks[pos - self.group_size]))
        for r in reqs:
            r.wait()
        return out

    def part(self, x: torch.Tensor, dim: int | str) -> torch.Tensor:
        """This rank's part of a whole tensor sliced along `dim` (FLAT: of its elements)."""
        return part_of(x, Sliced(dim), self.group_size, self.group_rank)


def rank_dropout_mask(s: Node, comm: StageComm, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The keep mask (float32, 0/1) of dropout stage `s` on this rank: a Local value draws its own per rank, a
    Replicated or Sliced one the whole tensor's mask (this rank's part of it), so slicing does not change results."""
    p, seed = s.attr("p"), s.attr("seed")
    if s.layout.is_local:
        return dropout_mask(shape or local_shape(s, comm.group_size), p, seed,
                            rank=comm.group_index * comm.group_size + comm.group_rank)
    mask = dropout_mask(s.shape, p, seed)
    return comm.part(mask, s.layout.dim) if s.layout.is_sliced else mask


def _segment_norm(s: Node, x: torch.Tensor, comm: StageComm) -> torch.Tensor:
    """segment_norm of this rank's part: for a Sliced operand, sums of squares of the segments' pieces in this
    slice, summed over the group, then each element of the slice gets its segment's norm."""
    sizes = s.attr("sizes")
    if not s.args[0].layout.is_sliced or comm.group_size == 1:
        return segment_norms(x, sizes).to(s.dtype)
    lo = comm.group_rank * -(-s.shape[0] // comm.group_size)  # this slice's start (torch.chunk's split)
    ends = torch.tensor(sizes).cumsum(0)
    seg = torch.searchsorted(ends, torch.arange(lo, lo + x.numel()), right=True)  # segment of each element
    sums = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, seg, x.double() ** 2)
    sums = comm.all_reduce(sums.float(), ReduceOp.SUM)
    return sums.sqrt()[seg].to(s.dtype)


def _align(arg: Node, value: torch.Tensor, out: Node, comm: StageComm) -> torch.Tensor:
    """A Replicated operand of a Sliced result: keep the part that lines up with this rank's slice."""
    if not (out.layout.is_sliced and arg.layout.is_replicated and comm.group_size > 1):
        return value
    if out.layout.is_flat:  # the DSL's types: a tensor operand of a flat result has the full shape
        return comm.part(value, FLAT) if arg.ndim else value
    d = out.layout.dim - (out.ndim - arg.ndim)
    if d < 0 or arg.shape[d] != out.shape[out.layout.dim]:
        return value  # broadcast along the sliced dim
    return comm.part(value, d)


def _reduce_tensor(s: Node, x: torch.Tensor, comm: StageComm) -> torch.Tensor:
    """norm / reduce_tensor over the whole tensor: a Sliced operand's partial results are combined over the group."""
    arg, norm = s.args[0], s.op == "norm"
    rop = ReduceOp.SUM if norm else s.attr("op")
    local = (x.float() ** 2).sum() if norm else rop.partial(x.float())
    if arg.layout.is_sliced:
        local = comm.all_reduce(local, ReduceOp.SUM if rop is ReduceOp.MEAN else rop)
    if rop is ReduceOp.MEAN:
        local = local / (torch.Size(arg.shape).numel() if arg.layout.is_sliced else x.numel())
    return (local.sqrt() if norm else local).to(s.dtype)


def _update(s: Node, args: list[torch.Tensor], comm: StageComm) -> torch.Tensor:
    state, value = s.args[0], args[1]
    if state.layout.is_sliced and s.args[1].layout.is_replicated and s.args[1].ndim:
        value = comm.part(value, state.layout.dim)
    return value


def _elementwise(s: Node, args: list[torch.Tensor], comm: StageComm) -> torch.Tensor:
    return ELEMENTWISE[s.op](*(_align(a, v, s, comm) for a, v in zip(s.args, args))).to(s.dtype)


Rule = Callable[[Node, list[torch.Tensor], StageComm], torch.Tensor]
#: communication (and scatter): one operand; the overlap step runs these on its communication thread
COMM_RULES: dict[str, Callable[[Node, torch.Tensor, StageComm], torch.Tensor]] = {
    "all_reduce": lambda s, x, c: c.all_reduce(x, s.attr("op")),
    "reduce_scatter": lambda s, x, c: (c.reduce_scatter(x.reshape(-1), s.attr("op"), 0) if s.layout.is_flat
                                       else c.reduce_scatter(x, s.attr("op"), s.layout.dim)),
    "all_gather": lambda s, x, c: (c.all_gather(x, 0).view(s.shape) if s.args[0].layout.is_flat
                                   else c.all_gather(x, s.args[0].layout.dim)),
    "broadcast": lambda s, x, c: c.broadcast(x, s.attr("root")),
    "reduce": lambda s, x, c: c.reduce(x, s.attr("op"), s.attr("root")),
    "scatter": lambda s, x, c: c.part(x, s.layout.dim).contiguous(),
    "send": lambda s, x, c: c.send(x, local_shape(s, c.group_size), s.dtype),
}
#: op -> its value on this rank (every non-leaf op of dsl.registry has one: tests/dsl/test_registry.py)
RULES: dict[str, Rule] = {
    **{op: _elementwise for op in names(lambda d: d.elementwise)},
    **{op: (lambda f: lambda s, a, c: f(s, a[0], c))(f) for op, f in COMM_RULES.items()},
    "cast": lambda s, a, c: a[0].to(s.attr("to")),
    "dropout": lambda s, a, c: a[0] * rank_dropout_mask(s, c, tuple(a[0].shape)).to(a[0].dtype) / (1.0 - s.attr("p")),
    "matmul": lambda s, a, c: a[0] @ a[1],
    "segment_norm": lambda s, a, c: _segment_norm(s, a[0], c),
    "norm": lambda s, a, c: _reduce_tensor(s, a[0], c),
    "reduce_tensor": lambda s, a, c: _reduce_tensor(s, a[0], c),
    "update": _update,
}


def eval_stage(s: Node, args: list[torch.Tensor], comm: StageComm) -> torch.Tensor:
    """The value of stage `s` on this rank from its operands' values (this rank's parts)."""
    return RULES[s.op](s, args, comm)


def run_stage(s: Node, env: dict[int, torch.Tensor], comm: StageComm) -> torch.Tensor:
    """Run stage `s` on this rank: read its arguments from `env` (keyed by id(node)), store and return its value.
    Stages this rank prunes (runtime.reference.prune) are not run: dead ones store nothing, zero ones store zeros."""
    if comm.pruning and comm.pruning.touches((s,)):
        if id(s) in comm.pruning.zero:
            device = next((env[id(a)].device for a in s.args if id(a) in env), comm.device)
            env[id(s)] = torch.zeros(local_shape(s, comm.group_size), dtype=s.dtype, device=device)
        return env.get(id(s))
    args = []
    for a in s.args:
        if a.op == "const":
            env.setdefault(id(a), torch.tensor(a.attr("value"), dtype=a.dtype))
        args.append(env.get(id(a)) if s.op == "send" else env[id(a)])  # the last group's send needs no value
    env[id(s)] = out = eval_stage(s, args, comm)
    return out



def run_stages(stages: Iterable[Node], env: dict[int, torch.Tensor], comm: StageComm) -> None:
    """The reference implementation of a step: its stages one by one."""
    for s in stages:
        run_stage(s, env, comm)
