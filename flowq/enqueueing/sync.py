"""Transactional enqueue: a job is one INSERT in the caller's own transaction.

`enqueue(session_or_connection, task, /, **options_and_args)` runs one `INSERT … RETURNING`
through the caller's `Session` or `Connection`, so the job commits or rolls back with the
business rows beside it (savepoints included), and never exists otherwise. The same
statement calls `pg_notify(<schema>, <queue>)`; PostgreSQL delivers a notification only when
its transaction commits, so workers wake exactly for committed jobs. No job data travels in
the notification.

What is checked, and the statements, come from `flowq.enqueueing.prepare` (shared with the
async twin, `flowq.enqueueing.aio`): this module executes them, after checking once per engine
that flowq's schema exists. `Session` (for `sessionmaker(engine, class_=flowq.Session)`) and
`SessionMixin` add `.enqueue()`, `.enqueue_many()` and `.signal()`.

Speed: enqueue usually sits in a short business transaction, where one more round trip is most
of its cost. On a psycopg 3 connection the INSERT is sent directly on the session's own DBAPI
connection, prepared by psycopg from its 5th use on a connection (the statement text never
varies), and SQLAlchemy's execute layer (about 0.1 ms of Python per statement) is skipped. It
is not pipelined: psycopg waits for the reply to its implicit BEGIN even in pipeline mode, so
a pipeline saved no round trip and cost 45 bytes and some Python per enqueue (issue 21). The statement is the
same compiled SQL in the same transaction; SQLAlchemy's execute events and `echo` do not see
it. Other drivers, and `enqueue_many` (whose cost is its rows, not a round trip), take the
SQLAlchemy path.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, TypeVar, Union, cast

import psycopg
import sqlalchemy as sa
from sqlalchemy import orm

from flowq import tracing
from flowq.db.checks import is_missing_schema_error, schema_missing
from flowq.db.runner import fetch_rows, raw_sql
from flowq.db.store.enqueue import builder
from flowq.define.pipeline import Pipeline
from flowq.enqueueing.batch import Batch, batch, join_batch
from flowq.enqueueing.prepare import Enqueued, PreparedCall, prepare_enqueue, prepare_enqueue_many
from flowq.enqueueing.signals import PreparedSignal, Signalled, prepare_signal

__all__ = ["Enqueued", "Session", "SessionMixin", "Target", "enqueue", "enqueue_many",
           "execute", "migrated_schemas", "signal", "translate_error"]

T = TypeVar("T")
Target = Union[sa.Connection, orm.Session, "orm.scoped_session[Any]"]


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
        " (for an AsyncSession use flowq.enqueueing.aio.enqueue)"
    )


def _own_psycopg(conn: sa.Connection) -> psycopg.Connection[Any] | None:
    """The psycopg connection under `conn`, if the direct path may use it."""
    raw = conn.connection.dbapi_connection
    return raw if isinstance(raw, psycopg.Connection) else None


def _send_direct(conn: sa.Connection, raw: psycopg.Connection[Any], statement: sa.Executable,
                 call: PreparedCall[Any] | PreparedSignal) -> tuple[Any, ...] | None:
    """Send one of `call`'s statements on the psycopg connection itself; its first row."""
    clause = cast(sa.ClauseElement, statement)
    try:
        # Never pipelined: psycopg (3.1 on) syncs on its implicit BEGIN and waits for its
        # reply before sending the statement, so a pipeline saves no round trip and costs
        # bytes (BEGIN in the extended protocol, a Flush) and Python (measured: issue 21).
        rows = fetch_rows(raw, clause, call.params, schema=call.schema, prepare=None)
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
    `flowq.tracing`, which stores its context with the job); the runs it creates join the
    batch open on the session, if any (`flowq.enqueueing.batch`)."""
    if tracing.ENABLED and isinstance(call, PreparedCall):
        with tracing.publish(call.params) as publication:
            if publication is None:
                result = _execute(target, call)
            else:
                result = _execute(target, replace(call, params=publication.params))
                publication.done(result)
    else:
        result = _execute(target, call)
    if isinstance(call, PreparedCall):
        join_batch(target, call.schema, result)
    return result


def _execute(target: Target, call: PreparedCall[T] | PreparedSignal) -> T:
    conn = _connection(target, call)
    if (conn.engine, call.schema) not in migrated_schemas:
        verbs = builder(call.schema)
        check, params = verbs.check_schema_statement()
        if not verbs.schema_found(conn.execute(check, params).first()):
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
            deadline: datetime | float | timedelta | None = None,
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
    (seconds or timedelta) schedule it later; `deadline` (an aware datetime, or seconds or
    a timedelta from now; default: the task's) cancels the run's unfinished steps once it
    passes (`flowq.DeadlineExceeded`); `priority` orders within a queue (lower
    first, default 0); `schema` is the flowq schema (default: the task's app's, else
    "flowq"). Remaining keyword arguments are the handler's arguments and must be JSON.
    """
    call = prepare_enqueue(task, args, idempotency_key=idempotency_key, queue=queue,
                           priority=priority, run_at=run_at, delay=delay, deadline=deadline,
                           schema=schema, unique=unique, unique_key=unique_key)
    return execute(target, call)


def enqueue_many(target: Target, task: Pipeline | str, args_list: Iterable[Mapping[str, Any]],
                 /, *, queue: str | None = None, priority: int | None = None,
                 run_at: datetime | None = None, delay: float | timedelta | None = None,
                 deadline: datetime | float | timedelta | None = None,
                 schema: str | None = None) -> list[int]:
    """Enqueue one run of `task` per mapping in `args_list`, in one statement; their run ids.

    Same transaction semantics as `enqueue`, without idempotency keys. Every item is
    validated before anything is sent; the ids come back in the order of `args_list`.
    """
    call = prepare_enqueue_many(task, args_list, queue=queue, priority=priority, run_at=run_at,
                                delay=delay, deadline=deadline, schema=schema)
    return [] if call is None else execute(target, call)


def signal(target: Target, run_id: int, name: str, payload: Any = None, /, *,
           schema: str | None = None) -> Signalled:
    """Send signal `name` with `payload` (JSON) to run `run_id`, in the transaction of `target`
    (a Session or Connection): delivered if and only if it commits. See `flowq.define.workflows`.

    Raises RunNotFoundError for an unknown run, RunStateError for a finished or cancelled one,
    SignalError for a payload that is not JSON, a name no step of the run's pipeline waits
    for, or a second signal of that name with another payload (the same payload again is
    ignored: `created=False`).
    """
    return cast(Signalled, execute(target, prepare_signal(run_id, name, payload,
                                                          schema=schema)))


class SessionMixin:
    """Adds `.enqueue()`, `.enqueue_many()`, `.signal()` and `.batch()` to a SQLAlchemy
    Session class."""

    def batch(self, on_complete: Pipeline | str,
              **args: Any) -> contextlib.AbstractContextManager[Batch]:
        """`with session.batch(on_complete=task, **args) as batch:` enqueues `task` once every run
        enqueued in the block has finished, with `batch_id=batch.id` and the counts
        `succeeded`, `dead`, `cancelled` (see `flowq.enqueueing.batch`)."""
        return batch(cast(orm.Session, self), on_complete, **args)

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
