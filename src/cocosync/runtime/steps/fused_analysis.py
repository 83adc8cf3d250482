"""What a FusedCollective step computes, worked out once: the facts its fast runner needs, or why it has none.

`analyze(step, program)` returns a frozen `FusedGroup` or a `NotFused` naming the first rule the step breaks
(as torch's `_should_use_fused_*` predicates do; `cocosync show --dump` prints it). It looks at the program only;
what depends on the ranks (a shared-memory communicator, the slice split across nodes) is `runtime_reason`.

A stage's *level* is the number of norms on its longest path from the inputs. A group without norms has one
phase (the plain FusedAllReduce: reduce-scatter, one kernel on each reduced chunk, all-gather); with norms (LAMB's
trust ratio, gradient clipping) phase k computes the level-k outputs and the partial sums of squares of the
level-(k+1) norms' operands, and the norms are finished between phases (runtime.steps.fused_collective).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from cocosync.dsl.ir import Node, Program
from cocosync.dsl.registry import OPS
from cocosync.dsl.types import FLAT
from cocosync.lower.plan import FusedCollective
from cocosync.runtime.comm.collectives import ShmCommunicator
from cocosync.runtime.steps.codegen import can_fuse
from cocosync.runtime.steps.common import outside_readers

__all__ = ["OperandKind", "Phase", "FusedGroup", "NotFused", "analyze", "runtime_reason"]


class OperandKind(enum.Enum):
    """How a rank reads its slice of a kernel operand, chunk by chunk."""

    REDUCED = "reduced"  # the reduce-scatter's value: the reduced chunk (in the reduce buffer)
    SEGNORM = "segnorm"  # a segment_norm of the group: each element gets its segment's norm (filled per chunk)
    STAGE = "stage"  # a value an earlier phase wrote (a state's new value, the gathered slice): read back from there
    GLOBAL = "global"  # a Replicated tensor of the step's shape (or a scatter's source): read in place, global offset
    LOCAL = "local"  # a Sliced(0) tensor of the step's shape from outside the step: this rank's slice
    SCALAR = "scalar"  # a 0-dim value


@dataclass(frozen=True, slots=True)
class Phase:
    """What one phase's kernel computes: `stages` (program order) for the `roots` (the gathered slice if it is of
    this level, then the state writes of this level), and the sums of squares of the next level's norm operands
    (`whole` norms, or per segment for `segmented` ones), as (norm, operand) pairs."""

    stages: tuple[Node, ...]
    roots: tuple[Node, ...]
    writes: tuple[Node, ...]
    whole: tuple[tuple[Node, Node], ...]
    segmented: tuple[tuple[Node, Node], ...]

    @property
    def has_kernel(self) -> bool:
        return bool(self.stages or self.whole or self.segmented)


@dataclass(frozen=True, slots=True)
class FusedGroup:
    """reduce-scatter `rs` -> sliced computation in phases -> all-gather `ag` of `gathered`, with `w_update` the
    update of a Replicated state by the gathered value (done by the all-gather writing into the state)."""

    rs: Node
    ag: Node
    gathered: Node
    w_update: Node | None
    scalars: tuple[Node, ...]  # 0-dim stages (not norms), run by the reference rules at their level
    norms: tuple[Node, ...]
    src_of: dict[int, Node]  # scatter id -> the Replicated tensor it slices (read in place)
    level: dict[int, int]  # stage id -> level
    phases: tuple[Phase, ...]
    kinds: dict[int, OperandKind]  # kernel operand id -> how it is read

    @property
    def writes(self) -> tuple[Node, ...]:
        return tuple(s for p in self.phases for s in p.writes)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.rs.shape


@dataclass(frozen=True, slots=True)
class NotFused:
    """Why a step has no fused form (the rule it breaks, naming the stage)."""

    reason: str

    def __str__(self) -> str:
        return self.reason


def _levels(step: FusedCollective) -> dict[int, int]:
    level: dict[int, int] = {}
    for s in step.order:
        level[id(s)] = max((level.get(id(a), 0) for a in s.args), default=0) + OPS[s.op].norm
    return level


def _kind(a: Node, rs: Node, inside: set[int], src_of: dict[int, Node]) -> OperandKind | None:
    if a is rs:
        return OperandKind.REDUCED
    if a.op == "segment_norm" and id(a) in inside:
        return OperandKind.SEGNORM
    if id(a) in inside and a.ndim and id(a) not in src_of:
        return OperandKind.STAGE
    if id(a) in src_of or (a.ndim and a.layout.is_replicated and a.shape == rs.shape and id(a) not in inside):
        return OperandKind.GLOBAL
    if a.ndim:
        local = a.layout == rs.layout and a.shape == rs.shape and id(a) not in inside
        return OperandKind.LOCAL if local else None
    return OperandKind.SCALAR


def analyze(step: FusedCollective, program: Program) -> FusedGroup | NotFused:
    """The step's FusedGroup, or the first rule it breaks."""
    rs, ag = step.rs, step.ag
    # the fused kernels work on flat chunks of dim 0 (the collectives' order), which flat slices are too
    if rs.layout.dim not in (0, FLAT) or ag.args[0].layout.dim not in (0, FLAT):
        return NotFused(f"{rs.name}/{ag.name} scatter or gather along dim {rs.layout.dim}/{ag.args[0].layout.dim}; "
                        "the fused form needs dim 0")
    inside = {id(s) for s in step.order}
    w_update = next((o for o in program.stages if o.op == "update" and o.args[1] is ag), None)
    norms = tuple(s for s in step.compute if OPS[s.op].norm)
    scalars = tuple(s for s in step.compute if s.ndim == 0 and not OPS[s.op].norm)
    scatters = [s for s in step.compute if s.op == "scatter"]
    body = [s for s in step.compute if s.ndim > 0 and s.op != "scatter" and not OPS[s.op].norm and s is not w_update]
    # every tensor stage runs inside a generated kernel on chunks of the reduce-scatter's shape
    for s in body:
        if not can_fuse(s) or s.shape != rs.shape:
            return NotFused(f"{s.name} ({s.op}, shape {list(s.shape)}) is not an elementwise stage of the "
                            f"reduce-scatter's shape {list(rs.shape)}")
    # scalars are computed by the reference rules between kernels: they must be plain elementwise too
    for s in scalars:
        if not can_fuse(s):
            return NotFused(f"scalar stage {s.name} ({s.op}) is not elementwise")
    # a scatter is read in place as the slice of its source: it must slice dim 0 of a same-shaped tensor
    for s in scatters:
        if s.layout.dim not in (0, FLAT) or s.args[0].shape != rs.shape:
            return NotFused(f"scatter {s.name} slices dim {s.layout.dim} of shape {list(s.args[0].shape)}")
    src_of = {id(s): s.args[0] for s in scatters}
    # the gathered value must be computed by the kernels (it is written where the all-gather reads it)
    gathered = ag.args[0]
    if all(gathered is not b for b in body):
        return NotFused(f"the all-gathered value {gathered.name} is not computed inside the group")
    kinds: dict[int, OperandKind] = {}
    for s in [*body, *norms]:
        for a in s.args:
            if a.op == "const":
                continue
            k = _kind(a, rs, inside, src_of)
            if k is None:  # a tensor this rank cannot slice chunk by chunk
                return NotFused(f"{s.name} reads {a.name} ({a.layout}, shape {list(a.shape)}), which is neither "
                                "this rank's slice nor a Replicated tensor of the reduce-scatter's shape")
            kinds[id(a)] = k
    level = _levels(step)
    phases = _phases(body, norms, gathered, w_update, level, scatters, step)
    if isinstance(phases, NotFused):
        return phases
    for p in phases:
        for a in [*(x for s in p.stages for x in s.args), *(x for _, x in p.whole + p.segmented)]:
            if a.op != "const" and id(a) not in kinds and id(a) not in {id(s) for s in p.stages}:
                k = _kind(a, rs, inside, src_of)
                if k is None:
                    return NotFused(f"phase operand {a.name} cannot be read chunk by chunk")
                kinds[id(a)] = k
    # states are written in place: nobody outside the step may read their old value
    users = program.users()
    writes = [s for p in phases for s in p.writes] + ([w_update] if w_update else [])
    for s in writes:
        if any(id(u) not in inside for u in users[s.args[0].name] if u is not s):
            return NotFused(f"state {s.args[0].name} is read outside the group; updating it in place would change "
                            "what that reader sees")
    # no other value of the step may be needed outside it (a whole norm may: clipping's grad_norm is an output)
    allowed = {id(ag), *map(id, writes), *(id(nm) for nm in norms if nm.op == "norm")}
    needed = [s for s in step.order if id(s) in outside_readers(program, inside) and id(s) not in allowed]
    if needed:
        return NotFused(f"{needed[0].name} is read outside the group (only the gathered value, the states and whole "
                        "norms may be)")
    return FusedGroup(rs, ag, gathered, w_update, scalars, norms, src_of, level, phases, kinds)


