"""Runs: inspect a run and its steps, wait for it, cancel it, retry what died.

A run has no row of its own (see `flowq.schema`): it is the set of `flowq.jobs` rows that
share a `run_id`, one per step reached so far (one per item for a mapped step). Its status
is derived from them (`run_status`):

- `cancelled` if any step is `cancelled` or has `cancel_requested` (a running step that was
  asked to stop still finishes; `RunInfo.finished_at` stays empty until it has);
- else `running`, `pending` or `waiting` while any step is (in that order);
- else `dead` if any step is dead, else `succeeded`. Every step a success unblocks is
  created in the very transaction that records the success, so a run whose rows have all
  succeeded has reached all its leaves: no snapshot shows a success without its successors.

A succeeded run's `result` is its leaves' results: the single leaf's result, or a dict by
step name when there are several (a mapped leaf gives the list of its instances' results).
The leaves are known from the pipeline's definition when it is imported in this process;
otherwise the steps with the highest index are taken as the leaves.

`cancel_run` ends pending and waiting steps `cancelled` and flags running ones with
`cancel_requested`: their handlers finish (and their `ctx.session` writes commit) but they
create no successor and count towards no join. Cancelling a run that is already cancelled
changes nothing; cancelling a succeeded or dead run raises `RunStateError`.

`retry_run` resumes a `dead` run: every dead step (and dead map instance) goes back to
`pending`, due now, with its attempts reset to 0 so its retry policy starts afresh (a step
whose signal never came waits for it again, for its timeout); its `last_error` is kept until
the next attempt ends, and nothing that succeeded runs again. Retrying a run that is not
dead raises `RunStateError`. `retry_runs` does the same to every dead run matching filters,
in batches (see there).

Filters (`list_runs`, `retry_runs`): `task` (the run's task or pipeline name), `queue` (a run
matches if any of its steps is on it), and `since`/`until` on the run's creation (its first
row's `created_at`), each an aware datetime, a timedelta (that long before the database's
`now()`, read once), or text: an ISO 8601 time (one without an offset is this machine's
local time, as the CLI prints times) or a duration ago such as `90s`, `30m`, `1h`, `2d`,
`1w`, `1h30m` (`parse_when`). A run is in the window when `since <= created < until`.

Both take row locks on the whole run first, so they never race a completing step. Every
function takes an Engine (one transaction of its own) or a Connection (joins its open
transaction, which the caller commits; else commits its own). `wait_run` (and the async
`await_run`) polls until a run has finished.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, Final, TypeVar, cast

import sqlalchemy as sa

from flowq.app import _validate_name, find_definition, validate_queue
from flowq.db.schema import DEFAULT_SCHEMA, STATUSES, Status, notify_channel
from flowq.db.sql import Queries
from flowq.errors import (
    ConfigurationError,
    InvalidArgumentsError,
    RunNotFoundError,
    RunStateError,
)

__all__ = [
    "CancelResult",
    "DeadStep",
    "RetryResult",
    "RunInfo",
    "RunSummary",
    "StepGroup",
    "StepInfo",
    "UnservedJobs",
    "await_run",
    "cancel_run",
    "dead_steps",
    "find_run",
    "get_run",
    "list_runs",
    "parse_when",
    "retry_run",
    "retry_runs",
    "run_status",
    "unserved_jobs",
    "wait_run",
]

DEFAULT_LIST_LIMIT: Final = 50
# How many runs `retry_runs` retries per transaction.
DEFAULT_RETRY_BATCH: Final = 500
# A worker heartbeats its registry entry every --heartbeat-interval (5 s by default): one
# silent for a minute is gone.
UNSERVED_STALE_AFTER: Final = 60.0
# Each pass locks what the previous one saw plus what completions created meanwhile: the set
# settles in a few passes; the cap only guards against a bug turning this into a loop.
_MAX_LOCK_PASSES: Final = 100
# How `wait_run` polls: from the first interval, doubling up to the last.
_WAIT_POLL: Final = (0.02, 1.0)

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
    map_index: int | None = None  # the item position of a map instance


@dataclass(frozen=True)
class StepGroup:
    """One step of a run's graph: its row, or all its map instances, aggregated."""

    step: str
    index: int
    parents: tuple[str, ...] | None  # None: the definition is not imported here
    status: Status
    instances: int | None  # None: not mapped
    counts: dict[str, int]  # rows by status
    attempts: int  # all attempts of its rows


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
    result: Any  # the leaves' results once the run succeeded, else None
    steps: tuple[StepInfo, ...]
    graph: tuple[StepGroup, ...] = ()

    @property
    def current_step(self) -> StepInfo:
        """The latest step reached (the highest index, the latest row)."""
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
    """What `retry_run` changed: the dead steps that run again (`job_id` and `step` are the
    first of them)."""

    run: RunInfo
    job_id: int
    step: str
    job_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run.run_id, "retried_job_id": self.job_id,
                "retried_step": self.step, "retried_job_ids": list(self.job_ids),
                "run": self.run.to_dict()}


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
        result=row.result, map_index=row.map_index)


