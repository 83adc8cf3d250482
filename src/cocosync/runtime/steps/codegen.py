"""Fused compute kernels: a group of elementwise stages becomes one function, compiled once.

The group is turned into Python source (one line per stage, the same torch ops the executor uses), then
`torch.compile`d with Inductor, which fuses it into one loop over memory: the difference between ~7 passes
over the data and one for an Adam update. `backend="eager"` (or COCOSYNC_KERNELS=eager) runs the same
source without compiling: same results, no compile cost, useful in tests and on machines without a C++
compiler. Compilation happens on the first call and is reported separately (`Kernel.compile_seconds`);
Inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR, by default under ~/.cache/cocosync) makes later
processes start warm.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from cocosync.dsl.ir import Node
from cocosync.dsl.registry import OPS
from cocosync.interp import ELEMENTWISE

__all__ = ["Kernel", "build_kernel", "default_backend", "can_fuse", "line_of", "compile_function"]

BACKENDS = ("inductor", "eager")
_COMPILED: dict[tuple, object] = {}
# elements x stages below which an Inductor kernel runs its eager source instead: a compiled call costs 25-80 us of
# guards and wrappers (0.3 ms right after a large GEMM, with cold caches), more than a few eager ops on small
# tensors; measured crossover of a 3-op epilogue: ~128K elements (BENCHMARKS.md, tp). The hand-tuned
# default: $COCOSYNC_EAGER_WORK, then `cocosync tune eager-work`'s measurement (steps/common.eager_work) win
EAGER_WORK = int(os.environ.get("COCOSYNC_EAGER_WORK", 1 << 18))


def default_backend() -> str:
    backend = os.environ.get("COCOSYNC_KERNELS", "inductor")
    if backend not in BACKENDS:
        raise ValueError(f"COCOSYNC_KERNELS={backend!r}: expected one of {BACKENDS}")
    return backend


def can_fuse(stage: Node) -> bool:
    """Elementwise stages whose value depends only on their operands (dropout draws a mask: left out), and
    updates (inside a kernel, the new value of a state; writing it back is the caller's job)."""
    return OPS[stage.op].in_kernels


def line_of(s: Node, ref: dict[int, str]) -> str:
    """The source expression of stage `s` in a generated kernel (`ref`: id -> variable of its operands)."""
    args = [ref[id(a)] if id(a) in ref else repr(float(a.attr("value"))) for a in s.args]
    scalar_fn = OPS[s.op].scalar_fn  # torch.maximum/minimum reject Python numbers: clamp_min/clamp_max
    if scalar_fn and len(s.args) == 2 and s.args[1].op == "const" and id(s.args[0]) in ref:
        return f"torch.{scalar_fn}({args[0]}, {args[1]})"
    if scalar_fn and len(s.args) == 2 and s.args[0].op == "const" and id(s.args[1]) in ref:
        return f"torch.{scalar_fn}({args[1]}, {args[0]})"
    if s.op == "update":
        return args[1] if s.args[1].shape == s.shape else f"{args[1]}.expand_as({args[0]})"
    if s.op == "cast":
        return f"{args[0]}.to({s.attr('to')})"
    if s.op not in ELEMENTWISE:
        raise ValueError(f"generated kernels have no rule for {s.op!r} (stage {s.name})")
    return f"ops[{s.op!r}]({', '.join(args)})"


def _reduction(var: str, node: Node, count: int, scale: float | None,
               reduced_out: tuple[int, int] | None) -> tuple[list[str], str]:
    """The parameters that stand for `var` (one per rank, rank order; the one that is an output's memory is read
    from that output) and the source line that sums them into `var`, in the collectives' order and precision."""
    names = [f"{var}_{j}" for j in range(count)]
    params = [x for j, x in enumerate(names) if reduced_out is None or j != reduced_out[0]]
    if reduced_out is not None:
        names[reduced_out[0]] = f"out{reduced_out[1]}"
    widen = node.dtype != torch.float32  # 16-bit contributions are summed in float32, rounded once at the end
    suffix = ".float()" if widen else ""
    expr = names[0] + suffix
    for x in names[1:]:
        expr = f"({expr} + {x}{suffix})"
    if scale is not None:
        expr = f"({expr} * {float(scale)!r})"
    if widen:
        expr = f"{expr}.to({node.dtype})"
    return params, f"    {var} = {expr}  # {node.name}: reduced over {count} ranks"


class Kernel:
    """`kernel(*inputs) -> tuple(outputs)` over same-shaped (or 0-dim) local tensors.

    With `into=True` the kernel writes its outputs into tensors given after the inputs,
    `kernel(*inputs, *outs, *sqs, *sqvs) -> None`: Inductor then fuses the stores into the one loop (no temporaries).
    `sumsq` lists values (stages or inputs) whose float32 sum of squares the kernel also writes, each into a 0-dim
    tensor `sqs[i]`, in the same loop: the partial sums of a norm over this call's elements; `squares` lists values
    whose float32 squares it writes element by element (after the sums), for per-segment sums by the caller.
    `reads_out` maps inputs that are the very memory of an output (a state updated in place) to that output's
    index: the kernel reads them from the output tensor and they are not passed (`self.inputs` omits them), so
    no two arguments alias (aliased arguments make Inductor compile against their common base, whose size it then
    wrongly assumes for other calls).
    `reduce_of=(node, count, scale)`: the input `node` is the reduction of `count` tensors, passed in its place
    (rank order) and summed inside the kernel in that order (in float32 for 16-bit inputs, then scaled by `scale`
    unless None, then rounded to the node's dtype): the same bits as the collectives' chunk reduction, in the
    kernel's one pass (Inductor may keep a 16-bit reduced value in float32, as it does every intermediate).
    `reduced_out=(j, i)`: the j-th of those tensors is the memory of output i (the reduced value overwrites this
    rank's own contribution): it is read from that output and not passed, like `reads_out`."""

    def __init__(self, stages: Sequence[Node], outputs: Sequence[Node], backend: str, name: str = "kernel",
                 into: bool = False, reads_out: dict[int, int] | None = None, sumsq: Sequence[Node] = (),
                 squares: Sequence[Node] = (), reduce_of: tuple[Node, int, float | None] | None = None,
                 reduced_out: tuple[int, int] | None = None, eager_work: int | None = None):
        bad = [s.name for s in stages if not can_fuse(s)]
        if bad:
            raise ValueError(f"kernel {name!r}: stages {bad} are not fusable elementwise ops")
        inside = {id(s) for s in stages}
        self.sumsq, self.squares = list(sumsq), list(squares)
        if (self.sumsq or self.squares) and not into:
            raise ValueError(f"kernel {name!r}: sumsq and squares need into=True")
        self.inputs: list[Node] = []
        for a in [x for s in stages for x in s.args] + [x for x in self.sumsq + self.squares if id(x) not in inside]:
            if id(a) not in inside and a.op != "const" and all(a is not x for x in self.inputs):
                self.inputs.append(a)
        self.outputs, self.backend, self.name, self.into = list(outputs), backend, name, into
        reads_out = reads_out or {}
        if reads_out and not into:
            raise ValueError(f"kernel {name!r}: reads_out needs into=True")
        self.inputs = [a for a in self.inputs if id(a) not in reads_out]
        ref = {id(a): f"in{i}" for i, a in enumerate(self.inputs)}
        ref.update({i: f"out{j}" for i, j in reads_out.items()})
        body = []
        params = [f"in{i}" for i in range(len(self.inputs))]
        self.reduce_index: int | None = None
        if reduce_of is not None:
            node, count, scale = reduce_of
            k = next((i for i, a in enumerate(self.inputs) if a is node), None)
            if k is None or count < 2:
                raise ValueError(f"kernel {name!r}: reduce_of names {node.name!r} with count={count}: expected an "
                                 "input of the kernel and count >= 2")
            if reduced_out is not None and not (into and 0 <= reduced_out[0] < count
                                                and 0 <= reduced_out[1] < len(outputs)):
                raise ValueError(f"kernel {name!r}: reduced_out={reduced_out} needs into=True, a source index "
                                 f"< {count} and an output index < {len(outputs)}")
            self.reduce_index = k
            params[k:k + 1], line = _reduction(f"in{k}", node, count, scale, reduced_out)
            body.append(line)
        for i, s in enumerate(stages):
            ref[id(s)] = f"t{i}"
            body.append(f"    t{i} = {line_of(s, ref)}  # {s.name}")
        if into:
            params += [f"out{i}" for i in range(len(self.outputs))] + [f"sq{i}" for i in range(len(self.sumsq))]
            params += [f"sqv{i}" for i in range(len(self.squares))]
            # sums first: an operand may be read from an output's memory (reads_out) that the copies overwrite
            body += [f"    sq{i}.copy_({ref[id(x)]}.float().square().sum())" for i, x in enumerate(self.sumsq)]
            body += [f"    sqv{i}.copy_({ref[id(x)]}.float().square())" for i, x in enumerate(self.squares)]
            body += [f"    out{i}.copy_({ref[id(o)]})" for i, o in enumerate(self.outputs)]
            ret = "None"
        else:
            ret = f"({''.join(ref[id(o)] + ', ' for o in self.outputs)})"
        self.source = f"def {name}({', '.join(params)}):\n" + "\n".join(body) + f"\n    return {ret}\n"
        namespace: dict = {"ops": ELEMENTWISE, "torch": torch}
        exec(compile(self.source, f"<cocosync kernel {name}>", "exec"), namespace)  # noqa: S102 - our own source
        self.eager_fn = namespace[name]
        self._fn = self.eager_fn
        work = EAGER_WORK if eager_work is None else eager_work
        self._eager_below = -(-work // max(1, len(stages)))  # elements
        self.compile_seconds = 0.0
        self._first = False
        if backend == "inductor":  # one compiled function per distinct computation, shared by kernels
            key = ("\n".join(line.split("  #")[0] for line in self.source.splitlines()[1:]),
                   tuple((a.dtype, a.ndim) for a in self.inputs))
            if key not in _COMPILED:
                _inductor_cache_dir()
                _raise_recompile_limit()
                # in-place outputs are views into larger buffers (chunks of states): Inductor's dynamic-shape
                # handling of mutated views trips over their bases, so those kernels specialize per chunk size
                _COMPILED[key] = torch.compile(self.eager_fn, dynamic=not into, fullgraph=True)
                self._first = True
            self._fn = _COMPILED[key]

    @property
    def eager_below(self) -> int:
        """Inputs with fewer elements than this run the eager source (a compiled call costs more than it saves)."""
        return self._eager_below

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._fn is not self.eager_fn and max((a.numel() for a in args), default=0) < self._eager_below:
            return self.eager_fn(*args)
        if self._first:  # torch.compile compiles on the first call: time it apart from the steps
            t0 = time.perf_counter()
            out = self._fn(*args)
            self.compile_seconds = time.perf_counter() - t0
            self._first = False
            return out
        return self._fn(*args)


def compile_function(fn: Callable, *, dynamic: bool = True) -> Callable:
    """`fn` (a few in-place torch ops on flat vectors) as one Inductor loop, with the runtime's kernel cache; `fn`
    itself under COCOSYNC_KERNELS=eager."""
    if default_backend() == "eager":
        return fn
    _inductor_cache_dir()
    _raise_recompile_limit()
    return torch.compile(fn, dynamic=dynamic, fullgraph=True)


def _raise_recompile_limit(limit: int = 64) -> None:
    """Static-shape kernels compile once per distinct chunk size; keep dynamo from giving up on them."""
    import torch._dynamo.config as cfg

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < limit:
            setattr(cfg, name, limit)


def _inductor_cache_dir() -> None:
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cocosync" / "inductor"
        path.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)


def build_kernel(stages: Sequence[Node], outputs: Sequence[Node], backend: str | None = None,
                 name: str = "kernel", into: bool = False, reads_out: dict[int, int] | None = None,
                 sumsq: Sequence[Node] = (), squares: Sequence[Node] = (),
                 reduce_of: tuple[Node, int, float | None] | None = None,
                 reduced_out: tuple[int, int] | None = None, eager_work: int | None = None) -> Kernel:
    """A kernel computing `outputs` from the group `stages` (topologically ordered elementwise stages).
    backend: 'inductor' or 'eager' (default: COCOSYNC_KERNELS, else inductor). eager_work: elements x stages
    below which an Inductor kernel runs its eager source (default EAGER_WORK). See Kernel for the rest."""
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend {backend!r}: expected one of {BACKENDS}")
    return Kernel(stages, outputs, backend, name, into, reads_out, sumsq, squares, reduce_of, reduced_out, eager_work)
