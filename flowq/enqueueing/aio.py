"""Transactional enqueue for asyncio: `await enqueue(async_session_or_connection, task, ...)`.

The async twin of `flowq.enqueueing.sync`, with the same statements, validation and guarantees:
the job is one INSERT in the caller's `AsyncSession`/`AsyncConnection` transaction, and exists
only if it commits. Only the execution differs: the preparation, and the sequence of
statements a keyed enqueue may need (`PreparedCall.statements`), are `flowq.enqueueing.prepare`'s.

This module is not imported by `flowq` itself: SQLAlchemy 2.1 no longer depends on greenlet,
which its asyncio extension needs (`pip install 'flowq[asyncio]'`). Use a psycopg URL with
`create_async_engine("postgresql+psycopg://...")`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, async_scoped_session
from sqlalchemy.ext.asyncio import AsyncSession as _SAAsyncSession

from flowq import tracing
from flowq.db.checks import schema_missing
from flowq.db.store.enqueue import builder
from flowq.define.pipeline import Pipeline
from flowq.enqueueing.batch import Batch, abatch, join_batch
from flowq.enqueueing.prepare import Enqueued, PreparedCall, prepare_enqueue, prepare_enqueue_many
from flowq.enqueueing.signals import PreparedSignal, Signalled, prepare_signal
from flowq.enqueueing.sync import migrated_schemas, translate_error

__all__ = ["AsyncSession", "AsyncSessionMixin", "Enqueued", "enqueue", "enqueue_many",
           "signal"]

T = TypeVar("T")
AsyncTarget = _SAAsyncSession | AsyncConnection | async_scoped_session[Any]


async def _connection(target: AsyncTarget, call: PreparedCall[Any] | PreparedSignal) -> AsyncConnection:
    if isinstance(target, AsyncConnection):
        return target
    if isinstance(target, _SAAsyncSession | async_scoped_session):
        return await target.connection(bind_arguments={"clause": call.statement})
    raise TypeError(
        f"flowq.enqueueing.aio.enqueue needs an AsyncSession or AsyncConnection, got "
        f"{type(target).__name__} (for a sync Session use flowq.enqueue)"
    )


async def execute(target: AsyncTarget, call: PreparedCall[T] | PreparedSignal) -> T:
    """Run a prepared enqueue in `target`'s transaction (see `flowq.enqueueing.sync.execute`)."""
    if tracing.ENABLED and isinstance(call, PreparedCall):
        with tracing.publish(call.params) as publication:  # current in this task only
            if publication is None:
                result = await _execute(target, call)
            else:
                result = await _execute(target, replace(call, params=publication.params))
                publication.done(result)
            join_batch(target, call.schema, result)
            return result
    result = await _execute(target, call)
    if isinstance(call, PreparedCall):
        join_batch(target, call.schema, result)
    return result


async def _execute(target: AsyncTarget, call: PreparedCall[T] | PreparedSignal) -> T:
    conn = await _connection(target, call)
    engine = conn.sync_engine
    if (engine, call.schema) not in migrated_schemas:
        verbs = builder(call.schema)
        check, params = verbs.check_schema_statement()
        if not verbs.schema_found((await conn.execute(check, params)).first()):
            raise schema_missing(call.schema)
        migrated_schemas.add(engine, call.schema)
    statements = call.statements()  # the same statements, in the same order, as the sync path
    statement = next(statements)
    while True:
        try:
            result = await conn.execute(statement, call.params)
        except sa.exc.ProgrammingError as exc:
            raise translate_error(exc, engine, call.schema) from None
        try:
            statement = statements.send(result.first())
        except StopIteration as done:
            return cast(T, done.value)


async def enqueue(target: AsyncTarget, task: Pipeline | str, /, *,
                  idempotency_key: str | None = None, queue: str | None = None,
                  priority: int | None = None, run_at: datetime | None = None,
                  delay: float | timedelta | None = None,
                  deadline: datetime | float | timedelta | None = None, schema: str | None = None,
                  unique: bool = False, unique_key: str | None = None,
                  **args: Any) -> Enqueued:
    """Enqueue a run of `task` in the transaction of an AsyncSession or AsyncConnection.

    Same options (`unique` and `unique_key` included), validation and result as
    `flowq.enqueue`.
    """
    call = prepare_enqueue(task, args, idempotency_key=idempotency_key, queue=queue,
                           priority=priority, run_at=run_at, delay=delay, deadline=deadline,
                           schema=schema, unique=unique, unique_key=unique_key)
    return await execute(target, call)


async def enqueue_many(target: AsyncTarget, task: Pipeline | str,
                       args_list: Iterable[Mapping[str, Any]], /, *, queue: str | None = None,
                       priority: int | None = None, run_at: datetime | None = None,
                       delay: float | timedelta | None = None,
                       deadline: datetime | float | timedelta | None = None,
                       schema: str | None = None) -> list[int]:
    """Enqueue one run per mapping in `args_list` in one statement; their ids, in order."""
    call = prepare_enqueue_many(task, args_list, queue=queue, priority=priority, run_at=run_at,
                                delay=delay, deadline=deadline, schema=schema)
    return [] if call is None else await execute(target, call)


async def signal(target: AsyncTarget, run_id: int, name: str, payload: Any = None, /, *,
                 schema: str | None = None) -> Signalled:
    """Send a signal in the transaction of an AsyncSession or AsyncConnection; see
    `flowq.signal`."""
    return cast(Signalled, await execute(target, prepare_signal(run_id, name, payload,
                                                                schema=schema)))


class AsyncSessionMixin:
    """Adds `await session.enqueue()`, `enqueue_many()`, `signal()` and `async with
    session.batch()` to an AsyncSession."""

    def batch(self, on_complete: Pipeline | str,
              **args: Any) -> contextlib.AbstractAsyncContextManager[Batch]:
        """`async with session.batch(on_complete=task, **args) as batch:`; see `flowq.enqueueing.batch`."""
        return abatch(cast(_SAAsyncSession, self), on_complete, **args)

    async def signal(self, run_id: int, name: str, payload: Any = None, /, *,
                     schema: str | None = None) -> Signalled:
        """Send a signal to a run in this session's transaction; see `flowq.enqueueing.aio.signal`."""
        return await signal(cast(_SAAsyncSession, self), run_id, name, payload, schema=schema)

    async def enqueue(self, task: Pipeline | str, /, **options_and_args: Any) -> Enqueued:
        """Enqueue `task` in this session's transaction; see `flowq.enqueueing.aio.enqueue`."""
        return await enqueue(cast(_SAAsyncSession, self), task, **options_and_args)

    async def enqueue_many(self, task: Pipeline | str, args_list: Iterable[Mapping[str, Any]],
                           /, **options: Any) -> list[int]:
        """Enqueue many runs in one statement in this session's transaction."""
        return await enqueue_many(cast(_SAAsyncSession, self), task, args_list, **options)


class AsyncSession(AsyncSessionMixin, _SAAsyncSession):
    """An AsyncSession with `enqueue()`: `async_sessionmaker(engine, class_=AsyncSession)`."""
