"""Database plumbing shared by the CLI, the worker and enqueue: URLs, engines, schema checks.

URLs come from `--database-url`, else `FLOWQ_DATABASE_URL`, else `DATABASE_URL` (`flowq demo`
and `flowq bench` take only the option). Any PostgreSQL URL works: `postgresql://`,
`postgres://` and every `+driver` variant mean psycopg 3. Errors are turned into one sentence
that says what to do: an unreachable server, or a database without flowq's schema.

No message flowq prints or raises carries a password: `mask_secrets` hides them in any text
(URLs, malformed ones included, libpq `password=` settings, `?password=` parameters), and
`normalize_url`, `describe_url`, `ensure_schema` and the CLI's error handler go through it.
"""

from __future__ import annotations

import os
import re
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import psycopg as sa_psycopg
from sqlalchemy.engine import URL, make_url

from flowq.errors import DatabaseUnavailableError, FlowqError, SchemaMissingError
from flowq.migrations import HEAD_REVISION, current_revision
from flowq.names import DEFAULT_SCHEMA
from flowq.queries import queries
from flowq.schema import schema_map
from flowq.storable import first_line

__all__ = [
    "PGBOUNCER_CONNECT_ARGS",
    "create_engine",
    "describe_url",
    "ensure_schema",
    "mask_secrets",
    "normalize_url",
    "raw_sql",
    "resolve_url",
    "schema_exists",
    "schema_missing",
]

URL_ENV_VARS = ("FLOWQ_DATABASE_URL", "DATABASE_URL")

MASK: Final = "***"  # what SQLAlchemy's render_as_string(hide_password=True) shows

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


