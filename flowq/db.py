"""Database plumbing shared by the CLI, the worker and enqueue: URLs, engines, schema checks.

URLs come from `--database-url`, else `FLOWQ_DATABASE_URL`, else `DATABASE_URL`. A bare
`postgresql://` (or `postgres://`) means psycopg 3. Errors are turned into one sentence that
says what to do: an unreachable server, or a database without flowq's schema.
"""

from __future__ import annotations

import os
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import psycopg as sa_psycopg
from sqlalchemy.engine import URL, make_url

from flowq.errors import DatabaseUnavailableError, FlowqError, SchemaMissingError
from flowq.schema import DEFAULT_SCHEMA, schema_map, validate_schema_name

__all__ = [
    "create_engine",
    "describe_url",
    "ensure_schema",
    "normalize_url",
    "raw_sql",
    "resolve_url",
    "schema_exists",
]

URL_ENV_VARS = ("FLOWQ_DATABASE_URL", "DATABASE_URL")

_PSYCOPG: Final = sa_psycopg.dialect()  # type: ignore[no-untyped-call]
_compiled: dict[tuple[int, str | None], tuple[sa.ClauseElement, str]] = {}


def raw_sql(statement: sa.ClauseElement, schema: str | None = None) -> str:
    """The psycopg (`%(name)s`) SQL of one of flowq's module-level statements, compiled once,
    for sending on a psycopg connection directly; `schema` renders flowq's tables in another
    schema (the named statements of `flowq.queries` already have theirs)."""
    key = (id(statement), schema)
    hit = _compiled.get(key)
    if hit is None or hit[0] is not statement:  # an id can be reused once a statement is gone
        smap = schema_map(schema) if schema is not None else None
        compiled = statement.compile(dialect=_PSYCOPG, schema_translate_map=smap,
                                     render_schema_translate=bool(smap))
        hit = _compiled[key] = (statement, compiled.string)
    return hit[1]


def normalize_url(url: str | URL) -> URL:
    """Parse `url`, mapping bare postgresql:// and postgres:// to the psycopg 3 driver."""
    try:
        u = make_url(url) if isinstance(url, str) else url
    except Exception as exc:
        raise FlowqError(f"not a database URL: {url!r} ({exc})") from None
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    if not u.drivername.startswith("postgresql"):
        raise FlowqError(f"flowq needs PostgreSQL, not {u.drivername!r}: pass a postgresql:// URL")
    return u


def resolve_url(explicit: str | None) -> str | None:
    """The URL to use: the explicit one, else the environment's, else None."""
    if explicit:
        return explicit
    for var in URL_ENV_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return None


def describe_url(url: str | URL) -> str:
    """The URL with its password hidden, for logs and messages."""
    try:
        return normalize_url(url).render_as_string(hide_password=True)
    except FlowqError:
        return "<invalid URL>"


def create_engine(url: str | URL, **kwargs: Any) -> sa.Engine:
    """A SQLAlchemy engine on psycopg 3, with pre-ping so a restarted server is survived."""
    kwargs.setdefault("pool_pre_ping", True)
    return sa.create_engine(normalize_url(url), **kwargs)


def schema_exists(conn: sa.Connection, schema: str = DEFAULT_SCHEMA) -> bool:
    """True when `schema`.jobs exists; never raises for a missing schema."""
    validate_schema_name(schema)
    found = conn.execute(sa.text("SELECT to_regclass(:name)"), {"name": f"{schema}.jobs"})
    return found.scalar() is not None


def ensure_schema(engine: sa.Engine, schema: str = DEFAULT_SCHEMA) -> None:
    """Raise a one-sentence flowq error if the database is unreachable or not migrated."""
    try:
        with engine.connect() as conn:
            present = schema_exists(conn, schema)
    except sa.exc.OperationalError as exc:
        raise DatabaseUnavailableError(
            f"cannot connect to {describe_url(engine.url)}: {_first_line(exc.orig)}. "
            "Check the URL (--database-url or FLOWQ_DATABASE_URL) and that PostgreSQL is running."
        ) from None
    if not present:
        raise SchemaMissingError(
            f"the database at {describe_url(engine.url)} has no flowq schema {schema!r}: "
            "run `flowq migrate` first."
        )


def _first_line(exc: object) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def is_missing_schema_error(exc: BaseException) -> bool:
    """True when a DBAPI error means flowq's tables or schema do not exist."""
    orig = getattr(exc, "orig", exc)
    sqlstate = getattr(orig, "sqlstate", None)
    return sqlstate in ("42P01", "3F000")  # undefined_table, invalid_schema_name
