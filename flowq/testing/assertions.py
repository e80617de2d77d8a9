"""Assertions on enqueued jobs: `assert_enqueued`, `refute_enqueued`, `all_enqueued`, and their
asyncio twins `aassert_enqueued`, `arefute_enqueued`, `aall_enqueued`.

`target` is where to look, and decides what is visible: a Session or Connection (an
AsyncSession or AsyncConnection for the twins) is queried through itself, so it sees the jobs
of its own uncommitted transaction; an Engine sees what is committed. "Enqueued" means
pending: a job that ran, or is running, is no longer enqueued.

Arguments match when every one given equals the stored one after a JSON round trip (a tuple
matches the list it was stored as); arguments not given are not compared. `schema` defaults to
the task's app's schema, else "flowq".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Union

import sqlalchemy as sa
from sqlalchemy import orm

from flowq.db.store.enqueue import builder
from flowq.define.pipeline import Pipeline
from flowq.names import DEFAULT_SCHEMA

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

__all__ = ["aall_enqueued", "aassert_enqueued", "all_enqueued", "arefute_enqueued",
           "assert_enqueued", "refute_enqueued"]

Target = Union[sa.Engine, sa.Connection, orm.Session, "orm.scoped_session[Any]"]
AsyncTarget = Union["AsyncEngine", "AsyncConnection", "AsyncSession"]

# How many pending jobs a failed assertion lists, to show what was enqueued instead.
SHOWN_JOBS: Final = 10


def _resolve(task: Pipeline | str | None, schema: str | None) -> tuple[str | None, str]:
    if isinstance(task, Pipeline):
        return task.name, task.app.schema if schema is None else schema
    return task, DEFAULT_SCHEMA if schema is None else schema


def _rows(target: Target, name: str | None, queue: str | None,
          schema: str) -> list[sa.Row[Any]]:
    statement, params = builder(schema).pending_jobs_statement(name, queue)
    if isinstance(target, sa.Engine):
        with target.connect() as conn:
            return list(conn.execute(statement, params))
    if isinstance(target, sa.Connection | orm.Session | orm.scoped_session):
        # Through the caller's own transaction (a Session flushes first), so that jobs it
        # enqueued and has not committed are seen.
        return list(target.execute(statement, params))
    raise TypeError(f"flowq.testing needs an Engine, Session or Connection, got "
                    f"{type(target).__name__} (for asyncio use the a-prefixed twins)")


async def _arows(target: AsyncTarget, name: str | None, queue: str | None,
                 schema: str) -> list[sa.Row[Any]]:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

    statement, params = builder(schema).pending_jobs_statement(name, queue)
    if isinstance(target, AsyncEngine):
        async with target.connect() as conn:
            return list(await conn.execute(statement, params))
    if isinstance(target, AsyncConnection | AsyncSession):
        return list(await target.execute(statement, params))
    raise TypeError(f"flowq.testing's a-prefixed assertions need an AsyncEngine, AsyncSession "
                    f"or AsyncConnection, got {type(target).__name__}")


def _normal(value: Any) -> Any:
    """`value` as it comes back from jsonb (tuples become lists)."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return value  # not JSON: it can only fail to match, which is the right answer


def _matching(rows: Sequence[sa.Row[Any]], args: Mapping[str, Any]) -> list[sa.Row[Any]]:
    wanted = {k: _normal(v) for k, v in args.items()}
    return [r for r in rows
            if all(k in r.args and r.args[k] == v for k, v in wanted.items())]


def _describe(name: str | None, args: Mapping[str, Any]) -> str:
    what = f"of {name!r}" if name is not None else "of any task"
    return f"{what} with arguments {dict(args)!r}" if args else what


def _found(name: str | None, args: Mapping[str, Any], rows: Sequence[sa.Row[Any]]) -> sa.Row[Any]:
    matching = _matching(rows, args)
    if not matching:
        shown = [dict(r.args) for r in rows[:SHOWN_JOBS]]
        more = f" (and {len(rows) - SHOWN_JOBS} more)" if len(rows) > SHOWN_JOBS else ""
        raise AssertionError(f"no pending job {_describe(name, args)}; pending jobs "
                             f"{_describe(name, {})}: {shown}{more}")
    return matching[0]


def _absent(name: str | None, args: Mapping[str, Any], rows: Sequence[sa.Row[Any]]) -> None:
    matching = _matching(rows, args)
    if matching:
        row = matching[0]
        raise AssertionError(f"unexpected pending job {_describe(name, args)}: job {row.id} "
                             f"(run {row.run_id}) with arguments {dict(row.args)!r}")


def assert_enqueued(target: Target, task: Pipeline | str, schema: str | None = None,
                    **args: Any) -> sa.Row[Any]:
    """The oldest pending job of `task` whose arguments include `args`; AssertionError (listing
    what is pending instead) if there is none."""
    name, schema = _resolve(task, schema)
    return _found(name, args, _rows(target, name, None, schema))


def refute_enqueued(target: Target, task: Pipeline | str, schema: str | None = None,
                    **args: Any) -> None:
    """AssertionError if a pending job of `task` has arguments that include `args`."""
    name, schema = _resolve(task, schema)
    _absent(name, args, _rows(target, name, None, schema))


def all_enqueued(target: Target, task: Pipeline | str | None = None, queue: str | None = None,
                 *, schema: str | None = None) -> list[sa.Row[Any]]:
    """Every pending job (of `task`, of `queue`, when given), oldest first."""
    name, schema = _resolve(task, schema)
    return _rows(target, name, queue, schema)


async def aassert_enqueued(target: AsyncTarget, task: Pipeline | str,
                           schema: str | None = None, **args: Any) -> sa.Row[Any]:
    """`assert_enqueued` through an AsyncSession, AsyncConnection or AsyncEngine."""
    name, schema = _resolve(task, schema)
    return _found(name, args, await _arows(target, name, None, schema))


async def arefute_enqueued(target: AsyncTarget, task: Pipeline | str,
                           schema: str | None = None, **args: Any) -> None:
    """`refute_enqueued` through an AsyncSession, AsyncConnection or AsyncEngine."""
    name, schema = _resolve(task, schema)
    _absent(name, args, await _arows(target, name, None, schema))


async def aall_enqueued(target: AsyncTarget, task: Pipeline | str | None = None,
                        queue: str | None = None, *,
                        schema: str | None = None) -> list[sa.Row[Any]]:
    """`all_enqueued` through an AsyncSession, AsyncConnection or AsyncEngine."""
    name, schema = _resolve(task, schema)
    return await _arows(target, name, queue, schema)
