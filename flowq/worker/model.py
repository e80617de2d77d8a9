"""The values that flow through the worker: a claimed job and the outcome of running it.

An outcome is decided by the executor (which knows the step, its retry policy and the
exception) and only written by the completer, so every value in it is already storable:
texts without NUL or lone surrogates and capped in length, delays finite and in range.

- `Succeeded`: the result (JSON text) and, in a pipeline, the successor to create.
- `Failed`: the error text; `retry_in` seconds until the next attempt, or None for `dead`.
- `Retried`: the handler raised `RetryStep` and has attempts left.
- `Cancelled`: the handler raised `CancelRun`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowq.app import Step

__all__ = ["Cancelled", "Claim", "ClaimedJob", "Failed", "NextStep", "Outcome", "Retried",
           "Succeeded"]

Claim = tuple[int, int]
"""(job id, lease): what identifies one attempt, and what every write after the claim checks."""


@dataclass(frozen=True)
class ClaimedJob:
    """A row this worker claimed; `lease` is the fence every later write is checked against.

    Fields are in the order `claim_jobs` returns its columns, so `ClaimedJob(*row)` builds it."""

    id: int
    lease: int
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

    @property
    def claim(self) -> Claim:
        return (self.id, self.lease)


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
    text: str  # `Type: message` then the traceback, as stored in last_error
    retry_in: float | None  # seconds until the next attempt; None: the job ends `dead`
    summary: str = ""  # the first line, for the log


@dataclass(frozen=True)
class Retried:
    delay: float
    reason: str


@dataclass(frozen=True)
class Cancelled:
    reason: str


Outcome = Succeeded | Failed | Retried | Cancelled
