"""What each pipeline stage skips (runtime.reference.prune): the first stage's received value is zeros, the last stage's
send argument is dead. Values are checked against the oracle in test_executor / steps/test_overlap / tests/nn."""

from cocosync.nn.pipeline import pipeline_send_program
from cocosync.programs.optimizers import sgd_program
from cocosync.runtime.reference.prune import NO_PRUNING, prune
from cocosync.schedule.standard import pipeline_schedule


def _ops(program, ids):
    return sorted(s.op for s in program.stages if id(s) in ids)


def test_unscheduled_pipeline_last_stage_computes_nothing_it_would_send():
    program = pipeline_send_program(8, 4, stages=2)
    first, last = prune(program, 0, 2), prune(program, 1, 2)
    assert not first and first.unused_inputs == frozenset()  # recv = send(...): zeros, but the send runs
    assert _ops(program, last.dead) == ["add", "all_reduce", "mul"] and not last.zero
    assert last.unused_inputs == {"y", "b", "mask"}


def test_scheduled_pipeline_prunes_collectives_at_both_ends():
    program = pipeline_schedule(pipeline_send_program(8, 4, stages=2), chunks=1).program
    first, last, middle = prune(program, 0, 2), prune(program, 1, 2), prune(program, 1, 3)
    assert _ops(program, first.zero) == ["all_gather"] and not first.dead  # all_gather of what nobody sent
    assert _ops(program, last.dead) == ["add", "mul", "reduce_scatter", "scatter"] and not last.zero
    assert not middle and middle.unused_inputs == frozenset()  # a middle stage sends and receives


def test_programs_without_send_are_not_pruned():
    assert prune(sgd_program(8), 0, 1) is NO_PRUNING
    assert prune(sgd_program(8), 1, 2) is NO_PRUNING
