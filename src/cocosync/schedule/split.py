"""split(all_reduce) -> (reduce_scatter, all_gather): all_reduce(x, op) == all_gather(reduce_scatter(x, op, dim))."""

from __future__ import annotations

from cocosync.dsl import ops
from cocosync.dsl.ir import Program
from cocosync.dsl.types import FLAT
from cocosync.schedule._rewrite import Namer, Ref, finish, named, names_of, resolve, walk
from cocosync.schedule.errors import ScheduleError


def split(program: Program, stage: Ref, *, dim: int | str = 0) -> tuple[Program, str, str]:
    """Replace the all_reduce `stage` (named a) by `a_rs = reduce_scatter(x, op, dim)` and `a_ag = all_gather(a_rs)`;
    its readers read a_ag. dim=FLAT slices the elements in row-major order (CoCoNeT's flat slicing: for shapes no
    dimension of which divides by the group size). Returns (program, rs name, ag name)."""
    ar = resolve(program, stage, "split")
    if ar.op != "all_reduce":
        raise ScheduleError("split", ar.name, f"is a {ar.op}, not an all_reduce; only an all_reduce splits into "
                            "reduce_scatter + all_gather")
    if ar.ndim == 0:
        raise ScheduleError("split", ar.name, "is a scalar all_reduce; there is nothing to scatter")
    if dim != FLAT and not (isinstance(dim, int) and 0 <= dim < ar.ndim):
        raise ScheduleError("split", ar.name, f"dim={dim} is out of range for shape {ar.shape}")
    fresh = Namer(names_of(program))
    x, groups = ar.args[0], ar.attr("groups")
    rs = ops.reduce_scatter(x, ar.attr("op"), dim=dim, groups=groups)
    rs = named(rs, fresh(f"{ar.name}_rs"))
    ag = ops.all_gather(rs, groups=groups)
    ag = named(ag, fresh(f"{ar.name}_ag"))
    new = walk(program, {id(ar): ag})
    return finish(program, new), rs.name, ag.name