def run_status(steps: Sequence[StepInfo]) -> Status:
    """A run's status from its rows (the module docstring says why it is sound)."""
    seen = {s.status for s in steps}
    if "cancelled" in seen or any(s.cancel_requested for s in steps):
        return "cancelled"
    for status in ("running", "pending", "waiting", "dead"):
        if status in seen:
            return cast(Status, status)
    return "succeeded"


_ORDER: Final = ("running", "pending", "waiting", "dead", "cancelled", "succeeded")


def _graph(steps: Sequence[StepInfo], definition: Any) -> tuple[StepGroup, ...]:
    groups: dict[str, list[StepInfo]] = {}
    for s in steps:
        groups.setdefault(s.step, []).append(s)
    out = []
    for name, rows in sorted(groups.items(), key=lambda kv: (kv[1][0].index, kv[0])):
        counts: dict[str, int] = {}
        for r in rows:
            counts[r.status] = counts.get(r.status, 0) + 1
        mapped = any(r.map_index is not None for r in rows)
        step = definition.step_named(name) if definition is not None and name else None
        status = next(st for st in _ORDER if st in counts)
        out.append(StepGroup(step=name, index=rows[0].index,
                             parents=None if step is None else tuple(step.parents),
                             status=status, instances=len(rows) if mapped else None,
                             counts=counts, attempts=sum(r.attempts for r in rows)))
    return tuple(out)


def _result(steps: Sequence[StepInfo], definition: Any) -> Any:
    """The leaves' results (see the module docstring)."""
    if definition is not None and definition.steps:
        leaves = [s.name for s in definition.leaves]
    else:
        top = max(s.index for s in steps)
        leaves = sorted({s.step for s in steps if s.index == top})
    results: dict[str, Any] = {}
    for name in leaves:
        rows = [s for s in steps if s.step == name]
        if rows and all(r.map_index is not None for r in rows):
            results[name] = [r.result for r in sorted(rows, key=lambda r: r.map_index or 0)]
        else:
            results[name] = rows[0].result if rows else []
    if len(results) == 1:
        return next(iter(results.values()))
    return results


def _run_of(run_id: int, rows: list[Any], schema: str) -> RunInfo:
    if not rows:
        raise RunNotFoundError(f"no run {run_id} exists (it may have been pruned, or the id "
                               "is a job id rather than a run id)")
    steps = tuple(_step(r) for r in rows)
    cancel_requested = any(s.cancel_requested for s in steps)
    status = run_status(steps)
    done = not any(s.status in ("pending", "running", "waiting") for s in steps)
    finished = [s.finished_at for s in steps if s.finished_at is not None]
    task = rows[0].task
    definition = find_definition(task, schema)
    if definition is not None and not {s.step for s in steps} <= (
            {st.name for st in definition.steps} | {""}):
        definition = None  # another app's pipeline of that name (or a deploy renamed steps)
    return RunInfo(
        run_id=run_id, task=task, status=status,
        cancel_requested=cancel_requested, idempotency_key=rows[0].idempotency_key,
        created_at=min(s.created_at for s in steps),
        finished_at=max(finished) if done and finished else None,
        result=_result(steps, definition) if status == "succeeded" else None, steps=steps,
        graph=_graph(steps, definition))


