"""Sending flowq's named statements on a psycopg 3 connection directly, past SQLAlchemy.

The one way flowq does it, for the three paths where SQLAlchemy's execute and row layers
were measured as a large share of the cost: the worker's hot-path connections (claims,
batched completions, heartbeats), the completion of a `ctx.session` handler on the session's
own connection, and `enqueue` on the caller's connection. The SQL is the statement's own,
compiled once per (statement, schema) by `flowq.db.raw_sql`.

- `prepare=True` prepares server-side at once (the hot path runs a few statements millions of
  times); `None` leaves it to psycopg (prepared after a few executions). A connection made
  with `prepare_threshold=None` (behind PgBouncer in transaction mode, where a prepared
  statement would outlive the transaction on a server session another client gets next)
  prepares nothing, whatever `prepare` says.
- `pipeline=True` sends in pipeline mode, so that psycopg's implicit BEGIN travels in the same
  network write as the statement: worth it when the statement opens a transaction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg.rows import tuple_row

from flowq.db import raw_sql

__all__ = ["fetch_rows", "result_rows"]


def fetch_rows(conn: psycopg.Connection[Any], statement: sa.ClauseElement,
               params: Mapping[str, Any], *, schema: str | None = None,
               prepare: bool | None = True, pipeline: bool = False) -> list[tuple[Any, ...]]:
    """Run one of flowq's statements on `conn`; its rows as tuples (empty when it returns
    none). psycopg's errors propagate: the caller knows what a failure means for it."""
    cur = conn.cursor(row_factory=tuple_row)
    sql = raw_sql(statement, schema)
    if conn.prepare_threshold is None:
        prepare = False
    if pipeline:
        with conn.pipeline():
            cur.execute(sql, params, prepare=prepare)
    else:
        cur.execute(sql, params, prepare=prepare)
    return result_rows(cur)


def result_rows(cur: psycopg.Cursor[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The rows of `cur`'s last statement (empty when it returns none)."""
    try:
        # Not `cur.description` first: inside a caller's pipeline it is unknown until the
        # fetch itself syncs.
        return cur.fetchall()
    except psycopg.ProgrammingError as exc:
        if exc.sqlstate is None:  # "the last operation didn't produce a result"
            return []
        raise
