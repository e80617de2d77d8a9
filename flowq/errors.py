"""Every error flowq raises, in one tree, each docstring doubling as its message.

```
FlowqError                      root: catch this to catch everything flowq raises
├── ConfigurationError          a task, pipeline or setting is defined wrongly (at import;
│                               an empty pipeline at worker start or enqueue)
├── DatabaseURLError            no database URL given, or one flowq cannot use
├── NaiveDatetimeError          a time given without a timezone where flowq needs one
├── UnknownTaskError            a name is not registered in the app
├── InvalidArgumentsError       enqueue arguments are not JSON or do not fit the handler
├── InvalidQueueError           a queue name is not a plain identifier
├── SchemaMissingError          the database has no flowq schema: run `flowq migrate`
├── DatabaseUnavailableError    the database cannot be reached at the given URL
├── MigrationBlockedError       a migration kept waiting for a lock another transaction holds
├── EmbeddedPostgresError       the embedded PostgreSQL is missing or failed to start
├── RunNotFoundError            no run with that id (or it was pruned)
├── RunStateError               the run's state does not allow that (retry a run that is not dead)
├── EnqueueConflictError        concurrent enqueues of one key kept winning the race
├── ContextError                a step's context used where it cannot work (no database
│                               outside a worker, `commit()` of `ctx.session`)
├── WorkerStopError             the worker did not stop within its grace period
├── DemoError                   the demo could not set itself up on the database given
├── ChildFailed                 a child run a step waits on ended dead or cancelled
└── WorkflowError               a workflow used wrongly at run time: `each()` of something
    │                           that is not a list of dicts, a mapped step with two parents
    ├── SignalError             a signal nobody waits for, sent twice, or whose payload is not JSON
    └── CheckpointError         a checkpoint name or result flowq cannot keep, or a name reused
```

`DeadlineExceeded` names why a run's unfinished steps were cancelled when its `deadline=`
passed (the reaper writes it as their `last_error`; a running handler sees `ctx.cancelled`).

`SignalTimeout` is what a step waiting for a signal fails with when its `wait_timeout` passes:
its retry policy decides (by default it is not retried: the step ends `dead`).

Control flow raised *by handlers* is not an error and lives outside the tree:
`RetryStep`, `CancelRun` and `Snooze` derive from `BaseException` so that a handler's broad
`except Exception:` cannot swallow them by accident.
"""

from __future__ import annotations

from datetime import datetime, timedelta

__all__ = [
    "CancelRun",
    "CheckpointError",
    "ChildFailed",
    "ConfigurationError",
    "ContextError",
    "DatabaseURLError",
    "DatabaseUnavailableError",
    "DeadlineExceeded",
    "DemoError",
    "EmbeddedPostgresError",
    "EnqueueConflictError",
    "FlowqError",
    "InvalidArgumentsError",
    "InvalidQueueError",
    "MigrationBlockedError",
    "NaiveDatetimeError",
    "RetryStep",
    "RunNotFoundError",
    "RunStateError",
    "SchemaMissingError",
    "SignalError",
    "SignalTimeout",
    "Snooze",
    "UnknownTaskError",
    "WorkerStopError",
    "WorkflowError",
]


class FlowqError(Exception):
    """A flowq error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(FlowqError):
    """A task, pipeline or setting is defined wrongly."""


class DatabaseURLError(FlowqError):
    """No database URL was given, or it is not one flowq can use: pass a postgresql:// URL
    (--database-url, FLOWQ_DATABASE_URL or DATABASE_URL)."""


class NaiveDatetimeError(FlowqError):
    """A time must be a timezone-aware datetime (e.g. `datetime.now(timezone.utc)`)."""


class UnknownTaskError(FlowqError):
    """No task or pipeline of that name is registered in this app."""


class InvalidArgumentsError(FlowqError):
    """The arguments cannot be enqueued: they must be JSON and fit the handler."""


class InvalidQueueError(FlowqError):
    """A queue name must be 1-63 characters of letters, digits, '_', '-', '.' or ':'."""


class SchemaMissingError(FlowqError):
    """The database has no flowq schema yet: run `flowq migrate` (or `flowq.migrate(engine)`) first."""


class DatabaseUnavailableError(FlowqError):
    """The database cannot be reached: check the URL (--database-url or FLOWQ_DATABASE_URL)."""


class MigrationBlockedError(FlowqError):
    """A migration gave up: its DDL kept waiting for a lock that another transaction holds on
    flowq's tables (end that transaction, then run `flowq migrate` again)."""


