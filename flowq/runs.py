"""Runs: inspect a run and its steps, cancel it, retry it from the step that died.

A run has no row of its own (see `flowq.schema`): it is the chain of `flowq.jobs` rows that
share a `run_id`, one per step reached so far. Its status is derived from them:

- `cancelled` if any step is `cancelled` or has `cancel_requested` (a running step that was
  asked to stop still finishes; `RunInfo.finished_at` stays empty until it has);
- otherwise the status of its latest step (highest `step_index`). A latest step that
  `succeeded` means the run succeeded: a successor is inserted in the very transaction that
  marks its predecessor succeeded, so no snapshot shows a finished step without its successor.

`cancel_run` ends pending steps `cancelled` and flags a running step with `cancel_requested`:
its handler finishes (and its `ctx.session` writes commit) but no successor is created.
Cancelling a run that is already cancelled changes nothing; cancelling a succeeded or dead
run raises `RunStateError` (there is nothing left to stop).

`retry_run` resumes a `dead` run from the step that died: that row goes back to `pending`,
due now, with its attempts reset to 0 so its retry policy starts afresh; its `last_error` is
kept until the next attempt ends, and earlier steps (and their results) are untouched.
Retrying a run that is not dead raises `RunStateError`.

Both take row locks on the whole run first, so they never race a completing step. Every
function takes an Engine (one transaction of its own) or a Connection (joins its open
transaction, which the caller commits; else commits its own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Final, TypeVar

import sqlalchemy as sa

from flowq.errors import RunNotFoundError, RunStateError
from flowq.queries import Queries
from flowq.schema import DEFAULT_SCHEMA, Status, notify_channel

__all__ = [
    "CancelResult",
    "RetryResult",
    "RunInfo",
    "RunSummary",
    "StepInfo",
    "UnservedJobs",
    "cancel_run",
    "get_run",
    "list_runs",
    "retry_run",
    "unserved_jobs",
]

DEFAULT_LIST_LIMIT: Final = 50
# A worker heartbeats its registry entry every --heartbeat-interval (5 s by default): one
# silent for a minute is gone.
UNSERVED_STALE_AFTER: Final = 60.0
# A run has one active step at a time, so the locked set settles in one or two passes;
# the cap only guards against a bug turning this into a loop.
_MAX_LOCK_PASSES: Final = 100

T = TypeVar("T")
Bind = sa.Engine | sa.Connection


@dataclass(frozen=True)
class StepInfo:
    """One step of a run, as stored in its `flowq.jobs` row.

    `locked_at`, `heartbeat_at` and `locked_by` describe the claim of a running step; they are
    cleared when the attempt ends. `step` is '' for a first step enqueued by name from a
    producer that did not know the pipeline (the worker resolves it to the first step).
    """

    job_id: int
    step: str
    index: int
    queue: str
    status: Status
    attempts: int
    max_attempts: int
    cancel_requested: bool
    run_at: datetime
    created_at: datetime
    locked_at: datetime | None
    heartbeat_at: datetime | None
    locked_by: str | None
    finished_at: datetime | None
    last_error: str | None
    args: Any
    result: Any


@dataclass(frozen=True)
class RunInfo:
    """A run: its steps so far and the status derived from them (see the module docstring)."""

    run_id: int
    task: str
    status: Status
    cancel_requested: bool
    idempotency_key: str | None
    created_at: datetime
    finished_at: datetime | None
    result: Any  # the last step's result once the run succeeded, else None
    steps: tuple[StepInfo, ...]

    @property
    def current_step(self) -> StepInfo:
        """The latest step reached (the one that decides the status)."""
        return self.steps[-1]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: these keys are stable (`flowq runs show --json` prints them)."""
        out: dict[str, Any] = _jsonable(asdict(self))
        return out


@dataclass(frozen=True)
class RunSummary:
    """One line of `list_runs`: a run without its steps' details."""

    run_id: int
    task: str
    status: Status
    step: str
    step_index: int
    idempotency_key: str | None
    created_at: datetime
    finished_at: datetime | None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _jsonable(asdict(self))
        return out


