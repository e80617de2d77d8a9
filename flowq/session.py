"""Transactional enqueue: a job is one INSERT in the caller's own transaction.

`enqueue(session_or_connection, task, /, **options_and_args)` runs one `INSERT … RETURNING`
through the caller's `Session` or `Connection`, so the job commits or rolls back with the
business rows beside it (savepoints included), and never exists otherwise. The same
statement calls `pg_notify` with the queue name; PostgreSQL delivers a notification only when
its transaction commits, so workers wake exactly for committed jobs. No job data travels in
the notification.

Arguments are checked before any SQL is sent (JSON only; bound against the handler's
signature when the definition is known), so a bad call raises a `flowq` error and leaves the
caller's transaction usable. An `idempotency_key` names the run: a second enqueue with the
same key returns the existing run (`created=False`), whatever its arguments or state.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session as _SASession

from flowq.app import DEFAULT_QUEUE, Pipeline, find_definition, validate_queue
from flowq.db import is_missing_schema_error, schema_exists
from flowq.errors import (
    ConfigurationError,
    InvalidArgumentsError,
    SchemaMissingError,
    UnknownTaskError,
)
from flowq.jsonargs import JSONError, dumps_checked
from flowq.retry import DEFAULT_MAX_ATTEMPTS
from flowq.schema import DEFAULT_SCHEMA, jobs, notify_channel, schema_map

__all__ = ["Enqueued", "Session", "SessionMixin", "enqueue", "enqueue_many"]

_MAX_PRIORITY = 32767
_MAX_KEY_LENGTH = 1000


@dataclass(frozen=True)
class Enqueued:
    """What enqueue returns: the run's `id`, and `created=False` when an idempotency key matched."""

    id: int
    created: bool
    job_id: int


class _Executes(Protocol):
    def execute(self, statement: Any, parameters: Any = ..., *,
                execution_options: Any = ...) -> Any: ...


@dataclass(frozen=True)
class _Prepared:
    params: dict[str, Any]
    options: dict[str, Any]
    schema: str


def _timestamp_params(run_at: datetime | None, delay: float | timedelta | None) -> dict[str, Any]:
    if run_at is not None and delay is not None:
        raise InvalidArgumentsError("pass either run_at or delay, not both")
    if run_at is not None:
        if not isinstance(run_at, datetime) or run_at.tzinfo is None:
            raise InvalidArgumentsError(
                "run_at must be a timezone-aware datetime (e.g. datetime.now(timezone.utc))"
            )
    if delay is None:
        delay = timedelta(0)
    elif isinstance(delay, int | float) and not isinstance(delay, bool):
        delay = timedelta(seconds=delay)
    elif not isinstance(delay, timedelta):
        raise InvalidArgumentsError("delay must be seconds (a number) or a timedelta")
    return {"run_at": run_at, "delay": delay}


def _resolve(task: Pipeline | str, schema: str | None) -> tuple[str, Pipeline | None, str]:
    """(name, definition or None, schema) for what the caller passed as `task`."""
    if isinstance(task, Pipeline):
        return task.name, task, task.app.schema if schema is None else schema
    if isinstance(task, str):
        schema = DEFAULT_SCHEMA if schema is None else schema
        return task, find_definition(task, schema), schema
    raise UnknownTaskError(
        f"enqueue needs a task or pipeline (or its registered name), got {task!r}"
    )


def _prepare(task: Pipeline | str, *, queue: str | None, priority: int | None,
             run_at: datetime | None, delay: float | timedelta | None,
             schema: str | None) -> tuple[str, Pipeline | None, _Prepared]:
    name, definition, schema = _resolve(task, schema)
    if definition is not None:
        if not definition.steps:
            raise ConfigurationError(f"pipeline {name!r} has no steps: nothing to enqueue")
        first = definition.first
        step_name, max_attempts = first.name, first.retry.attempt_cap
        default_queue, default_priority = first.queue, definition.priority
    else:
        step_name, max_attempts = "", DEFAULT_MAX_ATTEMPTS
        default_queue, default_priority = DEFAULT_QUEUE, 0
    if priority is None:
        priority = default_priority
    if isinstance(priority, bool) or not isinstance(priority, int) or not (
            -_MAX_PRIORITY <= priority <= _MAX_PRIORITY):
        raise InvalidArgumentsError(
            f"priority must be an integer between {-_MAX_PRIORITY} and {_MAX_PRIORITY} "
            "(lower runs first)"
        )
    params: dict[str, Any] = {
        "task": name,
        "step": step_name,
        "queue": validate_queue(queue if queue is not None else default_queue),
        "priority": priority,
        "max_attempts": max_attempts,
        "channel": notify_channel(schema),
        **_timestamp_params(run_at, delay),
    }
    smap = schema_map(schema)
    options = {"schema_translate_map": smap} if smap else {}
    return name, definition, _Prepared(params, options, schema)


