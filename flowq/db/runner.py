"""The one way flowq sends a statement: a `Runner`, on a psycopg or a SQLAlchemy connection.

A `Runner` is a callable `run(statement, params) -> Rows`. `Rows` is the list of the rows as
tuples (so a reader by position still works) with the statement's column names beside them,
which is what `flowq.db.store` reads rows by: no caller depends on a column order.

- `runner(conn)` makes one of any connection flowq is given: a psycopg 3 connection (sent
  directly, see below), a SQLAlchemy `Connection` or `Session` (sent directly on its psycopg
  connection when SQLAlchemy already holds a transaction there, through SQLAlchemy
  otherwise, so its transaction bookkeeping is never bypassed). Both run the same SQL.
- `fetch_rows(conn, statement, params)` is the direct path on psycopg, for the three places
  where SQLAlchemy's execute and row layers were measured as a large share of the cost: the
  worker's hot-path connections (claims, batched completions, heartbeats), the completion of
  a `ctx.session` handler on the session's own connection, and `enqueue` on the caller's
  connection. The SQL is the statement's own, compiled once per (statement, schema) by
  `raw_sql`.

Options of the direct path:
- `prepare=True` prepares server-side at once (the hot path runs a few statements millions of
  times); `None` leaves it to psycopg (prepared after a few executions). A connection made
  with `prepare_threshold=None` (behind PgBouncer in transaction mode, where a prepared
  statement would outlive the transaction on a server session another client gets next)
  prepares nothing, whatever `prepare` says.
- `pipeline=True` sends in pipeline mode. It does not save the round trip of psycopg's
  implicit BEGIN: psycopg 3.3 waits for BEGIN's reply before it writes the statement, even
  in pipeline mode (seen in libpq's protocol trace; docs/benchmarks.md, "Enqueue: round
  trips and bytes"), which is why no flowq statement uses it any more.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final, Protocol

import psycopg
import sqlalchemy as sa
from psycopg.rows import tuple_row
from sqlalchemy.dialects.postgresql import psycopg as sa_psycopg
from sqlalchemy.orm import Session

from flowq.db.schema import schema_map

__all__ = ["Rows", "Runner", "fetch_rows", "psycopg_runner", "raw_sql", "result_rows",
           "runner", "sqlalchemy_runner"]

_PSYCOPG: Final = sa_psycopg.dialect()  # type: ignore[no-untyped-call]
_compiled: dict[tuple[int, str | None], tuple[sa.ClauseElement, str]] = {}


class Rows(list[tuple[Any, ...]]):
    """A statement's rows as tuples, with its column names in `columns` (empty, and no
    columns, when the statement returns no rows)."""

    columns: tuple[str, ...]

    def __init__(self, columns: Iterable[str] = (), rows: Iterable[tuple[Any, ...]] = ()
                 ) -> None:
        super().__init__(rows)
        self.columns = tuple(columns)

    def dicts(self) -> list[dict[str, Any]]:
        """Each row as a dict keyed by column name."""
        return [dict(zip(self.columns, row, strict=True)) for row in self]


class Runner(Protocol):
    """Runs one of flowq's statements with its bind parameters; its rows, with their names."""

    def __call__(self, statement: sa.ClauseElement, params: Mapping[str, Any], /) -> Rows: ...


def raw_sql(statement: sa.ClauseElement, schema: str | None = None) -> str:
    """The psycopg (`%(name)s`) SQL of one of flowq's statements, compiled once, for sending
    on a psycopg connection directly; `schema` renders the tables of a Core statement in
    another schema (the named statements of `flowq.db.sql` already have theirs)."""
    key = (id(statement), schema)
    hit = _compiled.get(key)
    if hit is None or hit[0] is not statement:  # an id can be reused once a statement is gone
        smap = schema_map(schema) if schema is not None else None
        compiled = statement.compile(dialect=_PSYCOPG, schema_translate_map=smap,
                                     render_schema_translate=bool(smap))
        hit = _compiled[key] = (statement, compiled.string)
    return hit[1]


def fetch_rows(conn: psycopg.Connection[Any], statement: sa.ClauseElement,
               params: Mapping[str, Any], *, schema: str | None = None,
               prepare: bool | None = True, pipeline: bool = False) -> Rows:
    """Run one of flowq's statements on `conn`; its rows (empty when it returns none).
    psycopg's errors propagate: the caller knows what a failure means for it."""
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


def result_rows(cur: psycopg.Cursor[tuple[Any, ...]]) -> Rows:
    """The rows of `cur`'s last statement, with their names (empty when it returns none)."""
    try:
        # Not `cur.description` first: inside a caller's pipeline it is unknown until the
        # fetch itself syncs.
        rows = cur.fetchall()
    except psycopg.ProgrammingError as exc:
        if exc.sqlstate is None:  # "the last operation didn't produce a result"
            return Rows()
        raise
    return Rows((c.name for c in cur.description or ()), rows)


def psycopg_runner(conn: psycopg.Connection[Any], *, schema: str | None = None,
                   prepare: bool | None = True, pipeline: bool = False) -> Runner:
    """A runner sending directly on `conn` (see `fetch_rows` for the options)."""

    def run(statement: sa.ClauseElement, params: Mapping[str, Any], /) -> Rows:
        return fetch_rows(conn, statement, params, schema=schema, prepare=prepare,
                          pipeline=pipeline)

    return run


def sqlalchemy_runner(conn: sa.Connection) -> Runner:
    """A runner sending through SQLAlchemy's `execute` on `conn`, in its transaction."""

    def run(statement: sa.ClauseElement, params: Mapping[str, Any], /) -> Rows:
        if not isinstance(statement, sa.Executable):
            raise TypeError(f"not a statement: {statement!r}")
        result = conn.execute(statement, dict(params))
        if not result.returns_rows:
            return Rows()
        return Rows(result.keys(), (tuple(r) for r in result))

    return run


def runner(conn: psycopg.Connection[Any] | sa.Connection | Session, *,
           direct: bool = True) -> Runner:
    """The runner of any connection flowq is handed. A SQLAlchemy connection (a `Session`'s:
    its current one, which starts the session's transaction) whose transaction is already
    begun, on psycopg, is sent to directly (prepared, as on the hot path), unless `direct`
    is False; sending directly before SQLAlchemy began a transaction would open one behind
    its back, which its `commit()` would then not end."""
    if isinstance(conn, psycopg.Connection):
        return psycopg_runner(conn)
    if isinstance(conn, Session):
        conn = conn.connection()
    if direct and conn.in_transaction():
        raw = conn.connection.dbapi_connection
        if isinstance(raw, psycopg.Connection):
            return psycopg_runner(raw)
    return sqlalchemy_runner(conn)