def _select(conn: sa.Connection, q: Queries, run_id: int) -> RunInfo:
    return _run_of(run_id, list(conn.execute(q.select_run_jobs, {"run_id": run_id})), q.schema)


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


def find_run(bind: Bind, key: str, schema: str = DEFAULT_SCHEMA) -> int | None:
    """The run id of the run holding idempotency key `key`, or None."""
    if not isinstance(key, str):
        raise InvalidArgumentsError(f"an idempotency key is text, got {key!r}")
    q = Queries(schema)

    def read(conn: sa.Connection) -> int | None:
        row = conn.execute(q.find_run_by_key, {"idempotency_key": key}).first()
        return None if row is None else int(row.run_id)

    return _read(bind, read)


@dataclass(frozen=True)
class DeadStep:
    """The first dead step of a dead run, and why it died."""

    run_id: int
    step: str
    map_index: int | None
    last_error: str | None


def dead_steps(bind: Bind, run_ids: Sequence[int],
               schema: str = DEFAULT_SCHEMA) -> dict[int, DeadStep]:
    """For each of `run_ids` that has a dead step, its first one (the dead-letter view)."""
    q = Queries(schema)
    ids = [_check_id(i) for i in run_ids]
    if not ids:
        return {}
    return _read(bind, lambda conn: {
        r.run_id: DeadStep(r.run_id, r.step, r.map_index, r.last_error)
        for r in conn.execute(q.select_dead_errors, {"run_ids": ids})})


# -- filters ----------------------------------------------------------------------------------

When = datetime | timedelta | str
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_WHEN_HELP: Final = ("an ISO 8601 time (2024-05-01, 2024-05-01T10:00, 2024-05-01T10:00+02:00) "
                     "or a duration ago such as 90s, 30m, 1h, 2d, 1w, 1h30m")


def parse_when(text: str) -> datetime | timedelta:
    """`since`/`until` text: a duration ago (`30m`, `1h30m`: a timedelta) or an ISO 8601 time
    (an aware datetime; without an offset, this machine's local time). InvalidArgumentsError
    otherwise."""
    compact = text.strip().replace(" ", "").lower()
    if compact and _DURATION.sub("", compact) == "":
        try:
            return timedelta(seconds=sum(float(n) * _UNITS[u]
                                         for n, u in _DURATION.findall(compact)))
        except OverflowError:
            raise InvalidArgumentsError(f"{text!r} is too long ago") from None
    iso = text.strip()
    if iso.endswith(("Z", "z")):  # Python 3.10's fromisoformat knows no "Z"
        iso = iso[:-1] + "+00:00"
    try:
        at = datetime.fromisoformat(iso)
    except ValueError:
        raise InvalidArgumentsError(f"cannot read {text!r} as a time: give {_WHEN_HELP}"
                                    ) from None
    return at if at.tzinfo is not None else at.astimezone()


def _when(what: str, value: When | None) -> datetime | timedelta | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = parse_when(value)
    if isinstance(value, timedelta):
        if value < timedelta(0):
            raise InvalidArgumentsError(f"{what} must be a duration ago of at least 0, "
                                        f"got {value!r}")
        return value
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise InvalidArgumentsError(
                f"{what} must be a timezone-aware datetime (or a timedelta ago), got {value!r}")
        return value
    raise InvalidArgumentsError(f"{what} must be a datetime, a timedelta or text ({_WHEN_HELP}), "
                                f"got {value!r}")