def _args_json(name: str, definition: Pipeline | None, args: Mapping[str, Any]) -> str:
    if definition is not None:
        definition.first.check_arguments(dict(args), what=f"arguments for {name!r}")
    try:
        return dumps_checked(dict(args), "args")
    except JSONError as exc:
        raise InvalidArgumentsError(f"cannot enqueue {name!r}: {exc}") from None


def _build_insert() -> sa.Select[Any]:
    due = sa.func.coalesce(sa.bindparam("run_at", type_=sa.DateTime(timezone=True)),
                           sa.func.now() + sa.bindparam("delay", type_=sa.Interval))
    ins = pg_insert(jobs).values(
        task=sa.bindparam("task"), step=sa.bindparam("step"), queue=sa.bindparam("queue"),
        priority=sa.bindparam("priority"), max_attempts=sa.bindparam("max_attempts"),
        args=sa.cast(sa.bindparam("args", type_=sa.Text), JSONB),
        idempotency_key=sa.bindparam("idempotency_key", type_=sa.Text), run_at=due,
    )
    # DO UPDATE (not DO NOTHING) so that a concurrent inserter of the same key is waited for
    # and the surviving row is returned either way; xmax = 0 tells a fresh insert apart.
    ins = ins.on_conflict_do_update(
        index_elements=[jobs.c.idempotency_key],
        index_where=jobs.c.idempotency_key.isnot(None),
        set_={"idempotency_key": ins.excluded.idempotency_key},
    ).returning(jobs.c.id, jobs.c.run_id, jobs.c.queue,
                sa.literal_column("xmax = 0", sa.Boolean).label("created"))
    inserted = ins.cte("inserted")
    return sa.select(inserted.c.id, inserted.c.run_id, inserted.c.created,
                     sa.func.pg_notify(sa.bindparam("channel"), inserted.c.queue))


def _build_insert_many() -> sa.Select[Any]:
    due = sa.func.coalesce(sa.bindparam("run_at", type_=sa.DateTime(timezone=True)),
                           sa.func.now() + sa.bindparam("delay", type_=sa.Interval))
    rows = sa.func.unnest(sa.cast(sa.bindparam("args", type_=ARRAY(sa.Text)), ARRAY(JSONB))
                          ).table_valued("value", with_ordinality="n").render_derived()
    source = sa.select(
        sa.bindparam("task", type_=sa.Text), sa.bindparam("step", type_=sa.Text),
        sa.bindparam("queue", type_=sa.Text), sa.bindparam("priority", type_=sa.SmallInteger),
        sa.bindparam("max_attempts", type_=sa.Integer), rows.c.value, due,
    ).order_by(rows.c.n)
    ins = pg_insert(jobs).from_select(
        ["task", "step", "queue", "priority", "max_attempts", "args", "run_at"], source
    ).returning(jobs.c.run_id)
    inserted = ins.cte("inserted")
    return sa.select(sa.func.array_agg(inserted.c.run_id),
                     sa.func.pg_notify(sa.bindparam("channel"), sa.bindparam("queue")))


_INSERT = _build_insert()
_INSERT_MANY = _build_insert_many()

# Engines (by identity) known to have the flowq schema: checked once, without ever raising
# inside the caller's transaction, so a missing schema never aborts it.
_checked: set[tuple[int, str]] = set()
_checked_lock = threading.Lock()


def _bind_of(target: _Executes) -> Any:
    get_bind = getattr(target, "get_bind", None)
    if get_bind is not None:
        return get_bind()
    return getattr(target, "engine", None)


def _engine_key(target: _Executes, schema: str) -> tuple[int, str]:
    bind = _bind_of(target)
    return (id(getattr(bind, "engine", bind)), schema)


