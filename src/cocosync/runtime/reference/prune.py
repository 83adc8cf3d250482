"""What one rank of a multi-group program (pipeline stages) can skip, because of where its group sits.

`send(x, groups=K)` moves each group's x to the next group. On the last group nothing goes anywhere, so stages
whose values only feed a send there are dead; on the first group nothing arrives, so a send's value is zero, and a
collective of zeros is zeros without communicating. Every member of a group sits at the same place, so all of them
skip the same collectives and the others stay matched. Example, the pipeline program
`recv = all_gather(send((reduce_scatter(y) + b) * mask))`: the last stage only receives and all-gathers, the first
only reduce-scatters, computes and sends (its recv is zeros), as a hand-written pipeline would.
"""

from __future__ import annotations

from dataclasses import dataclass

from cocosync.dsl.ir import Program

__all__ = ["Pruning", "prune", "NO_PRUNING"]

#: ops whose value is zero when their one tensor argument is zero on every rank of the group
_ZERO_KEEPING = frozenset({"reduce_scatter", "all_gather", "all_reduce", "broadcast", "reduce", "cast", "scatter"})


@dataclass(frozen=True, slots=True)
class Pruning:
    """Stage ids this rank does not run: `dead` (no live stage or output reads them here) and `zero` (their value
    is zero here: the runner stores zeros instead), and the inputs nothing live reads (callers may omit them)."""

    dead: frozenset[int] = frozenset()
    zero: frozenset[int] = frozenset()
    unused_inputs: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.dead or self.zero)

    def touches(self, stages) -> bool:
        """Whether any of `stages` is skipped on this rank."""
        return any(id(s) in self.dead or id(s) in self.zero for s in stages)


NO_PRUNING = Pruning()


def prune(program: Program, gid: int, ngroups: int) -> Pruning:
    """The Pruning of the rank in group `gid` of `ngroups` (none for programs without send)."""
    if not any(s.op == "send" for s in program.stages):
        return NO_PRUNING
    first, last = gid == 0, gid == ngroups - 1
    known_zero: set[int] = set()  # value zero here (a first-group send still runs: it sends)
    for s in program.stages:
        if s.op == "send" and first or s.op in _ZERO_KEEPING and id(s.args[0]) in known_zero:
            known_zero.add(id(s))
    sends = [s for s in program.stages if s.op == "send"]
    # a send pairs with its neighbours' (each call sends to the next group and receives from the previous one):
    # with several groups every group runs it, whatever it needs of its value
    skipped = known_zero - ({id(s) for s in sends} if ngroups > 1 else set())
    live: set[int] = set()
    todo = list(program.outputs) + (sends if ngroups > 1 else [])
    while todo:
        n = todo.pop()
        if id(n) in live:
            continue
        live.add(id(n))
        if id(n) in skipped or n.op == "send" and last:
            continue  # zeros need no arguments; the last group's send only receives
        todo.extend(n.args)
    dead = frozenset(id(s) for s in program.stages if id(s) not in live)
    unused = frozenset(n.name for n in program.inputs if id(n) not in live)
    return Pruning(dead=dead, zero=frozenset(skipped & live), unused_inputs=unused)

