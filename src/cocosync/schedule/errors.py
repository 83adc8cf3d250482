"""ScheduleError: a schedule directive's precondition does not hold."""

from __future__ import annotations

from cocosync.dsl.types import DslError


class ScheduleError(DslError):
    """A transformation cannot apply: the message names the directive, the stage and the rule that is broken."""

    def __init__(self, directive: str, stage: str | None, rule: str):
        self.directive, self.stage, self.rule = directive, stage, rule
        where = f" stage {stage!r}" if stage is not None else ""
        super().__init__(f"{directive}:{where} {rule}")