def _check_schema(target: Any, schema: str) -> None:
    key = _engine_key(target, schema)
    if key in _checked:
        return
    conn = target if isinstance(target, sa.Connection) else target.connection()
    if not schema_exists(conn, schema):
        raise SchemaMissingError(
            f"the database has no flowq schema {schema!r}: run `flowq migrate` first."
        )
    with _checked_lock:
        _checked.add(key)


def _execute(target: _Executes, stmt: Any, params: Any, prepared: _Prepared) -> Any:
    _check_schema(target, prepared.schema)
    try:
        return target.execute(stmt, params, execution_options=prepared.options)
    except sa.exc.ProgrammingError as exc:
        if is_missing_schema_error(exc):
            _checked.discard(_engine_key(target, prepared.schema))
            raise SchemaMissingError(
                f"the database has no flowq schema {prepared.schema!r}: run `flowq migrate` "
                "first."
            ) from None
        raise


def enqueue(target: Any, task: Pipeline | str, /, *, idempotency_key: str | None = None,
            queue: str | None = None, priority: int | None = None,
            run_at: datetime | None = None, delay: float | timedelta | None = None,
            schema: str | None = None, **args: Any) -> Enqueued:
    """Enqueue a run of `task` in the transaction of `target` (a Session or Connection).

    The job exists if and only if that transaction commits; workers are woken at commit.
    `task` is a task/pipeline object or its registered name. `idempotency_key` names the run:
    if a run with that key exists, it is returned with `created=False` and nothing is
    inserted. `run_at` (aware datetime) or `delay` (seconds or timedelta) schedule it later;
    `priority` orders within a queue (lower first, default 0). Remaining keyword arguments
    are the handler's arguments and must be JSON.
    """
    name, definition, prepared = _prepare(task, queue=queue, priority=priority, run_at=run_at,
                                          delay=delay, schema=schema)
    if idempotency_key is not None and (
            not isinstance(idempotency_key, str) or not idempotency_key
            or len(idempotency_key) > _MAX_KEY_LENGTH):
        raise InvalidArgumentsError(
            f"idempotency_key must be a non-empty string of at most {_MAX_KEY_LENGTH} characters"
        )
    if idempotency_key is not None:
        dumps_checked(idempotency_key, "idempotency_key")
    params = {**prepared.params, "args": _args_json(name, definition, args),
              "idempotency_key": idempotency_key}
    row = _execute(target, _INSERT, params, prepared).one()
    return Enqueued(id=row.run_id, created=bool(row.created), job_id=row.id)


def enqueue_many(target: Any, task: Pipeline | str, args_list: Iterable[Mapping[str, Any]],
                 /, *, queue: str | None = None, priority: int | None = None,
                 run_at: datetime | None = None, delay: float | timedelta | None = None,
                 schema: str | None = None) -> list[int]:
    """Enqueue one run of `task` per mapping in `args_list`, in one statement; their run ids.

    Same transaction semantics as `enqueue`; every item is validated before anything is sent.
    """
    name, definition, prepared = _prepare(task, queue=queue, priority=priority, run_at=run_at,
                                          delay=delay, schema=schema)
    encoded: list[str] = []
    for i, item in enumerate(args_list):
        if not isinstance(item, Mapping):
            raise InvalidArgumentsError(f"item {i} of enqueue_many is not a mapping of arguments")
        try:
            encoded.append(_args_json(name, definition, item))
        except InvalidArgumentsError as exc:
            raise InvalidArgumentsError(f"item {i}: {exc}") from None
    if not encoded:
        return []
    params = {**prepared.params, "args": encoded}
    ids = _execute(target, _INSERT_MANY, params, prepared).scalar_one()
    return list(ids)


class SessionMixin:
    """Adds `.enqueue()` and `.enqueue_many()` to a SQLAlchemy Session class."""

    def enqueue(self, task: Pipeline | str, /, **options_and_args: Any) -> Enqueued:
        """Enqueue `task` in this session's transaction; see `flowq.enqueue`."""
        return enqueue(self, task, **options_and_args)

    def enqueue_many(self, task: Pipeline | str, args_list: Iterable[Mapping[str, Any]], /,
                     **options: Any) -> list[int]:
        """Enqueue many runs in one statement in this session's transaction."""
        return enqueue_many(self, task, args_list, **options)


class Session(SessionMixin, _SASession):
    """A SQLAlchemy Session with `enqueue()`: `sessionmaker(engine, class_=flowq.Session)`."""