@dataclass(frozen=True)
class _Filters:
    task: str | None
    queue: str | None
    since: datetime | timedelta | None
    until: datetime | timedelta | None

    def params(self, conn: sa.Connection, q: Queries) -> dict[str, Any]:
        """The bind parameters; durations ago are measured on the database's clock."""
        since, until = self.since, self.until
        if isinstance(since, timedelta) or isinstance(until, timedelta):
            now = conn.execute(q.select_now).scalar_one()
            try:
                since = now - since if isinstance(since, timedelta) else since
                until = now - until if isinstance(until, timedelta) else until
            except OverflowError:
                raise InvalidArgumentsError("since/until is too long ago") from None
        if since is not None and until is not None and since >= until:
            raise InvalidArgumentsError(
                f"since ({since.isoformat()}) is not before until ({until.isoformat()}): no "
                "run can match")
        return {"task": self.task, "queue": self.queue, "since": since, "until": until}


def _filters(task: str | None, queue: str | None, since: When | None,
             until: When | None) -> _Filters:
    if task is not None:
        try:
            _validate_name("task", task)
        except ConfigurationError as exc:
            raise InvalidArgumentsError(str(exc)) from None
    return _Filters(task=task, queue=None if queue is None else validate_queue(queue),
                    since=_when("since", since), until=_when("until", until))


