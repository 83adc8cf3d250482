"""The schedules the tuner considers for a program: every legal combination of CoCoNeT's directives on its
all_reduce, built by applying them (an illegal step raises ScheduleError and ends that branch) and deduplicated by
the program they produce.

For each all_reduce the chain is: as written; split (reduce-scatter + all-gather); + reorder (the computations that
read the all-gather run on slices before it); + as_slice (the state those computations update stays sliced); then
either fuse (one fused collective) or overlap of the chain from the reduce-scatter to the all-gather by c chunks,
its stages one by one or with the reduce-scatter -> computations -> all-gather fused (ol_MM_fuse_RS_C_AG).
CoCoNeT's own autotuner enumerates the same chain; here each candidate is then checked against the reference
interpreter and timed (tuner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from cocosync.dsl.ir import Program
from cocosync.dsl.types import FLAT, Sliced, slice_count
from cocosync.schedule.errors import ScheduleError
from cocosync.schedule.schedule import Directive, Schedule

__all__ = ["Candidate", "schedule_space", "CHUNKS"]

#: overlap chunk counts tried (CoCoNeT's tuned Megatron/pipeline runs used 2-8)
CHUNKS = (2, 4, 8)


@dataclass(frozen=True)
class Candidate:
    """A schedule as its directives (replayable on the same program at any size: they name stages)."""

    name: str
    directives: tuple[Directive, ...]

    @property
    def listing(self) -> list[str]:
        return [str(d) for d in self.directives]


def _states(s: Schedule, internal: tuple[str, ...]) -> list[str]:
    """Of the `internal` state tensors (updated inputs the caller never reads, e.g. an optimizer's moments, not its
    weights), those as_slice can keep sliced after the reorder."""
    out = []
    for name in (n for n in s.program.updates if n in internal):
        trial = Schedule(s.original, s.directives)
        try:
            trial.as_slice([name])
        except ScheduleError:
            continue
        out.append(name)
    return out


def split_dim(shape: tuple[int, ...], world: int | None) -> int | str:
    """Where to slice an all_reduce of `shape` on `world` ranks: dim 0 when it divides (the collectives' order),
    else flat when the element count does (CoCoNeT slices flat), else dim 0 (and the oracle prunes it)."""
    if world is None or not shape or shape[0] % world == 0 or len(shape) == 1:
        return 0
    return FLAT if slice_count(shape, Sliced(FLAT)) % world == 0 else 0


def schedule_space(program: Program, internal: tuple[str, ...] = (),
                   chunks: tuple[int, ...] = CHUNKS, world: int | None = None) -> list[Candidate]:
    """The legal schedules of `program` (the first is the program as written); `internal`: state tensors the
    schedule may keep sliced (as_slice changes how the caller holds them); `world`: the ranks it is for (the
    split slices flat where no dimension would divide)."""
    out = [Candidate("as written", ())]
    reductions = [st.name for st in program.stages if st.op == "all_reduce"]
    if len(reductions) != 1:  # one all_reduce: the paper's workloads (several: only as written, for now)
        return out
    s = Schedule(program)
    try:
        rs, ag = s.split(reductions[0], dim=split_dim(program.stage(reductions[0]).shape, world))
    except ScheduleError:
        return out
    out.append(Candidate("split", tuple(s.directives)))
    try:
        s.reorder(s.movable(ag), ag)
    except ScheduleError:
        return out
    out.append(Candidate("split+reorder", tuple(s.directives)))
    bases = [("split+reorder", tuple(s.directives))]
    states = _states(s, internal)
    if states:
        s.as_slice(states)
        bases.append(("split+reorder+as_slice", tuple(s.directives)))
        out.append(Candidate(*bases[-1]))
    for base, directives in bases:
        fused = Schedule(program, directives)
        try:
            fused.fuse(fused.stages())
            out.append(Candidate(f"{base}+fuse", tuple(fused.directives)))
        except ScheduleError:
            pass
        chain = Schedule(program, directives).chain(rs, producer=True)
        for nested in (False, True) if chain else ():  # the chain as stages, or with RS -> C -> AG fused
            for c in chunks:
                over = Schedule(program, directives)
                try:
                    if nested:
                        over.fuse([rs, chain[-1]])
                    over.overlap(chain, chunks=c)
                except ScheduleError:
                    break
                out.append(Candidate(f"{base}+{'fuse+' if nested else ''}overlap({c})", tuple(over.directives)))
    seen, unique = set(), []
    for c in out:  # two directive lists that give the same program are one candidate
        key = str(Schedule(program, c.directives).program)
        if key not in seen:
            seen.add(key)
            unique.append(c)
    return unique
