"""What the fast forms of plan steps share: their options, the step's outside readers, constants, and the fused
collectives' buffers, first-call timeout and result bookkeeping."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from cocosync.dsl.ir import Node, Program
from cocosync.dsl.types import ReduceOp
from cocosync.runtime.comm.collectives import ShmCommunicator
from cocosync.runtime.comm.tuned import tuned
from cocosync.runtime.steps.codegen import EAGER_WORK, default_backend

Runner = Callable[[dict], None]
FIRST_CALL_TIMEOUT = 900.0  # seconds: a cold Inductor compile on a busy 2-core machine can take minutes
# bytes (of gradient) per call of a fused collective's kernel: each call of a compiled kernel costs ~30 us of
# guards and wrappers, ~half the work of a 256 KB chunk, so the kernel runs on several reduced chunks at once.
# The default (2 MB: best of 0.25-8 MB in bench dp) gives way to $COCOSYNC_KERNEL_BYTES, then to what
# `cocosync tune kernel-bytes` measured on this machine (runtime/comm/tuned.py)
DEFAULT_KERNEL_BYTES = 2 << 20


def kernel_bytes(options: "StepOptions", local_ranks: int) -> int:
    if options.kernel_bytes is not None:
        return options.kernel_bytes
    return tuned("kernel_bytes", local_ranks, DEFAULT_KERNEL_BYTES)


def local_ranks_of(comm) -> int:
    """Ranks on this node in the step's group (1 where its collectives are torch's)."""
    return comm.shm.local_size if comm.shm is not None else 1


def eager_work(options: "StepOptions", local_ranks: int) -> int:
    """Elements x stages below which a compiled kernel runs its eager source: the option, else $COCOSYNC_EAGER_WORK,
    else what `cocosync tune eager-work` measured on this machine, else the hand-tuned EAGER_WORK."""
    if options.eager_work is not None:
        return options.eager_work
    return tuned("eager_work", local_ranks, EAGER_WORK)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOptions:
    """How a compiled plan runs its fast steps."""

    kernels: str
    """Generated kernels' backend: 'inductor' or 'eager'."""
    donate: frozenset[str] = frozenset()
    """Inputs whose contents the program may consume (e.g. arena gradients, reduced in place)."""
    fuse_reduction: bool = True
    """Within a node a fused collective's kernel sums the ranks' chunks itself (False: the collective reduces
    first and the kernel reads the reduced chunk; kept for A/B measurements)."""
    kernel_bytes: int | None = None
    """Bytes of gradient per call of a fused collective's kernel (None: the tuned value, `kernel_bytes()`)."""
    eager_work: int | None = None
    """Elements x stages below which a compiled kernel runs eagerly (None: the tuned value, `eager_work()`)."""

    @classmethod
    def make(cls, *, kernels: str | None = None, donate: frozenset[str] = frozenset(),
             fuse_reduction: bool | None = None, kernel_bytes: int | None = None,
             eager_work: int | None = None) -> "StepOptions":
        """Defaults from the environment: $COCOSYNC_KERNELS, $COCOSYNC_FUSE_REDUCTION (0 turns it off)."""
        if fuse_reduction is None:
            fuse_reduction = os.environ.get("COCOSYNC_FUSE_REDUCTION", "1") != "0"
        if kernel_bytes is not None and (not isinstance(kernel_bytes, int) or kernel_bytes < 1):
            raise ValueError(f"kernel_bytes={kernel_bytes!r}: expected a positive number of bytes")
        if eager_work is not None and (not isinstance(eager_work, int) or eager_work < 0):
            raise ValueError(f"eager_work={eager_work!r}: expected a number of elements x stages >= 0")
        return cls(kernels=kernels or default_backend(), donate=donate, fuse_reduction=fuse_reduction,
                   kernel_bytes=kernel_bytes, eager_work=eager_work)


def outside_readers(program: Program, inside: set[int]) -> set[int]:
    """ids of the step's stages whose values are read outside the step or are program outputs."""
    needed = {id(o) for o in program.outputs}
    for s in program.stages:
        if id(s) not in inside:
            needed.update(id(a) for a in s.args)
    return needed & inside


def put_consts(nodes, env: dict) -> None:
    for a in nodes:
        if a.op == "const":
            env.setdefault(id(a), torch.tensor(a.attr("value"), dtype=a.dtype))


def kernel_reduce_of(shm: ShmCommunicator, rs: Node, fuse_reduction: bool) -> tuple[Node, int, float | None] | None:
    """`Kernel(reduce_of=...)` for a fused collective's kernel that sums the local ranks' chunks of reduce-scatter
    `rs` itself (StepOptions.fuse_reduction, within one node, sum or mean), else None (the collective reduces first)."""
    op = rs.attr("op")
    if not fuse_reduction or shm.nnodes > 1 or shm.local_size < 2 or op not in (ReduceOp.SUM, ReduceOp.MEAN):
        return None
    return rs, shm.local_size, 1.0 / shm.world if op is ReduceOp.MEAN else None


def reduce_buffer(rs: Node, env: dict, shm: ShmCommunicator, donate: frozenset[str], scratch: dict) -> torch.Tensor:
    """The arena tensor the fused collective reduces in place: the donated gradient itself when it already lives
    in shared memory (zero-copy), else a copy in an arena buffer allocated once (collectively) per runner."""
    g = env[id(rs.args[0])]
    if rs.args[0].op == "input" and rs.args[0].name in donate and shm.arena.locate(g) is not None:
        return g
    if "g" not in scratch:
        scratch["g"] = shm.arena.empty(g.shape, g.dtype)
    scratch["g"].copy_(g)
    return scratch["g"]


@contextmanager
def first_call_timeout(shm: ShmCommunicator, compiling: list):
    """While `compiling` (the first call, which compiles Inductor kernels inside the collective), peers wait up to
    FIRST_CALL_TIMEOUT; afterwards the communicator's own timeout again."""
    timeout = shm.flags.timeout
    if compiling:
        shm.flags.timeout = max(timeout, FIRST_CALL_TIMEOUT)
    try:
        yield
    finally:
        shm.flags.timeout = timeout
        compiling.clear()


def store_results(env: dict, ag: Node, w_update: Node | None, out: torch.Tensor, writes) -> None:
    """After a fused collective: the gathered value (also the Replicated state's new value) and the states written
    in place."""
    env[id(ag)] = out
    if w_update is not None:
        env[id(w_update)] = out
    for s in writes:
        env[id(s)] = env[id(s.args[0])]
