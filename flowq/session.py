"""Transactional enqueue: a job is one INSERT in the caller's own transaction.

`enqueue(session_or_connection, task, /, **options_and_args)` runs one `INSERT … RETURNING`
through the caller's `Session` or `Connection`, so the job commits or rolls back with the
business rows beside it (savepoints included), and never exists otherwise. The same
statement calls `pg_notify(<schema>, <queue>)`; PostgreSQL delivers a notification only when
its transaction commits, so workers wake exactly for committed jobs. No job data travels in
the notification.

Arguments are checked before any SQL is sent (JSON only; bound against the handler's
signature when the definition is known; the due time within `MIN_RUN_AT`..`MAX_RUN_AT`), so a
bad call raises a `flowq` error and leaves the caller's transaction usable. An
`idempotency_key` names the run: a second enqueue with the same key returns the existing run
(`created=False`), whatever its arguments or state, without locking it (see `_build_insert`).
`unique=True` (a key of the task and its arguments) or `unique_key=` returns the run of the
task active under that key (any step pending, waiting or running), if any, and otherwise
starts a new one holding the key (`Queries.insert_job_unique` says why that is race-free).

The preparation (`prepare_enqueue`, `prepare_enqueue_many`) is shared with the async twin in
`flowq.aio`; only the few lines that execute differ.

Speed: enqueue usually sits in a short business transaction, where one more round trip is most
of its cost. On a psycopg 3 connection the INSERT is sent directly on the session's own DBAPI
connection; when it is the transaction's first statement, in pipeline mode, so that psycopg's
BEGIN travels in the same network write (no extra round trip at all). SQLAlchemy's execute
layer (about 0.1 ms of Python per statement) is skipped. The statement is the
same compiled SQL in the same transaction; SQLAlchemy's execute events and `echo` do not see
it. Other drivers, and `enqueue_many` (whose cost is its rows, not a round trip), take the
SQLAlchemy path.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import weakref
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any, Generic, TypeVar, Union, cast

import psycopg
import sqlalchemy as sa
from psycopg.pq import TransactionStatus
from sqlalchemy import orm

from flowq import tracing
from flowq.app import DEFAULT_QUEUE, Pipeline, _validate_name, find_definition, validate_queue
from flowq.db.checks import is_missing_schema_error
from flowq.db.checks import schema_missing as schema_missing  # re-exported for flowq.aio
from flowq.db.runner import fetch_rows, raw_sql
from flowq.db.schema import DEFAULT_SCHEMA, notify_channel
from flowq.db.sql import queries
from flowq.errors import (
    ConfigurationError,
    FlowqError,
    InvalidArgumentsError,
    UnknownTaskError,
)
from flowq.jsonargs import JSONError, dumps_checked
from flowq.retry import DEFAULT_MAX_ATTEMPTS
from flowq.workflows import PreparedSignal, Signalled, prepare_signal

__all__ = ["Enqueued", "Session", "SessionMixin", "enqueue", "enqueue_many", "signal"]

MAX_PRIORITY = 32767
# In UTF-8 bytes: a btree entry must stay well under PostgreSQL's ~2.7 kB limit, or the INSERT
# would fail inside the caller's transaction instead of being refused up front.
MAX_KEY_BYTES = 1000
# The due times accepted (run_at, or the database's now() plus delay): what PostgreSQL's
# timestamptz and Python's datetime (years 1-9999) can both hold, with two days to spare so
# that psycopg can read run_at back in any session time zone (an offset is under a day) and
# a delay checked on this machine's clock still fits on the database's.
MIN_RUN_AT = datetime(1, 1, 3, tzinfo=timezone.utc)
MAX_RUN_AT = datetime(9999, 12, 30, tzinfo=timezone.utc)
# How often a keyed enqueue starts over when the run that beat it to its key was deleted
# before it could be read (see `PreparedCall.statements`).
KEY_RACE_ATTEMPTS = 3
# How often a unique enqueue sends its statement again when a concurrent claim of its key
# committed after its snapshot (each attempt has a newer snapshot: losing again needs that
# run to finish and yet another enqueuer to claim the key in between).
UNIQUE_RACE_ATTEMPTS = 10

T = TypeVar("T")
Target = Union[sa.Connection, orm.Session, "orm.scoped_session[Any]"]


@dataclass(frozen=True)
class Enqueued:
    """What enqueue returns: the run's `id`, and `created=False` when an idempotency key or a
    unique key matched (`job_id`: that run's first row)."""

    id: int
    created: bool
    job_id: int


@dataclass(frozen=True)
class PreparedCall(Generic[T]):
    """A validated enqueue, ready to run on a sync or async connection; `finish` reads its result."""

    statement: sa.Executable
    params: dict[str, Any]
    schema: str
    finish: Callable[[Sequence[Any]], T]  # reads a result row
    direct: bool = False  # may take the psycopg pipeline path (see the module docstring)
    # A keyed enqueue's read of its key, for when its statement returns no row.
    lookup: sa.Executable | None = None
    # A unique enqueue: when its statement returns no row, send it again (a new snapshot).
    rerun: bool = False

    def statements(self) -> Generator[sa.Executable, Sequence[Any] | None, T]:
        """The statements to send, in turn: send back each one's first row (None if it had
        none); the generator returns the result. Sync and async execution share it."""
        for _ in range(UNIQUE_RACE_ATTEMPTS if self.rerun else KEY_RACE_ATTEMPTS):
            row = yield self.statement
            if row is None and self.lookup is not None:
                # The keyed statement waited for a concurrent inserter of its key, which
                # committed: that row is newer than the statement's snapshot, so it returned
                # nothing. Under READ COMMITTED a new statement takes a new snapshot, which
                # sees it. (Under REPEATABLE READ the INSERT raised a serialization failure.)
                row = yield self.lookup
            if row is not None:
                return self.finish(row)
            if self.lookup is None and not self.rerun:
                raise AssertionError("an enqueue statement returned no row")
            # The winner was deleted before we could read it: the key is free, start over.
            # (Unique: a claim of the key committed after our snapshot, which a new statement
            # sees; see `Queries.insert_job_unique`.)
        if self.rerun:
            raise FlowqError(
                f"could not enqueue with unique key {self.params['unique_key']!r}: "
                f"{UNIQUE_RACE_ATTEMPTS} times in a row a concurrent enqueue claimed it first "
                "(runs of that key start and finish faster than they can be enqueued?)")
        raise FlowqError(
            f"could not enqueue with idempotency_key {self.params['idempotency_key']!r}: "
            f"{KEY_RACE_ATTEMPTS} times a concurrent transaction inserted it, then it was "
            "deleted before it could be read"
        )


_DUE_RANGE = f"between {MIN_RUN_AT.date()} and {MAX_RUN_AT.date()} UTC"


def _due_params(run_at: datetime | None, delay: float | timedelta | None) -> dict[str, Any]:
    """The bind parameters of the due time; a due time the database could not hold (or
    psycopg not read back) is refused here, since at the server it would abort the caller's
    transaction, or leave a row that no worker can read."""
    if run_at is not None and delay is not None:
        raise InvalidArgumentsError("pass either run_at or delay, not both")
    if run_at is not None:
        if (not isinstance(run_at, datetime) or run_at.tzinfo is None
                or run_at.utcoffset() is None):
            raise InvalidArgumentsError(
                f"run_at must be a timezone-aware datetime (e.g. datetime.now(timezone.utc)), "
                f"got {run_at!r}"
            )
        # Compared as aware datetimes: no conversion to UTC, which could itself overflow.
        if not MIN_RUN_AT <= run_at <= MAX_RUN_AT:
            raise InvalidArgumentsError(f"run_at must be {_DUE_RANGE}, got {run_at!r}")
        return {"run_at": run_at, "delay": timedelta(0)}
    if delay is None:
        return {"run_at": None, "delay": timedelta(0)}
    if isinstance(delay, int | float) and not isinstance(delay, bool):
        if not math.isfinite(delay):
            raise InvalidArgumentsError(f"delay must be a finite number of seconds, got {delay!r}")
        try:
            interval = timedelta(seconds=delay)
        except OverflowError:
            interval = timedelta.max if delay > 0 else timedelta.min  # refused just below
    elif isinstance(delay, timedelta):
        interval = delay
    else:
        raise InvalidArgumentsError(
            f"delay must be seconds (a number) or a timedelta, got {delay!r}"
        )
    # A negative delay is due at once (run_at lies in the past), as long as it is in range.
    if interval:
        now = datetime.now(timezone.utc)  # the database's clock adds it; the margin covers skew
        if not MIN_RUN_AT - now <= interval <= MAX_RUN_AT - now:
            raise InvalidArgumentsError(
                f"delay must make the job due {_DUE_RANGE}, got {delay!r}"
            )
    return {"run_at": None, "delay": interval}


def _resolve(task: Pipeline | str, schema: str | None) -> tuple[str, Pipeline | None, str]:
    """(name, definition or None, schema) for what the caller passed as `task`."""
    if isinstance(task, Pipeline):
        return task.name, task, task.app.schema if schema is None else schema
    if isinstance(task, str):
        try:
            _validate_name("task", task)
        except ConfigurationError as exc:
            raise UnknownTaskError(str(exc)) from None
        schema = DEFAULT_SCHEMA if schema is None else schema
        return task, find_definition(task, schema), schema
    raise UnknownTaskError(
        f"enqueue needs a task or pipeline (or its registered name), got {task!r}"
    )


def _common_params(task: Pipeline | str, *, queue: str | None, priority: int | None,
                   run_at: datetime | None, delay: float | timedelta | None,
                   schema: str | None) -> tuple[str, Pipeline | None, str, dict[str, Any]]:
    """Validate everything but the arguments; (name, definition, schema, bind parameters)."""
    name, definition, schema = _resolve(task, schema)
    if definition is not None:
        if not definition.steps:
            raise ConfigurationError(f"pipeline {name!r} has no steps: nothing to enqueue")
        first = definition.first
        step_name, max_attempts = first.name, first.retry.attempt_cap
        default_queue, default_priority = first.queue, definition.priority
    else:
        # Unknown here (the producer need not import handlers): the worker resolves the
        # first step and its policy from its own registry; '' means "the first step". The
        # queue cannot be guessed: a default one that the task's workers do not serve would
        # leave the job pending forever, so the caller names it.
        if queue is None:
            raise UnknownTaskError(
                f"{name!r} is not a task or pipeline defined in this process, so flowq cannot "
                f"know which queue its workers serve: pass queue= (e.g. "
                f"enqueue({name!r}, queue={DEFAULT_QUEUE!r}, ...)), or import the module that "
                "defines it")
        step_name, max_attempts = "", DEFAULT_MAX_ATTEMPTS
        default_queue, default_priority = DEFAULT_QUEUE, 0
    if priority is None:
        priority = default_priority
    if isinstance(priority, bool) or not isinstance(priority, int) or not (
            -MAX_PRIORITY <= priority <= MAX_PRIORITY):
        raise InvalidArgumentsError(
            f"priority must be an integer between {-MAX_PRIORITY} and {MAX_PRIORITY} "
            f"(lower runs first), got {priority!r}"
        )
    params: dict[str, Any] = {
        "task": name,
        "step": step_name,
        "queue": validate_queue(queue if queue is not None else default_queue),
        "priority": priority,
        "max_attempts": max_attempts,
        "key_limit": definition.key_concurrency if definition is not None else None,
        "concurrency_key": None,
        "channel": notify_channel(schema),
        "trace_context": None,  # set by `execute` when tracing (flowq.tracing)
        **_due_params(run_at, delay),
    }
    return name, definition, schema, params


def _starts_many(definition: Pipeline | None) -> bool:
    """Whether a run of `definition` starts with more than its first step's one row, due
    now or at run_at: several roots, or a root that waits for a signal or is delayed."""
    if definition is None:
        return False
    roots = definition.roots
    return len(roots) > 1 or roots[0].wait_for is not None or bool(roots[0].delay)


def _args_json(name: str, definition: Pipeline | None, args: Mapping[str, Any]) -> str:
    """Check and encode one set of arguments: every root step of the run receives them."""
    args = args if type(args) is dict else dict(args)
    if definition is not None and _starts_many(definition):
        for root in definition.roots:
            check = args if root.wait_for is None else {**args, root.wait_for: None}
            root.check_arguments(check, what=f"arguments for {name!r}")
    elif definition is not None:
        definition.first.check_arguments(args, what=f"arguments for {name!r}")
    try:
        return dumps_checked(args, "args")
    except JSONError as exc:
        raise InvalidArgumentsError(f"cannot enqueue {name!r}: {exc}") from None


def _check_key(key: object, what: str = "idempotency_key") -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise InvalidArgumentsError(f"{what} must be a non-empty string, got {key!r}")
    try:
        dumps_checked(key, what)
    except JSONError as exc:
        raise InvalidArgumentsError(str(exc)) from None
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise InvalidArgumentsError(
            f"{what} is longer than {MAX_KEY_BYTES} bytes: hash it first"
        )
    return key


def _unique_key(name: str, args_json: str, unique: object, unique_key: object) -> str | None:
    """The key a unique enqueue holds in `flowq.uniques` (None: not unique). Scoped by task
    (a task name has no space): `NAME key KEY` for `unique_key=`, and for `unique=True`
    `NAME args sha256:HEX` of the arguments as canonical JSON (keys sorted, no spaces):
    the same arguments give the same key whatever their order, but an argument left to its
    default differs from one passed with the default's value, and 1 from 1.0."""
    if not isinstance(unique, bool):
        raise InvalidArgumentsError(f"unique must be True or False, got {unique!r}")
    if unique_key is not None:
        if unique:
            raise InvalidArgumentsError(
                "pass unique=True (the task and its arguments make the key) or "
                "unique_key=... (your own key), not both")
        return f"{name} key {_check_key(unique_key, 'unique_key')}"
    if not unique:
        return None
    canonical = json.dumps(json.loads(args_json), sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False)
    return f"{name} args sha256:{hashlib.sha256(canonical.encode('utf-8')).hexdigest()}"


def _enqueued(row: Sequence[Any]) -> Enqueued:
    job_id, run_id, created = row[:3]
    return Enqueued(id=run_id, created=bool(created), job_id=job_id)


def _run_ids(row: Sequence[Any]) -> list[int]:
    return list(row[0])


def prepare_enqueue(task: Pipeline | str, args: Mapping[str, Any], *,
                    idempotency_key: str | None = None, queue: str | None = None,
                    priority: int | None = None, run_at: datetime | None = None,
                    delay: float | timedelta | None = None,
                    schema: str | None = None, unique: bool = False,
                    unique_key: str | None = None) -> PreparedCall[Enqueued]:
    """Validate one enqueue completely, without touching the database."""
    name, definition, schema, params = _common_params(
        task, queue=queue, priority=priority, run_at=run_at, delay=delay, schema=schema)
    key = _check_key(idempotency_key)
    params["args"] = _args_json(name, definition, args)
    held_key = _unique_key(name, params["args"], unique, unique_key)
    if definition is not None and definition.concurrency_key is not None:
        params["concurrency_key"] = definition.key_of(dict(args))
    q = queries(schema)
    if held_key is not None:
        params.update(unique_key=held_key, idempotency_key=key)
    if definition is not None and _starts_many(definition):
        roots = definition.roots
        params.update(idempotency_key=key, steps=[r.name for r in roots],
                      step_indexes=[r.index for r in roots], queues=[r.queue for r in roots],
                      max_attempts=[r.retry.attempt_cap for r in roots],
                      delays=[r.delay for r in roots], signals=[r.wait_for for r in roots],
                      waits=[r.wait_timeout for r in roots])
        if queue is not None:  # queue= moves the steps the run starts with
            params["queues"] = [params["queue"]] * len(roots)
        if held_key is not None:
            return PreparedCall(q.insert_run_unique, params, schema, _enqueued, True,
                                rerun=True)
        return PreparedCall(q.insert_run, params, schema, _enqueued, True,
                            lookup=q.find_run_by_key if key is not None else None)
    if held_key is not None:
        return PreparedCall(q.insert_job_unique, params, schema, _enqueued, True, rerun=True)
    if key is None:
        return PreparedCall(q.insert_job, params, schema, _enqueued, True)
    params["idempotency_key"] = key
    return PreparedCall(q.insert_job_by_key, params, schema, _enqueued, True,
                        lookup=q.find_run_by_key)


def prepare_enqueue_many(task: Pipeline | str, args_list: Iterable[Mapping[str, Any]], *,
                         queue: str | None = None, priority: int | None = None,
                         run_at: datetime | None = None, delay: float | timedelta | None = None,
                         schema: str | None = None) -> PreparedCall[list[int]] | None:
    """Validate a bulk enqueue completely; None when there is nothing to insert."""
    name, definition, schema, params = _common_params(
        task, queue=queue, priority=priority, run_at=run_at, delay=delay, schema=schema)
    if _starts_many(definition):
        raise InvalidArgumentsError(
            f"enqueue_many inserts one row per run, but a run of {name!r} starts with several "
            "steps (several roots, or a root that waits or is delayed): enqueue its runs one "
            "by one")
    encoded: list[str] = []
    keys: list[str | None] = []
    for i, item in enumerate(args_list):
        if not isinstance(item, Mapping):
            raise InvalidArgumentsError(
                f"item {i} of enqueue_many is {type(item).__name__}, not a mapping of arguments"
            )
        try:
            encoded.append(_args_json(name, definition, item))
            keys.append(None if definition is None else definition.key_of(dict(item)))
        except InvalidArgumentsError as exc:
            raise InvalidArgumentsError(f"item {i}: {exc}") from None
    if not encoded:
        return None
    params["args"] = encoded
    params["concurrency_keys"] = keys
    return PreparedCall(queries(schema).insert_jobs, params, schema, _run_ids)


class _MigratedSchemas:
    """Which (engine, schema) pairs are known to have flowq's tables.

    Checked once per engine with a query that cannot fail, so that a missing schema is
    reported before the INSERT would abort the caller's transaction. Engines are held weakly:
    an id() could be reused by a new engine on another database.
    """

    def __init__(self) -> None:
        self._known: dict[str, weakref.WeakSet[sa.Engine]] = {}
        self._lock = threading.Lock()

    def __contains__(self, key: tuple[sa.Engine, str]) -> bool:
        engine, schema = key
        with self._lock:
            return engine in self._known.get(schema, ())

    def add(self, engine: sa.Engine, schema: str) -> None:
        with self._lock:
            self._known.setdefault(schema, weakref.WeakSet()).add(engine)

    def discard(self, engine: sa.Engine, schema: str) -> None:
        with self._lock:
            self._known.get(schema, weakref.WeakSet()).discard(engine)


migrated_schemas = _MigratedSchemas()


def translate_error(exc: sa.exc.ProgrammingError, engine: sa.Engine,
                    schema: str) -> BaseException:
    """The flowq error for a failed INSERT (the schema vanished after we checked), or `exc`."""
    if is_missing_schema_error(exc):
        migrated_schemas.discard(engine, schema)
        return schema_missing(schema)
    return exc


def _connection(target: Target, call: PreparedCall[Any] | PreparedSignal) -> sa.Connection:
    if isinstance(target, sa.Connection):
        return target
    if isinstance(target, orm.Session | orm.scoped_session):
        # The connection the session would use for this table, in its current transaction.
        return target.connection(bind_arguments={"clause": call.statement})
    raise TypeError(
        f"flowq.enqueue needs a SQLAlchemy Session or Connection, got {type(target).__name__}"
        " (for an AsyncSession use flowq.aio.enqueue)"
    )


_PIPELINE = psycopg.Pipeline.is_supported()


def _own_psycopg(conn: sa.Connection) -> psycopg.Connection[Any] | None:
    """The psycopg connection under `conn`, if the direct path may use it."""
    raw = conn.connection.dbapi_connection
    return raw if isinstance(raw, psycopg.Connection) else None


def _send_direct(conn: sa.Connection, raw: psycopg.Connection[Any], statement: sa.Executable,
                 call: PreparedCall[Any] | PreparedSignal) -> tuple[Any, ...] | None:
    """Send one of `call`'s statements on the psycopg connection itself; its first row."""
    clause = cast(sa.ClauseElement, statement)
    try:
        # Pipelined only when it opens the transaction: psycopg's BEGIN then rides in the same
        # write (no extra round trip); in a transaction already, a pipeline only adds overhead.
        rows = fetch_rows(raw, clause, call.params, schema=call.schema, prepare=None,
                          pipeline=_PIPELINE and raw.info.transaction_status
                          == TransactionStatus.IDLE)
        return rows[0] if rows else None
    except psycopg.Error as exc:
        if raw.broken or raw.closed:
            conn.invalidate(exc)
        if is_missing_schema_error(exc):
            migrated_schemas.discard(conn.engine, call.schema)
            raise schema_missing(call.schema) from None
        # The exception SQLAlchemy itself would raise (IntegrityError, OperationalError, ...).
        raise sa.exc.DBAPIError.instance(raw_sql(clause, call.schema), call.params, exc,
                                         psycopg.Error,
                                         dialect=conn.dialect) from exc


def _send(conn: sa.Connection, statement: sa.Executable,
          call: PreparedCall[Any] | PreparedSignal) -> sa.Row[Any] | None:
    """Send one of `call`'s statements through SQLAlchemy; its first row."""
    try:
        result = conn.execute(statement, call.params)
    except sa.exc.ProgrammingError as exc:
        raise translate_error(exc, conn.engine, call.schema) from None
    return result.first()


def execute(target: Target, call: PreparedCall[T] | PreparedSignal) -> T:
    """Run a prepared enqueue in `target`'s transaction (in a PRODUCER span when tracing:
    `flowq.tracing`, which stores its context with the job)."""
    if tracing.ENABLED and isinstance(call, PreparedCall):
        with tracing.publish(call.params) as publication:
            if publication is None:
                return _execute(target, call)
            result = _execute(target, replace(call, params=publication.params))
            publication.done(result)
            return result
    return _execute(target, call)


def _execute(target: Target, call: PreparedCall[T] | PreparedSignal) -> T:
    conn = _connection(target, call)
    if (conn.engine, call.schema) not in migrated_schemas:
        if conn.execute(queries(call.schema).check_schema).scalar() is None:
            raise schema_missing(call.schema)
        migrated_schemas.add(conn.engine, call.schema)
    raw = _own_psycopg(conn) if call.direct else None
    if raw is not None and not conn.in_transaction():
        # What SQLAlchemy's own execute would do (autobegin): without it, the caller's
        # `conn.commit()` would see no transaction and do nothing, and the job would be
        # rolled back when the connection goes back to the pool.
        conn.begin()
    statements = call.statements()
    statement = next(statements)
    while True:
        row = _send(conn, statement, call) if raw is None else _send_direct(
            conn, raw, statement, call)
        try:
            statement = statements.send(row)
        except StopIteration as done:
            return cast(T, done.value)


def enqueue(target: Target, task: Pipeline | str, /, *, idempotency_key: str | None = None,
            queue: str | None = None, priority: int | None = None,
            run_at: datetime | None = None, delay: float | timedelta | None = None,
            schema: str | None = None, unique: bool = False, unique_key: str | None = None,
            **args: Any) -> Enqueued:
    """Enqueue a run of `task` in the transaction of `target` (a Session or Connection).

    The job exists if and only if that transaction commits; workers are woken at commit.
    `task` is a task/pipeline object or its registered name. `idempotency_key` names the run:
    if a run with that key exists, it is returned with `created=False` and nothing is
    inserted. `unique=True` (the same task with the same arguments) or `unique_key` (the
    same task with that key): if such a run is active (a step pending, waiting or running),
    it is returned with `created=False`; once it has finished, a new one may start (with an
    `idempotency_key` too, that key is checked first). `run_at` (aware datetime) or `delay`
    (seconds or timedelta) schedule it later; `priority` orders within a queue (lower
    first, default 0); `schema` is the flowq schema (default: the task's app's, else
    "flowq"). Remaining keyword arguments are the handler's arguments and must be JSON.
    """
    call = prepare_enqueue(task, args, idempotency_key=idempotency_key, queue=queue,
                           priority=priority, run_at=run_at, delay=delay, schema=schema,
                           unique=unique, unique_key=unique_key)
    return execute(target, call)


def enqueue_many(target: Target, task: Pipeline | str, args_list: Iterable[Mapping[str, Any]],
                 /, *, queue: str | None = None, priority: int | None = None,
                 run_at: datetime | None = None, delay: float | timedelta | None = None,
                 schema: str | None = None) -> list[int]:
    """Enqueue one run of `task` per mapping in `args_list`, in one statement; their run ids.

    Same transaction semantics as `enqueue`, without idempotency keys. Every item is
    validated before anything is sent; the ids come back in the order of `args_list`.
    """
    call = prepare_enqueue_many(task, args_list, queue=queue, priority=priority, run_at=run_at,
                                delay=delay, schema=schema)
    return [] if call is None else execute(target, call)


def signal(target: Target, run_id: int, name: str, payload: Any = None, /, *,
           schema: str | None = None) -> Signalled:
    """Send signal `name` with `payload` (JSON) to run `run_id`, in the transaction of `target`
    (a Session or Connection): delivered if and only if it commits. See `flowq.workflows`.

    Raises RunNotFoundError for an unknown run, RunStateError for a finished or cancelled one,
    SignalError for a payload that is not JSON, a name no step of the run's pipeline waits
    for, or a second signal of that name with another payload (the same payload again is
    ignored: `created=False`).
    """
    return cast(Signalled, execute(target, prepare_signal(run_id, name, payload,
                                                          schema=schema)))


class SessionMixin:
    """Adds `.enqueue()`, `.enqueue_many()` and `.signal()` to a SQLAlchemy Session class."""

    def signal(self, run_id: int, name: str, payload: Any = None, /, *,
               schema: str | None = None) -> Signalled:
        """Send a signal to a run in this session's transaction; see `flowq.signal`."""
        return signal(cast(orm.Session, self), run_id, name, payload, schema=schema)

    def enqueue(self, task: Pipeline | str, /, **options_and_args: Any) -> Enqueued:
        """Enqueue `task` in this session's transaction; see `flowq.enqueue`."""
        return enqueue(cast(orm.Session, self), task, **options_and_args)

    def enqueue_many(self, task: Pipeline | str, args_list: Iterable[Mapping[str, Any]], /,
                     **options: Any) -> list[int]:
        """Enqueue many runs in one statement in this session's transaction."""
        return enqueue_many(cast(orm.Session, self), task, args_list, **options)


class Session(SessionMixin, orm.Session):
    """A SQLAlchemy Session with `enqueue()`: `sessionmaker(engine, class_=flowq.Session)`."""
