"""Schedules: pure Program -> Program transformations (split, reorder, as_slice, fuse, overlap, dce), the chaining
`Schedule` API whose directives are printable and replayable, and standard schedules for the paper's workloads."""

from cocosync.schedule.as_slice import as_slice
from cocosync.schedule.dce import dce
from cocosync.schedule.errors import ScheduleError
from cocosync.schedule.fuse import fuse
from cocosync.schedule.overlap import overlap
from cocosync.schedule.reorder import reorder
from cocosync.schedule.schedule import AsSlice, Dce, Directive, Fuse, Overlap, Reorder, Schedule, Split, replay
from cocosync.schedule.split import split
from cocosync.schedule.standard import adam_schedule, lamb_schedule, megatron_schedule, pipeline_schedule, sgd_schedule

__all__ = ["ScheduleError", "Schedule", "replay", "Directive", "Split", "Reorder", "AsSlice", "Fuse", "Overlap",
           "Dce", "split", "reorder", "as_slice", "fuse", "overlap", "dce",
           "sgd_schedule", "adam_schedule", "lamb_schedule", "megatron_schedule", "pipeline_schedule"]