def _count(what: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentsError(f"{what} must be an integer of at least {minimum}, "
                                    f"got {value!r}")
    return value


def list_runs(bind: Bind, *, status: Status | None = None, task: str | None = None,
              queue: str | None = None, since: When | None = None, until: When | None = None,
              before: int | None = None, limit: int = DEFAULT_LIST_LIMIT,
              schema: str = DEFAULT_SCHEMA) -> list[RunSummary]:
    """The newest `limit` runs, newest first, below run id `before` if given (the next page
    starts below the last run id of this one), optionally only those with derived `status`,
    of `task`, with a step on `queue`, created in [`since`, `until`) (see the module
    docstring). Cost: `Queries._runs_page` (a page walks the run id index from the cursor
    until it has `limit` matches)."""
    q = Queries(schema)
    if status is not None and status not in STATUSES:
        raise InvalidArgumentsError(f"status must be one of {', '.join(STATUSES)}, "
                                    f"got {status!r}")
    if before is not None:
        before = _count("before (a run id)", before, 1)
    filters = _filters(task, queue, since, until)
    limit = max(0, int(limit))

    def read(conn: sa.Connection) -> list[RunSummary]:
        rows = conn.execute(q.list_runs, {**filters.params(conn, q), "status": status,
                                          "before": before, "limit": limit})
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
    """Resume a dead run: every dead step (and dead map instance) runs again, due now, with a
    fresh attempt budget; what succeeded is kept and never re-run. RunStateError unless the
    run is dead."""
    q = Queries(schema)
    run_id = _check_id(run_id)
    with _transaction(bind) as conn:
        run = _lock(conn, q, run_id)
        if run.status != "dead":
            raise RunStateError(f"run {run_id} is {run.status}, not dead: only a dead run can "
                                "be retried")
        ids = sorted(r.id for r in conn.execute(
            q.retry_dead_jobs, {"run_id": run_id, "channel": notify_channel(schema)}))
        after = _select(conn, q, run_id)
    first = next(s for s in after.steps if s.job_id == ids[0])
    return RetryResult(run=after, job_id=first.job_id, step=first.step, job_ids=tuple(ids))


def _lock_runs(conn: sa.Connection, q: Queries, run_ids: list[int]) -> None:
    """`_lock` for many runs: every row of each, in id order, until the set stops growing."""
    seen: set[int] = set()
    for _ in range(_MAX_LOCK_PASSES):
        ids = set(conn.execute(q.lock_runs_jobs, {"run_ids": run_ids}).scalars())
        if ids == seen:
            break
        seen = ids


def retry_runs(bind: Bind, *, status: str = "dead", task: str | None = None,
               queue: str | None = None, since: When | None = None, until: When | None = None,
               limit: int | None = None, batch_size: int = DEFAULT_RETRY_BATCH,
               schema: str = DEFAULT_SCHEMA) -> int:
    """Retry every dead run matching the filters (see the module docstring; at most `limit`
    runs), as `retry_run` does each one; return how many runs were retried (0 when none
    matches: not an error).

    In batches of `batch_size` runs, oldest first, each in a transaction of its own (on an
    Engine, or a Connection outside a transaction; a Connection's open transaction is
    joined instead, and the caller commits it all). A batch picks its runs without locks,
    locks every row of them (as `retry_run` does), and retries those still dead; a run
    that changed meanwhile (retried, cancelled, pruned) is skipped. Each batch starts after
    the previous one's last run id, so the whole redrive walks the runs once, and a run
    that dies again while it goes on is not retried twice. Durations ago (`since="1h"`)
    are measured once, at the start."""
    if status != "dead":
        raise InvalidArgumentsError(f"only dead runs can be retried: status must be 'dead', "
                                    f"got {status!r}")
    if limit is not None:
        limit = _count("limit", limit, 1)
    batch_size = _count("batch_size", batch_size, 1)
    filters = _filters(task, queue, since, until)
    q = Queries(schema)
    params: dict[str, Any] | None = None
    after: int | None = None
    total = 0
    while limit is None or total < limit:
        size = batch_size if limit is None else min(batch_size, limit - total)
        with _transaction(bind) as conn:
            if params is None:
                params = filters.params(conn, q)  # a duration ago is measured once
            picked = list(conn.execute(q.select_dead_runs, {
                **params, "after": after, "limit": size}).scalars())
            if picked:
                _lock_runs(conn, q, picked)
                total += len(conn.execute(q.retry_dead_runs, {
                    "run_ids": picked, "channel": notify_channel(schema)}).all())
        if len(picked) < size:
            break
        after = picked[-1]
    return total


def _finished(run: RunInfo) -> bool:
    return not any(s.status in ("pending", "running", "waiting") for s in run.steps)


def wait_run(bind: sa.Engine, run_id: int, *, timeout: float | None = None,
             schema: str = DEFAULT_SCHEMA) -> RunInfo:
    """Block until run `run_id` has finished (succeeded, dead, or cancelled with nothing left
    running), and return it; TimeoutError after `timeout` seconds. Polls, from 20 ms backing
    off to 1 s."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = _WAIT_POLL[0]
    while True:
        run = get_run(bind, run_id, schema)
        if _finished(run):
            return run
        if deadline is not None and time.monotonic() + pause > deadline:
            raise TimeoutError(f"run {run_id} is still {run.status} after {timeout}s")
        time.sleep(pause)
        pause = min(pause * 2, _WAIT_POLL[1])


async def await_run(bind: Any, run_id: int, *, timeout: float | None = None,
                    schema: str = DEFAULT_SCHEMA) -> RunInfo:
    """`wait_run` for asyncio: `bind` is an AsyncEngine (or an Engine, read in a thread)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = _WAIT_POLL[0]
    run_id = _check_id(run_id)
    while True:
        if isinstance(bind, sa.Engine):
            run = await asyncio.to_thread(get_run, bind, run_id, schema)
        else:
            async with bind.connect() as conn:
                run = await conn.run_sync(lambda c: get_run(c, run_id, schema))
        if _finished(run):
            return run
        if deadline is not None and time.monotonic() + pause > deadline:
            raise TimeoutError(f"run {run_id} is still {run.status} after {timeout}s")
        await asyncio.sleep(pause)
        pause = min(pause * 2, _WAIT_POLL[1])
