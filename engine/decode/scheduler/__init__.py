"""Who runs each step, the rows that step, and what a read step changes: the only writer of a
request's state (engine/decode/scheduler/policy.py says how)."""

from engine.decode.scheduler.policy import (
    NON_FINITE_LOGITS,
    LaunchedRows,
    ScheduledStep,
    Scheduler,
    non_finite_logits_error,
)

__all__ = ["NON_FINITE_LOGITS", "LaunchedRows", "ScheduledStep", "Scheduler", "non_finite_logits_error"]
