"""A fused collective whose sliced computation needs global norms (LAMB's trust ratio, gradient clipping).

A norm over the whole tensor cannot be finished chunk by chunk inside one reduce-scatter: every element that
depends on it must wait for it. So the step runs in phases over this rank's slice, still one reduce-scatter and
one all-gather of the data. A stage's level is the number of norms on its longest path from the inputs:

  0. reduce-scatter, and on each reduced chunk (while in cache) the level-0 stages (e.g. LAMB's moments and its
     update direction r), plus partial sums of squares of the operands of the level-1 norms;
  -- one all-reduce of those few partial sums; the norms and the scalars that depend on them (the trust ratio);
  1. the level-1 stages (w - lr * ratio * r), written straight into the Replicated state's slice; and so on
     (LAMB with clipping in the program has two levels: the clip norm, then ||r||);
  then the all-gather (none within a node when that state is node-shared).

Values that cross phases live in slice-sized scratch buffers (the reduced gradient stays where the reduce-scatter
left it; a new state value is read from the state). Each phase is one generated kernel (runtime.kernels).
"""

from __future__ import annotations

import torch

from cocosync.dsl.ir import Node, Program
from cocosync.runtime.fused import gather_slices, slice_bounds
from cocosync.runtime.kernels import build_kernel, can_fuse

FIRST_CALL_TIMEOUT = 900.0  # as fast_steps: the first call compiles inside the collective


def _levels(step) -> dict[int, int]:
    """id -> level (norms on the longest path from the inputs) for every stage of the step."""
    level: dict[int, int] = {}
    for s in step.order:
        level[id(s)] = max((level.get(id(a), 0) for a in s.args), default=0) + (s.op == "norm")
    return level


class _Layout:
    """What the runner needs to know about a step, checked; `ok` False means: use the reference path."""

    def __init__(self, step, program: Program, shm):
        self.ok = False
        rs, ag = step.rs, step.ag
        if shm is None or shm.nnodes > 1 or rs.layout.dim != 0 or ag.args[0].layout.dim != 0:
            return  # across nodes the slices repeat per node: partial sums would count each nnodes times
        self.norms = [s for s in step.compute if s.op == "norm"]
        if not self.norms:
            return
        self.rs, self.ag, self.shape = rs, ag, rs.shape
        self.inside, self.level = {id(s) for s in step.order}, _levels(step)
        self.w_update = next((o for o in program.stages if o.op == "update" and o.args[1] is ag), None)
        self.scalars = [s for s in step.compute if s.ndim == 0 and s.op != "norm"]
        scatters = [s for s in step.compute if s.op == "scatter"]
        body = [s for s in step.compute if s.ndim > 0 and s.op != "scatter" and s is not self.w_update]
        if not all(can_fuse(s) and s.shape == self.shape for s in body) or not all(map(can_fuse, self.scalars)):
            return
        if not all(s.layout.dim == 0 and s.args[0].shape == self.shape for s in scatters):
            return
        self.src_of = {id(s): s.args[0] for s in scatters}
        if any(self.kind(a) is None for s in body + self.norms for a in s.args if a.op != "const"):
            return
        self.gathered = ag.args[0]
        self.K = max(self.level[id(s)] for s in body)
        self.phases = [[s for s in body if self.level[id(s)] == k] for k in range(self.K + 1)]
        self.writes = [[s for s in ph if s.op == "update"] for ph in self.phases]
        self.value_of_write = {id(s.args[1]): s for ph in self.writes for s in ph}
        # values a later phase (or a norm's partial sums, taken in the phase before the norm's level) reads
        read_at: dict[int, int] = {}
        for s in body + self.norms:
            at = self.level[id(s)] - (s.op == "norm")
            for a in s.args:
                read_at[id(a)] = max(read_at.get(id(a), 0), at)
        self.carried = [[s for s in ph if read_at.get(id(s), -1) > k and id(s) not in self.value_of_write
                         and s is not self.gathered] for k, ph in enumerate(self.phases)]
        self.ok = self._states_safe(program, body, read_at)

    def kind(self, a: Node) -> str | None:
        """How this rank reads its slice of operand `a` ('reduced', 'carried', 'global', 'local', 'scalar')."""
        if a is self.rs:
            return "reduced"
        if id(a) in self.inside and a.ndim and id(a) not in self.src_of:
            return "carried"
        if id(a) in self.src_of or (a.ndim and a.layout.is_replicated and a.shape == self.shape
                                    and id(a) not in self.inside):
            return "global"
        if a.ndim:
            return "local" if a.layout == self.rs.layout and a.shape == self.shape and id(a) not in self.inside \
                else None
        return "scalar"

    def _states_safe(self, program: Program, body: list[Node], read_at: dict[int, int]) -> bool:
        """States are written in place in their phase: nobody outside the step may read them, and no later phase
        may read their old value."""
        from cocosync.runtime.fast_steps import outside_readers

        users = program.users()
        w = self.w_update
        written = {id(s.args[0]): self.level[id(s)] for ph in self.writes for s in ph}
        if w is not None:
            written[id(w.args[0])] = self.level[id(self.gathered)]
            for sc, src in self.src_of.items():
                if src is w.args[0]:
                    written[sc] = written[id(src)]
        if any(read_at.get(i, -1) > k for i, k in written.items()):
            return False
        for s in [*(s for ph in self.writes for s in ph), *([w] if w else [])]:
            if any(id(u) not in self.inside for u in users[s.args[0].name] if u is not s):
                return False
        allowed = {id(self.ag), id(w) if w else 0, *(id(s) for ph in self.writes for s in ph)}
        return all(i in allowed for i in outside_readers(program, self.inside))


