"""The dashboard's own reads: queue activity over time, what each worker runs, argument search.

Each runs the dashboard's bounded reads (`flowq.db.store`) in one read-only transaction
under `READ_TIMEOUT_MS`, so no page can hold a connection for long however many rows are
retained. Nothing here writes: the charts are computed from the rows the workers write
anyway (no rollup, so the workers' hot path pays nothing for them).

- `activity(window)`: per queue, over the last hour (60 buckets of a minute) or day (96 of
  15 minutes): depth, started, finished, failed attempts and dead jobs per bucket, pickup
  delay p50/p95 per bucket, from the first bucket with data (at least `MIN_SHOWN_BUCKETS`
  of them: a fresh queue's charts span its own history). It reads at most `ACTIVITY_ROWS` finished rows (the latest), and as many running
  and due ones; `truncated` says the window held more finished rows than that.
- `running_jobs`: up to `RUNNING_ROWS` running rows with the worker holding each.
- `batches`: up to `BATCH_ROWS` batches, newest first, with their callback's state.
- `search_args`: up to `SEARCH_ROWS` rows whose arguments contain a JSON object, or None
  when it ran past `SEARCH_TIMEOUT_MS` (no index serves it).

A read cancelled by its timeout gives an empty answer that says so (`Activity.timed_out`,
`search_args` None), not an error page.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, Literal, TypeVar

import sqlalchemy as sa

from flowq.db.store import Store
from flowq.db.store.durable import BatchInfo
from flowq.errors import InvalidArgumentsError
from flowq.jsonargs import JSONError, dumps_checked
from flowq.names import DEFAULT_SCHEMA, validate_schema_name

__all__ = [
    "ACTIVITY_ROWS",
    "BATCH_ROWS",
    "MIN_SHOWN_BUCKETS",
    "READ_TIMEOUT_MS",
    "RUNNING_ROWS",
    "SEARCH_ROWS",
    "SEARCH_TIMEOUT_MS",
    "WINDOWS",
    "Activity",
    "BatchInfo",
    "FoundJob",
    "QueueSeries",
    "ReadTimedOut",
    "RunningJob",
    "activity",
    "batches",
    "database_now",
    "due_times",
    "known_tasks",
    "parse_search",
    "running_jobs",
    "search_args",
]

READ_TIMEOUT_MS: Final = 5000
ACTIVITY_ROWS: Final = 200_000
RUNNING_ROWS: Final = 500
SEARCH_ROWS: Final = 50
BATCH_ROWS: Final = 50
# A chart shows at least this many buckets, from its first with data (see `_trimmed`).
MIN_SHOWN_BUCKETS: Final = 10
# How many of the newest rows the task filter's list is read from (beside the workers').
KNOWN_TASK_ROWS: Final = 5000
# How long the argument search may walk rows before giving up (it has no index).
SEARCH_TIMEOUT_MS: Final = 3000
Window = Literal["hour", "day"]
T = TypeVar("T")
# A window: (its length, the bucket), in seconds.
WINDOWS: Final[dict[str, tuple[int, int]]] = {"hour": (3600, 60), "day": (86400, 900)}


@dataclass
class QueueSeries:
    """One queue's figures per bucket, oldest first (None: no job started in that bucket)."""

    depth: list[int]
    started: list[int]
    finished: list[int]
    dead: list[int]
    failed: list[int]  # attempts that failed (retried, or the last of a dead job)
    p50: list[float | None]
    p95: list[float | None]


@dataclass
class Activity:
    """The charts' data: buckets of `bucket_s` seconds from `since` to `now`."""

    window: str
    since: datetime
    now: datetime
    bucket_s: int
    buckets: int
    queues: dict[str, QueueSeries] = field(default_factory=dict)
    truncated: bool = False
    timed_out: bool = False  # the read ran past READ_TIMEOUT_MS: no charts


