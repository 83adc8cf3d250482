"""The distributed executor: runs a Program on the current rank of a real torch.distributed process group.

Unoptimized but real: each stage runs as torch ops on this rank's part of the values, and communication goes
through torch.distributed collectives (gloo on CPU, NCCL on GPU). Values are *local* here (a Sliced tensor is
this rank's slice), unlike the interpreter's global values; tests compare the two.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from cocosync.dsl.check import check_world, program_groups
from cocosync.dsl.ir import Node, Program
from cocosync.dsl.types import DslError, ReduceOp
from cocosync.interp import ELEMENTWISE, dropout_mask
from cocosync.runtime.prune import prune

__all__ = ["compile", "CompiledProgram", "local_shape", "run_stage"]

_DIST_OP = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MEAN: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX,
            ReduceOp.MIN: dist.ReduceOp.MIN}
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def local_shape(node: Node, gsize: int) -> tuple[int, ...]:
    """The shape of this rank's part of `node` in a group of `gsize` ranks."""
    shape = list(node.shape)
    if node.layout.is_sliced:
        shape[node.layout.dim] //= gsize
    return tuple(shape)


BACKENDS = ("auto", "shm", "torch")
_SHM: list = []  # one shared-memory communicator per process, shared by every compiled program
_GROUP_SHM: dict[tuple[int, ...], Any] = {}  # per node-local subgroup (its members' global ranks)


def shared_communicator():
    """This process's ShmCommunicator over the whole job (created on first use: a collective call)."""
    if not _SHM:
        from cocosync.runtime.collectives import ShmCommunicator

        _SHM.append(ShmCommunicator())
    return _SHM[0]


def group_communicator(members: list[int], group: dist.ProcessGroup):
    """A ShmCommunicator over a subgroup whose members all live on this node (None if they span nodes), created
    on first use (collective over the members) and shared by every program over the same members."""
    key = tuple(members)
    if key not in _GROUP_SHM:
        from cocosync.runtime.collectives import ShmCommunicator
        from cocosync.runtime.group import subgroup_node_groups

        ng = subgroup_node_groups(list(members), group)
        _GROUP_SHM[key] = ShmCommunicator(ng) if ng is not None else None
    return _GROUP_SHM[key]