def norm_collective_runner(step, program: Program, comm, kernels: str | None, donate: frozenset[str]):
    """The phased runner of a FusedCollective with norms, or None when a precondition fails (reference path)."""
    from cocosync.runtime.fast_steps import KERNEL_BYTES, put_consts

    shm = getattr(comm, "shm", None)
    lay = _Layout(step, program, shm)
    if not lay.ok:
        return None
    rs, ag, w_update, gathered = lay.rs, lay.ag, lay.w_update, lay.gathered
    kerns = []
    for k, ph in enumerate(lay.phases):
        outs = [*([gathered] if gathered in ph else []), *lay.writes[k], *lay.carried[k]]
        first = 1 if gathered in ph else 0
        reads_out = {id(s.args[0]): first + j for j, s in enumerate(lay.writes[k])}
        if gathered in ph and w_update is not None:
            reads_out.update({sc: 0 for sc, src in lay.src_of.items() if src is w_update.args[0]})
        kerns.append(build_kernel(ph, outs, kernels, name=f"fused_{rs.name}_{k}", into=True, reads_out=reads_out)
                     if ph else None)
    scratch: dict[int, torch.Tensor] = {}
    compiling = [True] if any(k is not None and k.backend == "inductor" for k in kerns) else []

    def run(env: dict) -> None:
        from cocosync.runtime.executor import run_stage

        def scalars_at(k: int) -> None:
            for s in lay.scalars:
                if lay.level[id(s)] == k:
                    run_stage(s, env, comm)

        scalars_at(0)
        put_consts([a for k in kerns if k is not None for a in k.inputs], env)
        g = env[id(rs.args[0])]
        if rs.args[0].op == "input" and rs.args[0].name in donate and shm.arena.locate(g) is not None:
            buf = g.view(-1)  # donated arena gradients: reduced in place
        else:
            if -1 not in scratch:
                scratch[-1] = shm.arena.empty(g.shape, g.dtype)
            buf = scratch[-1].view(-1)
            buf.copy_(g.view(-1))
        writes = [s for ph in lay.writes for s in ph]
        state = {id(s): env[id(s.args[0])].view(-1) for s in writes if env[id(s.args[0])].is_contiguous()}
        out = env[id(w_update.args[0])] if w_update is not None else torch.empty(ag.shape, dtype=ag.dtype)
        if len(state) < len(writes) or not out.is_contiguous():
            return step.run(env, comm)
        flat_out = out.view(-1)
        start, stop = slice_bounds(shm, buf.numel())
        for c in (c for ph in lay.carried for c in ph):
            if id(c) not in scratch or scratch[id(c)].numel() != stop - start:
                scratch[id(c)] = torch.empty(stop - start, dtype=c.dtype)
        values = {id(v): state[id(s)] for v, s in ((s.args[1], s) for s in writes)}
        values.update({id(c): scratch[id(c)] for ph in lay.carried for c in ph})
        values[id(gathered)] = flat_out[start:stop]

        def view(a: Node, offset: int, n: int) -> torch.Tensor:
            k, lo = lay.kind(a), offset - start
            if k == "reduced":
                return buf[offset:offset + n]
            if k == "carried":
                return values[id(a)][lo:lo + n]
            if k == "global":
                return env[id(lay.src_of.get(id(a), a))].reshape(-1)[offset:offset + n]
            if k == "local":
                return env[id(a)].view(-1)[lo:lo + n]
            return env[id(a)]

        partial: list[float] = []

        def phase(k: int):
            kern, norms = kerns[k], [nm for nm in lay.norms if lay.level[id(nm)] == k + 1]
            partial[:] = [0.0] * len(norms)
            writes_k, carried_k, has_out = lay.writes[k], lay.carried[k], gathered in lay.phases[k]

            def chunk(offset: int, n: int) -> None:
                lo = offset - start
                if kern is not None:
                    kern(*(view(a, offset, n) for a in kern.inputs), *([flat_out[offset:offset + n]] * has_out),
                         *(state[id(s)][lo:lo + n] for s in writes_k), *(scratch[id(c)][lo:lo + n] for c in carried_k))
                for j, nm in enumerate(norms):
                    x = view(nm.args[0], offset, n).float()
                    partial[j] += float(torch.dot(x, x))
            return chunk, norms

        def finish_norms(norms: list[Node], k: int) -> None:
            if norms:
                sums = shm.all_reduce(torch.tensor(partial, dtype=torch.float32), "sum")
                for j, nm in enumerate(norms):
                    env[id(nm)] = sums[j].sqrt().to(nm.dtype)
            scalars_at(k)

        timeout = shm.flags.timeout
        if compiling:  # the first call compiles the kernels inside the collective: peers wait longer, once
            shm.flags.timeout = max(timeout, FIRST_CALL_TIMEOUT)
        try:
            chunk, norms = phase(0)
            shm.fused_all_reduce(buf, lambda offset, red, _out: chunk(offset, red.numel()),
                                 op=rs.attr("op").value, gather=False, fn_bytes=KERNEL_BYTES)
            finish_norms(norms, 1)
            step_elems = max(1, max(shm.chunk_bytes, KERNEL_BYTES) // buf.element_size())
            for k in range(1, lay.K + 1):
                chunk, norms = phase(k)
                for a in range(start, stop, step_elems):
                    chunk(a, min(step_elems, stop - a))
                finish_norms(norms, k + 1)
            gather_slices(shm, flat_out)
        finally:
            shm.flags.timeout = timeout
            compiling.clear()
        env[id(ag)] = out
        if w_update is not None:
            env[id(w_update)] = out
        for s in writes:
            env[id(s)] = env[id(s.args[0])]
    return run
