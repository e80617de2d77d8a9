"""The values that flow through the worker: a claimed job and the outcome of running it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowq.app import Step

__all__ = ["Cancelled", "ClaimedJob", "Failed", "NextStep", "Outcome", "Retried", "Succeeded"]


@dataclass(frozen=True)
class ClaimedJob:
    """A row this worker claimed; `attempts` is the fence every later write is checked against."""

    id: int
    run_id: int
    task: str
    step: str
    step_index: int
    queue: str
    priority: int
    attempts: int
    max_attempts: int
    args: str
    cancel_requested: bool
    age: float

    @classmethod
    def from_row(cls, row: Any) -> ClaimedJob:
        return cls(id=row.id, run_id=row.run_id, task=row.task, step=row.step,
                   step_index=row.step_index, queue=row.queue, priority=row.priority,
                   attempts=row.attempts, max_attempts=row.max_attempts, args=row.args,
                   cancel_requested=row.cancel_requested, age=float(row.age))


@dataclass(frozen=True)
class NextStep:
    """The successor a succeeded step creates, with the step's result as its arguments."""

    step: Step[Any, Any]
    task: str
    args: str


@dataclass(frozen=True)
class Succeeded:
    result: str  # JSON text
    next: NextStep | None = None


@dataclass(frozen=True)
class Failed:
    error: BaseException
    text: str  # the exception, its message and traceback, as stored in last_error
    permanent: bool = False  # retrying cannot help (e.g. a result that fits no next step)
    retry: Any = None  # the step's flowq.Retry, when the step is known


@dataclass(frozen=True)
class Retried:
    delay: float
    reason: str


@dataclass(frozen=True)
class Cancelled:
    reason: str


Outcome = Succeeded | Failed | Retried | Cancelled
