"""Whether a database is ready for flowq: reachable, holding flowq's schema, at its revision.

Each failure is one sentence that says what to do (`DatabaseUnavailableError`: check the URL
and the server; `SchemaMissingError`: run `flowq migrate`, with `--schema` when it is not the
default), and carries no password (`flowq.db.urls.mask_secrets`).

The revision check (`ensure_schema(..., current=True)`, a worker starting): a schema behind
this flowq is refused (its statements would fail one by one: run `flowq migrate`); a schema at
a revision this flowq does not ship is a newer flowq's, accepted with one warning, because
migrations only expand (docs/operations.md, "Rolling releases and migrations"): the previous
release keeps working while a release rolls out, or after the code is rolled back.
"""

from __future__ import annotations

import logging

import sqlalchemy as sa
from sqlalchemy.engine import URL

from flowq.db.migrations import HEAD_REVISION, current_revision, is_known_revision
from flowq.db.sql import queries
from flowq.db.urls import describe_url, mask_secrets
from flowq.errors import DatabaseUnavailableError, SchemaMissingError
from flowq.names import DEFAULT_SCHEMA
from flowq.storable import first_line

__all__ = ["ensure_schema", "is_missing_schema_error", "schema_exists", "schema_missing"]

logger = logging.getLogger(__name__)


def schema_exists(conn: sa.Connection, schema: str = DEFAULT_SCHEMA) -> bool:
    """True when `schema`.jobs exists; never raises for a missing schema."""
    return conn.execute(queries(schema).check_schema).scalar() is not None


def ensure_schema(engine: sa.Engine, schema: str = DEFAULT_SCHEMA, *,
                  current: bool = False) -> None:
    """Raise a one-sentence flowq error if the database is unreachable or not migrated; with
    `current`, also if its flowq schema is behind the revision this flowq needs (a worker
    must not start on it: its statements would fail one by one). A schema at a revision this
    flowq does not know (a newer flowq's) passes with one warning logged."""
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
    if not current or revision == HEAD_REVISION:
        return
    if revision is not None and not is_known_revision(revision):
        # Text from the database: shown quoted and cut short, never trusted as an id.
        logger.warning(
            "the flowq schema %r is at revision %r, newer than this flowq's %s: fine while a "
            "release rolls out, since migrations only expand; upgrade this worker",
            schema, revision[:64], HEAD_REVISION)
        return
    command = "flowq migrate" + (f" --schema {schema}" if schema != DEFAULT_SCHEMA else "")
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