def _phases(body: list[Node], norms: tuple[Node, ...], gathered: Node, w_update: Node | None, level: dict[int, int],
            scatters: list[Node], step: FusedCollective) -> tuple[Phase, ...] | NotFused:
    """Cut the group into phases. Nothing crosses phases through memory but the program's outputs: a later phase
    recomputes the earlier values it needs from the reduced gradient, the inputs and the states already written."""
    K = max(level[id(s)] for s in body)
    updates = [s for s in body if s.op == "update"]
    writes = [[s for s in updates if level[id(s)] == k] for k in range(K + 1)]
    written_at = {id(s.args[0]): level[id(s)] for s in updates}  # the phase each state is written in
    value_at = {id(s.args[1]): level[id(s)] for s in updates}
    if w_update is not None:
        written_at[id(w_update.args[0])] = level[id(gathered)]
    order = {id(s): i for i, s in enumerate(step.order)}
    scatter_of = {id(sc.args[0]): sc for sc in scatters}  # an input the group reads through its scatter: that slice
    src_of = {id(s): s.args[0] for s in scatters}
    bodyset = {id(s) for s in body}
    phases = []
    for k in range(K + 1):
        roots = [*([gathered] if level[id(gathered)] == k else []), *writes[k]]
        next_norms = [nm for nm in norms if level[id(nm)] == k + 1]
        operands = [scatter_of.get(id(nm.args[0]), nm.args[0]) for nm in next_norms]
        stages: list[Node] = []
        seen: set[int] = set()
        todo = list(roots + operands)
        while todo:
            s = todo.pop()
            if id(s) in seen:
                continue
            seen.add(id(s))
            if value_at.get(id(s), k) < k or (s is gathered and level[id(s)] < k):
                continue  # written by an earlier phase: read back from where it was written
            if id(s) not in bodyset:  # a leaf: reduced, scalar, input, slice of an input
                src = src_of.get(id(s), s)
                if written_at.get(id(src), k) < k:
                    return NotFused(f"phase {k} would read the old value of {src.name}, overwritten by phase "
                                    f"{written_at[id(src)]}")
                continue
            stages.append(s)
            todo.extend(a for a in s.args if a.op != "const")
        stages.sort(key=lambda s: order[id(s)])
        pairs = list(zip(next_norms, operands))
        phases.append(Phase(tuple(stages), tuple(roots), tuple(writes[k]),
                            tuple(p for p in pairs if p[0].op == "norm"),
                            tuple(p for p in pairs if p[0].op == "segment_norm")))
    return tuple(phases)


def runtime_reason(group: FusedGroup, shm: ShmCommunicator | None) -> str | None:
    """Why this rank cannot run the fused form (None: it can)."""
    if shm is None:  # the fused form is a shared-memory collective
        return "no shared-memory communicator (backend 'torch', one rank, or a group spanning nodes)"
    # across nodes each rank owns 1/P of the vector: its length must divide by the world
    if shm.nnodes > 1 and torch.Size(group.rs.args[0].shape).numel() % shm.world:
        return (f"{group.rs.name}: {list(group.rs.args[0].shape)} does not split over {shm.world} ranks on "
                f"{shm.nnodes} nodes")
    return None