@dataclass(frozen=True)
class CancelResult:
    """What `cancel_run` changed: job ids cancelled outright, and running ones asked to stop."""

    run: RunInfo
    cancelled: tuple[int, ...]
    cancel_requested: tuple[int, ...]

    @property
    def changed(self) -> bool:
        return bool(self.cancelled or self.cancel_requested)

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run.run_id, "cancelled_job_ids": list(self.cancelled),
                "cancel_requested_job_ids": list(self.cancel_requested),
                "run": self.run.to_dict()}


@dataclass(frozen=True)
class RetryResult:
    """What `retry_run` changed: the dead step that is pending again."""

    run: RunInfo
    job_id: int
    step: str

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run.run_id, "retried_job_id": self.job_id,
                "retried_step": self.step, "run": self.run.to_dict()}


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


# -- reading ----------------------------------------------------------------------------------


def _step(row: Any) -> StepInfo:
    return StepInfo(
        job_id=row.id, step=row.step, index=row.step_index, queue=row.queue, status=row.status,
        attempts=row.attempts, max_attempts=row.max_attempts,
        cancel_requested=row.cancel_requested, run_at=row.run_at, created_at=row.created_at,
        locked_at=row.locked_at, heartbeat_at=row.heartbeat_at, locked_by=row.locked_by,
        finished_at=row.finished_at, last_error=row.last_error, args=row.args,
        result=row.result)


def _run_of(run_id: int, rows: list[Any]) -> RunInfo:
    if not rows:
        raise RunNotFoundError(f"no run {run_id} exists (it may have been pruned, or the id "
                               "is a job id rather than a run id)")
    steps = tuple(_step(r) for r in rows)
    latest = steps[-1]
    cancel_requested = any(s.cancel_requested for s in steps)
    status: Status = latest.status
    if cancel_requested or any(s.status == "cancelled" for s in steps):
        status = "cancelled"
    done = latest.status in ("succeeded", "dead", "cancelled")
    return RunInfo(
        run_id=run_id, task=rows[0].task, status=status,
        cancel_requested=cancel_requested, idempotency_key=rows[0].idempotency_key,
        created_at=steps[0].created_at, finished_at=latest.finished_at if done else None,
        result=latest.result if status == "succeeded" else None, steps=steps)


def _select(conn: sa.Connection, q: Queries, run_id: int) -> RunInfo:
    return _run_of(run_id, list(conn.execute(q.select_run_jobs, {"run_id": run_id})))


def _check_id(run_id: object) -> int:
    if isinstance(run_id, bool) or not isinstance(run_id, int):
        raise RunNotFoundError(f"a run id is an integer, got {run_id!r}")
    if not 0 < run_id < 2**63:  # a bigint: anything else would be a database error
        raise RunNotFoundError(f"no run {run_id} exists (run ids are positive 64-bit integers)")
    return run_id


@contextmanager
def _transaction(bind: Bind) -> Iterator[sa.Connection]:
    if isinstance(bind, sa.Engine):
        with bind.begin() as conn:
            yield conn
        return
    # The caller's open transaction stays theirs to commit; one begun here is committed here.
    began_here = not bind.in_transaction()
    yield bind
    if began_here and bind.in_transaction():
        bind.commit()


def _read(bind: Bind, fn: Callable[[sa.Connection], T]) -> T:
    if isinstance(bind, sa.Engine):
        with bind.connect() as conn:
            return fn(conn)
    return fn(bind)


def get_run(bind: Bind, run_id: int, schema: str = DEFAULT_SCHEMA) -> RunInfo:
    """The run `run_id` with all its steps; RunNotFoundError if no row of it exists."""
    q = Queries(schema)
    run_id = _check_id(run_id)
    return _read(bind, lambda conn: _select(conn, q, run_id))