class _Comm:
    """This rank's view of the (sub)group a program's communication runs in.

    backend 'shm': collectives through the node's shared memory (and torch.distributed between nodes);
    'torch': torch.distributed only; 'auto' (default, or $COCOSYNC_BACKEND): shm on CPU when the program talks
    over the whole world, or over subgroups whose ranks share a node (e.g. the tensor-parallel ranks of a pipeline
    stage); torch otherwise. Point-to-point `send` always goes through torch.distributed (between pipeline stages,
    usually between nodes).
    """

    def __init__(self, program: Program, group: dist.ProcessGroup | None, backend: str | None = None):
        if not dist.is_initialized():
            raise RuntimeError("cocosync.compile: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group (torchrun sets up its environment) first")
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        me = dist.get_rank()
        self.world = len(ranks)
        self.G = check_world(program, self.world)
        pos = ranks.index(me)
        self.index, self.gid = pos % self.G, pos // self.G
        self.global_ranks = ranks
        ngroups = program_groups(program)
        if ngroups == 1:
            self.group, self.members = group, ranks
        else:  # every rank must create every subgroup, in the same order
            subs = [dist.new_group(ranks[g * self.G:(g + 1) * self.G]) for g in range(ngroups)]
            self.group, self.members = subs[self.gid], ranks[self.gid * self.G:(self.gid + 1) * self.G]
        backend = backend or os.environ.get("COCOSYNC_BACKEND", "auto")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
        whole_world = list(self.members) == list(range(dist.get_world_size()))
        self.shm = None
        if backend != "torch" and self.G > 1:
            self.shm = shared_communicator() if whole_world else group_communicator(self.members, self.group)
        if backend == "shm" and self.shm is None:
            raise ValueError(f"backend='shm' needs more than one rank and a (sub)group on one node or the whole "
                             f"world; this program's group is global ranks {self.members}: use 'torch' or 'auto'")
        self.backend = "shm" if self.shm is not None else "torch"
        self.pruning = prune(program, self.gid, ngroups)
        self.device = torch.device("cpu")  # the inputs' device, set by each call
        # roots are numbered in the group; the world communicator takes global ranks, a subgroup's its own
        self._shm_root = (lambda r: self.members[r]) if whole_world else (lambda r: r)

    # each collective works in float32 for low-precision inputs, matching the oracle's accumulation
    def _on_shm(self, x: torch.Tensor) -> bool:
        return self.shm is not None and x.device.type == "cpu"

    def all_reduce(self, x: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        if self._on_shm(x):
            return self.shm.all_reduce(x, op.value, out=torch.empty_like(x, memory_format=torch.contiguous_format))
        t = x.float() if x.dtype != torch.float32 else x.clone()
        dist.all_reduce(t, _DIST_OP[op], group=self.group)
        if op is ReduceOp.MEAN:
            t /= self.G
        return t.to(x.dtype)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp, dim: int) -> torch.Tensor:
        if self._on_shm(x):
            return self.shm.reduce_scatter(x.movedim(dim, 0).contiguous(), op.value).movedim(0, dim).contiguous()
        t = x.float().movedim(dim, 0).contiguous()
        out = torch.empty((t.shape[0] // self.G, *t.shape[1:]), dtype=t.dtype, device=t.device)
        _reduce_scatter(out, t, _DIST_OP[op], group=self.group)
        if op is ReduceOp.MEAN:
            out /= self.G
        return out.movedim(0, dim).to(x.dtype).contiguous()

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        t = x.movedim(dim, 0).contiguous()
        if self._on_shm(x):
            return self.shm.all_gather(t).movedim(0, dim).contiguous()
        out = torch.empty((t.shape[0] * self.G, *t.shape[1:]), dtype=t.dtype, device=t.device)
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
            return self.shm.reduce(x.clone(memory_format=torch.contiguous_format), op.value, self._shm_root(root))
        t = x.float() if x.dtype != torch.float32 else x.clone()
        dist.reduce(t, dst=self.members[root], op=_DIST_OP[op], group=self.group)
        if self.index != root:
            return x.clone()
        if op is ReduceOp.MEAN:
            t /= self.G
        return t.to(x.dtype)

    def send(self, x: torch.Tensor | None, shape: tuple[int, ...] = (), dtype: torch.dtype | None = None) -> torch.Tensor:
        """Send x to the next group, return what the previous group sent (zeros on the first group). x None: the
        last group, whose send only receives (a tensor of `shape`, `dtype`)."""
        pos = self.gid * self.G + self.index
        out = torch.zeros(shape, dtype=dtype, device=self.device) if x is None else torch.zeros_like(x)
        reqs = []
        if pos + self.G < self.world:
            if x is None:
                raise RuntimeError(f"send on global rank {self.global_ranks[pos]}: nothing to send to the next group")
            reqs.append(dist.isend(x.contiguous(), self.global_ranks[pos + self.G]))
        if pos - self.G >= 0:
            reqs.append(dist.irecv(out, self.global_ranks[pos - self.G]))
        for r in reqs:
            r.wait()
        return out

    def part(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.chunk(self.G, dim=dim)[self.index]


def _segment_norm(s: Node, x: torch.Tensor, comm: "_Comm") -> torch.Tensor:
    """segment_norm of this rank's part: for a Sliced operand, sums of squares of the segments' pieces in this
    slice, summed over the group, then each element of the slice gets its segment's norm."""
    from cocosync.interp import segment_norms

    sizes = s.attr("sizes")
    if not s.args[0].layout.is_sliced or comm.G == 1:
        return segment_norms(x, sizes).to(s.dtype)
    lo = comm.index * -(-s.shape[0] // comm.G)  # this slice's start (torch.chunk's split)
    ends = torch.tensor(sizes).cumsum(0)
    seg = torch.searchsorted(ends, torch.arange(lo, lo + x.numel()), right=True)  # segment of each element
    sums = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, seg, x.double() ** 2)
    sums = comm.all_reduce(sums.float(), ReduceOp.SUM)
    return sums.sqrt()[seg].to(s.dtype)


def _align(arg: Node, value: torch.Tensor, out: Node, comm: _Comm) -> torch.Tensor:
    """A Replicated operand of a Sliced result: keep the part that lines up with this rank's slice."""
    if not (out.layout.is_sliced and arg.layout.is_replicated and comm.G > 1):
        return value
    d = out.layout.dim - (out.ndim - arg.ndim)
    if d < 0 or arg.shape[d] != out.shape[out.layout.dim]:
        return value  # broadcast along the sliced dim
    return comm.part(value, d)


_SCALAR_REDUCE = {ReduceOp.SUM: torch.sum, ReduceOp.MEAN: torch.sum, ReduceOp.MAX: torch.amax,
                  ReduceOp.MIN: torch.amin}


def _run_stage(s: Node, args: list[torch.Tensor], comm: _Comm) -> torch.Tensor:
    op = s.op
    if op == "cast":
        return args[0].to(s.attr("to"))
    if op == "dropout":
        x, p, seed = args[0], s.attr("p"), s.attr("seed")
        if s.layout.is_local:
            mask = dropout_mask(x.shape, p, seed, rank=comm.gid * comm.G + comm.index)
        else:
            mask = dropout_mask(s.shape, p, seed)
            mask = comm.part(mask, s.layout.dim) if s.layout.is_sliced else mask
        return x * mask.to(x.dtype) / (1.0 - p)
    if op in ELEMENTWISE:
        return ELEMENTWISE[op](*(_align(a, v, s, comm) for a, v in zip(s.args, args))).to(s.dtype)
    if op == "matmul":
        return args[0] @ args[1]
    if op == "segment_norm":
        return _segment_norm(s, args[0], comm)
    if op in ("norm", "reduce_tensor"):
        (x,), arg = args, s.args[0]
        rop = ReduceOp.SUM if op == "norm" else s.attr("op")
        local = (x.float() ** 2).sum() if op == "norm" else _SCALAR_REDUCE[rop](x.float())
        if arg.layout.is_sliced:  # the norm/reduction is over the whole tensor: combine the slices
            local = comm.all_reduce(local, ReduceOp.SUM if rop is ReduceOp.MEAN else rop)
        if rop is ReduceOp.MEAN:
            local = local / torch.Size(arg.shape).numel() if arg.layout.is_sliced else local / x.numel()
        return (local.sqrt() if op == "norm" else local).to(s.dtype)
    if op == "update":
        state, value = s.args[0], args[1]
        if state.layout.is_sliced and s.args[1].layout.is_replicated and s.args[1].ndim:
            value = comm.part(value, state.layout.dim)
        return value
    return _COMM_STAGE[op](s, args[0], comm)


def run_stage(s: Node, env: dict[int, torch.Tensor], comm: _Comm) -> torch.Tensor:
    """Run stage `s` on this rank: read its arguments from `env` (keyed by id(node)), store and return its value.
    Stages this rank prunes (runtime.prune) are not run: dead ones store nothing, zero ones store zeros."""
    if comm.pruning and comm.pruning.touches((s,)):
        if id(s) in comm.pruning.zero:
            device = next((env[id(a)].device for a in s.args if id(a) in env), comm.device)
            env[id(s)] = torch.zeros(local_shape(s, comm.G), dtype=s.dtype, device=device)
        return env.get(id(s))
    args = []
    for a in s.args:
        if a.op == "const":
            env.setdefault(id(a), torch.tensor(a.attr("value"), dtype=a.dtype))
        args.append(env.get(id(a)) if s.op == "send" else env[id(a)])  # the last group's send needs no value
    env[id(s)] = out = _run_stage(s, args, comm)
    return out


_COMM_STAGE: dict[str, Callable[[Node, torch.Tensor, _Comm], torch.Tensor]] = {
    "all_reduce": lambda s, x, c: c.all_reduce(x, s.attr("op")),
    "reduce_scatter": lambda s, x, c: c.reduce_scatter(x, s.attr("op"), s.layout.dim),
    "all_gather": lambda s, x, c: c.all_gather(x, s.args[0].layout.dim),
    "broadcast": lambda s, x, c: c.broadcast(x, s.attr("root")),
    "reduce": lambda s, x, c: c.reduce(x, s.attr("op"), s.attr("root")),
    "scatter": lambda s, x, c: c.part(x, s.layout.dim).contiguous(),
    "send": lambda s, x, c: c.send(x, local_shape(s, c.G), s.dtype),
}


class CompiledProgram:
    """Callable: `out = fn(**inputs)` with this rank's parts of the inputs; returns {output name: local tensor}.

    States written by `update` are modified in place (and returned under the state's name).
    """

    def __init__(self, program: Program, group: dist.ProcessGroup | None = None, backend: str | None = None):
        self.program = program
        self.comm = _Comm(program, group, backend)
        self._shapes = {n.name: local_shape(n, self.comm.G) for n in program.inputs}

    def _check_inputs(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        p = self.program
        names = {n.name for n in p.inputs}
        unused = self.comm.pruning.unused_inputs
        if missing := sorted(names - set(inputs) - unused):
            raise DslError(f"{p.name}: missing inputs {missing}")
        if extra := sorted(set(inputs) - names):
            raise DslError(f"{p.name}: unknown inputs {extra}; the program takes {sorted(names)}")
        out = {}
        device = None
        for n in p.inputs:
            if n.name not in inputs:
                continue  # not read on this rank (see unused_inputs)
            v = inputs[n.name]
            if isinstance(v, (int, float)) and n.attr("kind") == "scalar":
                v = torch.tensor(float(v), dtype=n.dtype)
            if not isinstance(v, torch.Tensor):
                raise DslError(f"{p.name}: input {n.name!r} must be a tensor, got {type(v).__name__}")
            want = self._shapes[n.name]
            if tuple(v.shape) != want or v.dtype != n.dtype:
                raise DslError(f"{p.name}: input {n.name!r} ({n.layout}) on rank {dist.get_rank()} must have local "
                               f"shape {want} and dtype {n.dtype}; got shape {tuple(v.shape)} dtype {v.dtype}")
            if n.ndim and device is not None and v.device != device:
                raise DslError(f"{p.name}: input {n.name!r} is on {v.device}, other inputs are on {device}")
            device = device or (v.device if n.ndim else None)
            out[n.name] = v
        self.comm.device = device or torch.device("cpu")  # where values a pruned rank makes up (zeros) live
        return out

    @property
    def unused_inputs(self) -> frozenset[str]:
        """Inputs this rank's program does not read (e.g. what the last pipeline stage would send): may be omitted."""
        return self.comm.pruning.unused_inputs

    def __call__(self, **inputs: Any) -> dict[str, torch.Tensor]:
        env: dict[int, torch.Tensor] = {}
        given = self._check_inputs(inputs)
        for n in self.program.inputs:
            if n.name in given:
                env[id(n)] = given[n.name]
        self._run(env)
        return self._finish(env, given)

    def _run(self, env: dict[int, torch.Tensor]) -> None:
        for s in self.program.stages:
            run_stage(s, env, self.comm)

    def _finish(self, env: dict[int, torch.Tensor], given: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for s in self.program.stages:  # updates take effect when the program finishes
            if s.op == "update" and env[id(s)] is not given[s.args[0].name]:  # (fused steps write in place)
                given[s.args[0].name].copy_(env[id(s)].expand_as(given[s.args[0].name]))
        return {name: (given[o.args[0].name] if o.op == "update" else env[id(o)])
                for name, o in zip(self.program.output_names, self.program.outputs)}


def compile(program: Program, group: dist.ProcessGroup | None = None,  # noqa: A001
            backend: str | None = None) -> CompiledProgram:
    """Compile `program` for the current rank of `group` (default: the whole world).
    backend: 'auto' (default), 'shm' or 'torch' (see _Comm)."""
    return CompiledProgram(program, group, backend)