class EmbeddedPostgresError(FlowqError):
    """The embedded PostgreSQL is not available: `pip install 'flowq[embedded]'` or pass --database-url."""


class RunNotFoundError(FlowqError):
    """No run with that id exists (it may have been pruned)."""


class RunStateError(FlowqError):
    """The run is not in a state that allows this (e.g. retrying a run that is not dead)."""


class EnqueueConflictError(FlowqError):
    """Concurrent enqueues of the same key kept winning the race: try the enqueue again."""


class ContextError(FlowqError):
    """The step's context cannot do that here: it has no database outside a worker (pass
    `session=` to `flowq.testing.run_step`), and `ctx.session` is committed by flowq."""


class WorkerStopError(FlowqError):
    """The worker did not stop within its grace period."""


class DemoError(FlowqError):
    """The demo could not set itself up on the database given."""


class ChildFailed(FlowqError):
    """A child run this step waits on (`ctx.wait`) ended dead or cancelled: the parent's
    retry policy decides what happens next (`run_id`, `step` and `error` name the child's
    failed step)."""

    def __init__(self, run_id: int, status: str, step: str | None, error: str | None) -> None:
        where = f" in step {step!r}" if step else ""
        # The first line of the child's error: its traceback stays in the child's row.
        shown = (error or "").strip().splitlines()[0][:500] if (error or "").strip() else ""
        super().__init__(f"child run {run_id} ended {status}{where}: "
                         f"{shown or '(no error recorded)'} (flowq runs show {run_id})")
        self.run_id, self.status, self.step, self.error = run_id, status, step, error


class WorkflowError(FlowqError):
    """A workflow was used wrongly at run time (a step raising it is not retried: it would
    fail the same way again)."""


class SignalError(WorkflowError):
    """The signal cannot be delivered: no step of the run's pipeline waits for it, it was
    already sent with another payload, or its payload is not JSON."""


class CheckpointError(WorkflowError):
    """A checkpoint was used wrongly: its name is not 1-200 characters of text (or starts
    with the reserved `flowq.`), it was already used in this attempt, or its result is not
    JSON (not retried: the step would fail the same way again)."""


class SignalTimeout(FlowqError):
    """The step's signal did not arrive within its wait_timeout."""


class DeadlineExceeded(FlowqError):
    """The run's deadline passed before it finished: its unfinished steps were cancelled."""


class RetryStep(BaseException):
    """Raised by a handler to retry this step later, without counting it as a failure of the policy.

    `after` is a delay (seconds or timedelta) or an aware datetime; `None` means at once.
    The attempt still counts against the step's attempt cap, so a step cannot loop forever.
    """

    def __init__(self, after: float | timedelta | datetime | None = None, reason: str = "") -> None:
        super().__init__(reason or "retry requested")
        self.after = after
        self.reason = reason


class CancelRun(BaseException):
    """Raised by a handler to cancel the whole run: this step ends `cancelled`, no successor runs."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason or "cancelled by handler")
        self.reason = reason


class Snooze(BaseException):
    """Raised by a handler to run this step again after `seconds`, without spending an attempt.

    For a polling step ("not ready yet, look again in a minute"). `seconds` is a number or a
    timedelta, checked like every delay flowq takes (finite, at most a year and a day). Each
    step may snooze at most `flowq.durable.MAX_SNOOZES` times over its life; the snooze
    past that cap ends the step `dead`, so a step cannot poll forever unseen.
    """

    def __init__(self, seconds: float | timedelta = 0.0, reason: str = "") -> None:
        super().__init__(reason or "snoozed by the handler")
        self.seconds = seconds
        self.reason = reason