def list_runs(bind: Bind, *, status: Status | None = None, limit: int = DEFAULT_LIST_LIMIT,
              schema: str = DEFAULT_SCHEMA) -> list[RunSummary]:
    """The newest `limit` runs, newest first, optionally only those with derived `status`."""
    q = Queries(schema)

    def read(conn: sa.Connection) -> list[RunSummary]:
        rows = conn.execute(q.list_runs, {"status": status, "limit": max(0, int(limit))})
        return [RunSummary(run_id=r.run_id, task=r.task, status=r.status, step=r.step,
                           step_index=r.step_index, idempotency_key=r.idempotency_key,
                           created_at=r.created_at, finished_at=r.finished_at) for r in rows]

    return _read(bind, read)


@dataclass(frozen=True)
class UnservedJobs:
    """Due jobs of one task on one queue that no live worker serves (none listens on the
    queue with the task in its app): they wait until one starts."""

    queue: str
    task: str
    jobs: int
    oldest_due_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def unserved_jobs(bind: Bind, *, schema: str = DEFAULT_SCHEMA,
                  stale_after: float = UNSERVED_STALE_AFTER,
                  limit: int = 20) -> list[UnservedJobs]:
    """Due jobs no live worker serves, by (queue, task), largest groups first. A worker is
    live while its registry heartbeat (`flowq.workers`) is younger than `stale_after`."""
    q = Queries(schema)

    def read(conn: sa.Connection) -> list[UnservedJobs]:
        rows = conn.execute(q.select_unserved_jobs, {"stale": stale_after, "limit": limit})
        return [UnservedJobs(r.queue, r.task, r.n, r.oldest_s) for r in rows]

    return _read(bind, read)


# -- control ----------------------------------------------------------------------------------


def _lock(conn: sa.Connection, q: Queries, run_id: int) -> RunInfo:
    """Lock every row of the run, then read it: no step of it can complete until we commit."""
    seen: set[int] = set()
    for _ in range(_MAX_LOCK_PASSES):
        ids = set(conn.execute(q.lock_run_jobs, {"run_id": run_id}).scalars())
        if ids == seen:
            break
        seen = ids
    return _select(conn, q, run_id)


def cancel_run(bind: Bind, run_id: int, schema: str = DEFAULT_SCHEMA, *,
               reason: str = "cancelled by flowq.runs.cancel_run") -> CancelResult:
    """Cancel the run: pending steps become `cancelled` (with `reason` as their last_error),
    a running step is flagged so that it creates no successor when it finishes.

    A run already cancelled is left alone (nothing changed); a succeeded or dead run raises
    RunStateError.
    """
    q = Queries(schema)
    run_id = _check_id(run_id)
    with _transaction(bind) as conn:
        run = _lock(conn, q, run_id)
        if run.status in ("succeeded", "dead"):
            raise RunStateError(f"run {run_id} already ended {run.status}: there is nothing "
                                "to cancel" + (" (retry it, or leave it)"
                                               if run.status == "dead" else ""))
        rows = conn.execute(q.cancel_run_jobs, {"run_id": run_id, "error": reason}).all()
        after = _select(conn, q, run_id)
    return CancelResult(
        run=after,
        cancelled=tuple(sorted(r.id for r in rows if r.status == "cancelled")),
        cancel_requested=tuple(sorted(r.id for r in rows if r.status == "running")))


def retry_run(bind: Bind, run_id: int, schema: str = DEFAULT_SCHEMA) -> RetryResult:
    """Resume a dead run from the step that died: that step is pending again, due now, with a
    fresh attempt budget; earlier steps and their results are kept. RunStateError unless the
    run is dead."""
    q = Queries(schema)
    run_id = _check_id(run_id)
    with _transaction(bind) as conn:
        run = _lock(conn, q, run_id)
        if run.status != "dead":
            raise RunStateError(f"run {run_id} is {run.status}, not dead: only a dead run can "
                                "be retried")
        dead = run.current_step
        conn.execute(q.retry_dead_job, {"id": dead.job_id,
                                        "channel": notify_channel(schema)}).all()
        after = _select(conn, q, run_id)
    return RetryResult(run=after, job_id=dead.job_id, step=dead.step)
