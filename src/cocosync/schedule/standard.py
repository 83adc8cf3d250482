"""Standard schedules for the paper's workloads, each a few lines. Each takes the program and returns a Schedule."""

from __future__ import annotations

from cocosync.dsl.ir import Program
from cocosync.schedule.errors import ScheduleError
from cocosync.schedule.schedule import Schedule


def _only(program: Program, op: str) -> str:
    hits = [s.name for s in program.stages if s.op == op]
    if len(hits) != 1:
        raise ScheduleError("standard schedule", None, f"expects exactly one {op} in {program.name!r}, found {hits}")
    return hits[0]


def _chain(s: Schedule, start: str, producer: bool = False) -> list[str]:
    chain = s.chain(start, producer=producer)
    if chain is None:
        raise ScheduleError("standard schedule", start, "is not the start of a single chain up to an all_gather")
    return chain


def sharded_update_schedule(program: Program, state: tuple[str, ...] = ()) -> Schedule:
    """Data-parallel optimizers (CoCoNeT's FusedAllReduce): RS(g) -> update on slices -> AG(w), one fused collective;
    `state` tensors (momenta) stay sliced."""
    s = Schedule(program)
    rs, ag = s.split(_only(program, "all_reduce"))
    s.reorder(s.movable(ag), ag)
    if state:
        s.as_slice(list(state))
    s.fuse(s.stages())
    return s


def sgd_schedule(program: Program) -> Schedule:
    """SGD (with momentum: the buffer stays sliced)."""
    return sharded_update_schedule(program, tuple(n for n in ("buf",) if n in program.updates))


def adam_schedule(program: Program) -> Schedule:
    """Adam: split + reorder + as_slice(m, v) + fuse: RS(g) -> sliced m, v, w update -> AG(w)."""
    return sharded_update_schedule(program, ("m", "v"))


def lamb_schedule(program: Program) -> Schedule:
    """LAMB: like Adam; its norms of w and of the update run on slices (their Sliced semantics are global)."""
    return sharded_update_schedule(program, ("m", "v"))


def megatron_schedule(program: Program, chunks: int = 4, *, fuse: bool = False) -> Schedule:
    """Megatron layer: matmul -> all_reduce -> bias + dropout + residual becomes matmul -> reduce_scatter ->
    epilogue on slices -> all_gather, one pipelined (overlapped) chain. `fuse=True`: CoCoNeT's ol_MM_fuse_RS_C_AG,
    the reduce_scatter -> epilogue -> all_gather fused into one collective that each chunk runs as one unit, so
    the epilogue of chunk i also overlaps the GEMM of chunk i + 1."""
    s = Schedule(program)
    rs, ag = s.split(_only(program, "all_reduce"))
    s.reorder(s.movable(ag), ag)
    chain = _chain(s, rs, producer=True)
    if fuse:
        s.fuse([rs, chain[-1]])
    s.overlap(chain, chunks=chunks)
    return s


def pipeline_schedule(program: Program, chunks: int = 4) -> Schedule:
    """Pipeline stage boundary: all_reduce -> epilogue -> send becomes reduce_scatter -> epilogue and send on
    slices -> all_gather in the next stage (1/G of the bytes cross stages), overlapped by chunks."""
    s = Schedule(program)
    rs, ag = s.split(_only(program, "all_reduce"))
    s.reorder(s.movable(ag), ag)
    s.overlap(_chain(s, rs), chunks=chunks)
    return s


def bmuf_schedule(program: Program) -> Schedule:
    """ShadowSync's BMUF (large vectors): RS(x) -> block momentum on the sliced global model -> AG(s)."""
    return sharded_update_schedule(program, ("glob", "delta"))


STANDARD = {"sgd": sgd_schedule, "adam": adam_schedule, "lamb": lamb_schedule, "megatron": megatron_schedule,
            "pipeline": pipeline_schedule, "ma": sharded_update_schedule, "bmuf": bmuf_schedule}