class ReadTimedOut(Exception):
    """A dashboard read ran past its statement timeout (PostgreSQL cancelled it)."""


def _timed(engine: sa.Engine, schema: str, ms: int, fn: Callable[[Store], T]) -> T:
    validate_schema_name(schema)
    try:
        with engine.connect() as conn, conn.begin():
            store = Store.of(conn, schema)
            store.set_statement_timeout(ms)
            return fn(store)
    except sa.exc.OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) == "57014":  # query_canceled
            raise ReadTimedOut from None
        raise


def activity(engine: sa.Engine, window: str = "hour", *, queue: str | None = None,
             schema: str = DEFAULT_SCHEMA) -> Activity:
    """The per-queue activity of the last `window` ("hour" or "day"); only `queue`'s
    when given."""
    if window not in WINDOWS:
        raise InvalidArgumentsError(f"window must be one of {', '.join(WINDOWS)}, "
                                    f"got {window[:20]!r}")
    length, bucket = WINDOWS[window]
    n = length // bucket

    def read(store: Store) -> Activity:
        now = store.now()
        # Buckets end on a bucket boundary, the last one holding now.
        end = datetime.fromtimestamp((now.timestamp() // bucket + 1) * bucket, now.tzinfo)
        since = end - timedelta(seconds=length)
        out = Activity(window=window, since=since, now=now, bucket_s=bucket, buckets=n)
        rows = store.queue_activity(since, bucket, ACTIVITY_ROWS)
        due: dict[str, list[int]] = {}
        taken: dict[str, list[int]] = {}
        for r in rows:
            if r.kind == "read":
                out.truncated = r.n >= ACTIVITY_ROWS
                continue
            if not 0 <= r.bucket < n:
                continue
            s = out.queues.get(r.queue)
            if s is None:
                s = out.queues[r.queue] = QueueSeries(
                    [0] * n, [0] * n, [0] * n, [0] * n, [0] * n, [None] * n, [None] * n)
                due[r.queue], taken[r.queue] = [0] * n, [0] * n
            if r.kind == "started":
                s.started[r.bucket], s.p50[r.bucket], s.p95[r.bucket] = r.n, r.p50, r.p95
            elif r.kind in ("finished", "dead", "failed"):
                getattr(s, r.kind)[r.bucket] = r.n
            else:
                (due if r.kind == "due" else taken)[r.queue][r.bucket] = r.n
        for name, s in out.queues.items():
            depth = 0
            for i in range(n):
                depth += due[name][i] - taken[name][i]
                s.depth[i] = max(depth, 0)
        out.queues = dict(sorted((k, v) for k, v in out.queues.items()
                                 if queue is None or k == queue))
        return _trimmed(out)

    try:
        result = _timed(engine, schema, READ_TIMEOUT_MS, read)
    except ReadTimedOut:
        now = datetime.now().astimezone()
        return Activity(window=window, since=now - timedelta(seconds=length), now=now,
                        bucket_s=bucket, buckets=n, timed_out=True)
    return result


def _trimmed(act: Activity) -> Activity:
    """`act` from its first bucket with data on (keeping at least `MIN_SHOWN_BUCKETS`), so
    a fresh queue's charts span its data rather than hug the right edge of the window."""
    first = act.buckets
    for s in act.queues.values():
        for series in (s.depth, s.started, s.finished, s.dead, s.failed):
            first = min(first, next((i for i, v in enumerate(series) if v), act.buckets))
    start = max(0, min(first, act.buckets - MIN_SHOWN_BUCKETS))
    if start == 0:
        return act
    for s in act.queues.values():
        for name in ("depth", "started", "finished", "dead", "failed", "p50", "p95"):
            setattr(s, name, getattr(s, name)[start:])
    act.since += timedelta(seconds=start * act.bucket_s)
    act.buckets -= start
    return act


@dataclass(frozen=True)
class RunningJob:
    """A running job and the worker that holds it."""

    job_id: int
    run_id: int
    task: str
    step: str
    queue: str
    attempts: int
    max_attempts: int
    worker: str | None
    started_at: datetime | None
    running_s: float


def running_jobs(engine: sa.Engine, *, schema: str = DEFAULT_SCHEMA,
                 limit: int = RUNNING_ROWS) -> list[RunningJob]:
    """Up to `limit` running jobs, the longest running first."""

    def read(store: Store) -> list[RunningJob]:
        return [RunningJob(r.id, r.run_id, r.task, r.step, r.queue, r.attempts,
                           r.max_attempts, r.locked_by, r.locked_at, r.running_s)
                for r in store.running_rows(limit)]

    return _timed(engine, schema, READ_TIMEOUT_MS, read)


def parse_search(text: str) -> str:
    """A search box's text as the JSON of an object to match arguments against: a JSON
    object (`{"user_id": 7}`), or `name=value` (value as JSON, else as a string)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise InvalidArgumentsError(f"the search is not a JSON object: {exc}") from None
    else:
        name, sep, raw = text.partition("=")
        if not sep or not name.strip():
            raise InvalidArgumentsError('search arguments with a JSON object, e.g. '
                                        '{"user_id": 7}, or name=value')
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = raw.strip()
        value = {name.strip(): parsed}
    if not isinstance(value, dict):
        raise InvalidArgumentsError("search arguments with a JSON object, e.g. {\"user_id\": 7}")
    try:
        return dumps_checked(value, "the search")
    except JSONError as exc:
        raise InvalidArgumentsError(str(exc)) from None


@dataclass(frozen=True)
class FoundJob:
    """A job row whose arguments matched a search."""

    job_id: int
    run_id: int
    task: str
    step: str
    queue: str
    status: str
    created_at: datetime


def search_args(engine: sa.Engine, args_json: str, *, schema: str = DEFAULT_SCHEMA,
                limit: int = SEARCH_ROWS) -> list[FoundJob] | None:
    """Up to `limit` rows, newest first, whose arguments contain `args_json` (from
    `parse_search`), under `SEARCH_TIMEOUT_MS` (no index serves it); None when it ran out
    of time."""

    def read(store: Store) -> list[FoundJob]:
        return [FoundJob(r.id, r.run_id, r.task, r.step, r.queue, r.status, r.created_at)
                for r in store.find_jobs_by_args(args_json, limit)]

    try:
        return _timed(engine, schema, SEARCH_TIMEOUT_MS, read)
    except ReadTimedOut:
        return None


def due_times(engine: sa.Engine, run_ids: list[int], *,
              schema: str = DEFAULT_SCHEMA) -> dict[int, datetime]:
    """When the pending steps of each of `run_ids` are due (runs with none left out)."""

    def read(store: Store) -> dict[int, datetime]:
        return {r.run_id: r.due_at for r in store.due_times(run_ids)}

    return _timed(engine, schema, READ_TIMEOUT_MS, read)


def known_tasks(engine: sa.Engine, *, schema: str = DEFAULT_SCHEMA) -> list[str]:
    """The task names the runs filter lists (`select_known_tasks`)."""

    return _timed(engine, schema, READ_TIMEOUT_MS,
                  lambda store: store.known_tasks(KNOWN_TASK_ROWS, 500))


def database_now(engine: sa.Engine, *, schema: str = DEFAULT_SCHEMA) -> datetime:
    """The database's clock (a run page's timeline ends there while steps still run)."""
    return _timed(engine, schema, READ_TIMEOUT_MS, lambda store: store.now())


def batches(engine: sa.Engine, before: int | None = None, *, schema: str = DEFAULT_SCHEMA,
            limit: int = BATCH_ROWS) -> list[BatchInfo]:
    """Up to `limit` batches with ids below `before` (None: the newest), newest first."""
    return _timed(engine, schema, READ_TIMEOUT_MS,
                  lambda store: store.list_batches(limit, before))
