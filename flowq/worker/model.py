"""The values that flow through the worker: a claimed job and the outcome of running it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowq.app import Step

__all__ = ["Cancelled", "ClaimedJob", "Failed", "NextStep", "Outcome", "Retried", "Succeeded"]


@dataclass(frozen=True)
class ClaimedJob:
    """A row this worker claimed; `attempts` is the fence every later write is checked against.

    Fields are in the order `claim_jobs` returns its columns, so `ClaimedJob(*row)` builds it."""

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