# `scheme://user:` and the password up to the last '@' of its whitespace-free run: printed
# URLs are the malformed ones, whose password may hold '@', ':' or '/', so the mask errs
# towards hiding a host too.
_URL_PASSWORD: Final = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#]*:)\S*@")
# The same with a password holding spaces: up to the next '@' of the line.
_URL_PASSWORD_SPACES: Final = re.compile(
    r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#]*:)(?!\*\*\*@)(?:(?!://)[^@\n])*@")
_QUERY_PASSWORD: Final = re.compile(r"([?&;](?:ssl)?password=)[^&#\s]*", re.IGNORECASE)
# libpq key/value conninfo (`password=secret`, `password = 'se cret'`) and PGPASSWORD=;
# a value already masked is left alone, or masking twice would eat a closing `"`.
_KEYWORD_PASSWORD: Final = re.compile(
    r"(?<![?&;\w])((?:ssl|pg)?password\s*=\s*)(?!\*\*\*(?:[\s\"]|$))"
    r"(?:'(?:[^'\\]|\\.)*'?|(?:[^\s'\\]|\\.)+)",
    re.IGNORECASE)
# A mapping's repr or JSON: 'password': 'secret'.
_MAPPING_PASSWORD: Final = re.compile(
    r"""(['"](?:ssl|pg)?password['"]\s*:\s*)(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\s,}]+)""",
    re.IGNORECASE)
# The user-info part exactly as SQLAlchemy's URL parser takes it (`make_url`).
_SA_USERINFO: Final = re.compile(r"[\w+]+://(?:[^:/]*(?::[^@]*)?@)?")


def mask_secrets(text: str) -> str:
    """`text` with every password in it replaced by `***`: in URLs (malformed ones too), in
    libpq key/value settings (`password=...`) and in `?password=` query parameters."""
    text = _URL_PASSWORD.sub(rf"\1{MASK}@", text)
    text = _URL_PASSWORD_SPACES.sub(rf"\1{MASK}@", text)
    text = _QUERY_PASSWORD.sub(rf"\1{MASK}", text)
    text = _KEYWORD_PASSWORD.sub(rf"\1{MASK}", text)
    return _MAPPING_PASSWORD.sub(rf"\1{MASK}", text)


def normalize_url(url: str | URL) -> URL:
    """Parse `url`, mapping every PostgreSQL driver (`postgresql://`, `postgres://`,
    `+asyncpg`, `+psycopg2`, ...) to psycopg 3. A URL that is not one raises a FlowqError
    whose message shows it with its password hidden."""
    if isinstance(url, URL):
        u = url
    else:
        shown = mask_secrets(repr(url))
        userinfo = _SA_USERINFO.match(url)
        if userinfo and "@" in url[userinfo.end():].split("?", 1)[0]:
            # A second '@' (in a password, usually): the parser would take what follows the
            # first one for the host, and connection errors would print it.
            raise FlowqError(f"not a database URL: {shown} (write an '@' in a user name, "
                             "password or database name as %40)")
        try:
            u = make_url(url)
        except Exception as exc:
            # Safe to quote now: the password was split off where the user meant it to end.
            raise FlowqError(f"not a database URL: {shown} ({mask_secrets(str(exc))})"
                             ) from None
    driver = u.drivername.partition("+")[0]
    if driver not in ("postgresql", "postgres"):
        raise FlowqError(f"flowq needs PostgreSQL, not {u.drivername!r}: pass a postgresql:// URL")
    if u.drivername != "postgresql+psycopg":
        u = u.set(drivername="postgresql+psycopg")
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
        return mask_secrets(normalize_url(url).render_as_string(hide_password=True))
    except FlowqError:
        return "<invalid URL>"


# What a psycopg connection through PgBouncer in transaction pooling mode needs: no
# server-side prepared statements, which psycopg otherwise makes of a statement run 5 times
# on a connection (they would stay on a server session that other clients get next).
PGBOUNCER_CONNECT_ARGS: Final = {"prepare_threshold": None}


def create_engine(url: str | URL, *, pgbouncer: bool = False, **kwargs: Any) -> sa.Engine:
    """A SQLAlchemy engine on psycopg 3, with pre-ping so a restarted server is survived;
    with `pgbouncer`, safe through PgBouncer in transaction mode (`PGBOUNCER_CONNECT_ARGS`)."""
    kwargs.setdefault("pool_pre_ping", True)
    if pgbouncer:
        kwargs["connect_args"] = {**kwargs.get("connect_args", {}), **PGBOUNCER_CONNECT_ARGS}
    return sa.create_engine(normalize_url(url), **kwargs)


def schema_exists(conn: sa.Connection, schema: str = DEFAULT_SCHEMA) -> bool:
    """True when `schema`.jobs exists; never raises for a missing schema."""
    return conn.execute(queries(schema).check_schema).scalar() is not None


def ensure_schema(engine: sa.Engine, schema: str = DEFAULT_SCHEMA, *,
                  current: bool = False) -> None:
    """Raise a one-sentence flowq error if the database is unreachable or not migrated; with
    `current`, also if its flowq schema is behind the revision this flowq needs (a worker
    must not start on it: its statements would fail one by one)."""
    revision: str | None = None
    try:
        with engine.connect() as conn:
            present = schema_exists(conn, schema)
            if present and current:
                revision = current_revision(conn, schema)
    except sa.exc.OperationalError as exc:
        raise DatabaseUnavailableError(mask_secrets(
            f"cannot connect to {describe_url(engine.url)}: {first_line(exc.orig)}. "
            "Check the URL (--database-url or FLOWQ_DATABASE_URL) and that PostgreSQL is running."
        )) from None
    if not present:
        raise schema_missing(schema, engine.url)
    if current and revision != HEAD_REVISION:
        command = "flowq migrate" + (f" --schema {schema}" if schema != DEFAULT_SCHEMA
                                     else "")
        raise SchemaMissingError(
            f"the flowq schema {schema!r} at {describe_url(engine.url)} is at revision "
            f"{revision}, and this flowq needs {HEAD_REVISION}: run `{command}` first.")


def schema_missing(schema: str, url: str | URL | None = None) -> SchemaMissingError:
    """The error for a database without flowq's tables in `schema`: it says how to migrate
    it, with `--schema` when that is not the default. With `url` (the CLI, a worker starting)
    it names the database; without (an enqueue) it also gives the Python call."""
    command = "flowq migrate" + (f" --schema {schema}" if schema != DEFAULT_SCHEMA else "")
    if url is not None:
        return SchemaMissingError(f"the database at {describe_url(url)} has no flowq schema "
                                  f"{schema!r}: run `{command}` first.")
    call = "flowq.migrate(engine" + (f", schema={schema!r})" if schema != DEFAULT_SCHEMA
                                     else ")")
    return SchemaMissingError(f"the database has no flowq schema {schema!r}: run `{command}` "
                              f"first (or {call}).")



def is_missing_schema_error(exc: BaseException) -> bool:
    """True when a DBAPI error means flowq's tables or schema do not exist."""
    orig = getattr(exc, "orig", exc)
    sqlstate = getattr(orig, "sqlstate", None)
    return sqlstate in ("42P01", "3F000")  # undefined_table, invalid_schema_name
