"""Applying flowq's alembic migrations with flowq's own version table.

The revisions live in the top-level `alembic/` of the repository and ship inside the wheel as
`flowq/_migrations`. They are applied with a version table in the flowq schema
(`flowq.alembic_version`), so flowq's history never collides with the application's own
`alembic_version`. Concurrent `migrate` calls (several workers starting at once) are
serialised by an advisory lock, taken here and again in `env.py`.

The schema: `migrate` creates it when it does not exist and marks it so with a comment
(`SCHEMA_COMMENT`). `downgrade` to base drops flowq's tables, then its version table, then
the schema itself, but only when the schema carries that mark and holds nothing else: a
schema someone else created, or one holding objects flowq did not create, stays.

alembic is imported inside the functions that run it, not with this module: the constants
(`HEAD_REVISION`, ...) are read by commands that never migrate, which should start at once.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import sqlalchemy as sa

from flowq.names import DEFAULT_SCHEMA, validate_schema_name

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = ["HEAD_REVISION", "MIGRATE_LOCK", "SCHEMA_COMMENT", "VERSION_TABLE", "Migrated",
           "alembic_config", "current_revision", "downgrade", "migrate", "migrations_dir",
           "revision_schema", "sql_script"]

T = TypeVar("T")

VERSION_TABLE = "alembic_version"
# The revision this flowq needs (a test checks it is the migrations' head): a worker refuses
# to start on a schema behind it, with one sentence instead of failing statements.
HEAD_REVISION: Final = "0008"
# The advisory lock serialising migrations; env.py takes the same key (any constant would do,
# as long as every flowq process uses it).
MIGRATE_LOCK: Final = 0x666C6F77  # "flow"
# The mark of a schema `migrate` created, so that `downgrade` to base may drop it.
SCHEMA_COMMENT: Final = "created by flowq migrate"
_DEPENDENT_OBJECTS_STILL_EXIST: Final = "2BP01"


@dataclass(frozen=True)
class Migrated:
    """What `migrate` did: the revision before and after (None: no flowq tables), and
    whether it created the schema."""

    before: str | None
    after: str | None
    created_schema: bool

    @property
    def changed(self) -> bool:
        return self.before != self.after


def revision_schema() -> str:
    """The schema a revision applies its DDL to, for use inside `upgrade()`/`downgrade()`: read
    when the revision runs, not at import, since one process may migrate several schemas."""
    from alembic import context

    return validate_schema_name(context.config.attributes.get("flowq_schema", DEFAULT_SCHEMA))


def migrations_dir() -> Path:
    """Where the revisions are: inside the installed package, else the repository's alembic/."""
    package = Path(__file__).resolve().parent.parent  # flowq/, from flowq/db/
    for candidate in (package / "_migrations", package.parent / "alembic"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError("flowq's migrations are missing from this installation")


def alembic_config(connection: sa.Connection | None = None, *, schema: str = DEFAULT_SCHEMA,
                   url: str | None = None, output: Any = None) -> Config:
    """An alembic Config for flowq's migrations, bound to `connection` (or `url` for --sql)."""
    from alembic.config import Config

    cfg = Config(output_buffer=output) if output is not None else Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["connection"] = connection
    cfg.attributes["flowq_schema"] = validate_schema_name(schema)
    return cfg


def _in_transaction(bind: sa.Engine | sa.Connection, work: Callable[[sa.Connection], T]) -> T:
    if isinstance(bind, sa.Engine):
        with bind.begin() as conn:
            return work(conn)
    # A transaction the caller already had open stays theirs to commit (the DDL commits
    # with their work); one that only migrating began is committed here, or closing the
    # connection would silently roll the migration back.
    began_here = not bind.in_transaction()
    result = work(bind)
    if began_here and bind.in_transaction():
        bind.commit()
    return result


def _lock(conn: sa.Connection) -> None:
    conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATE_LOCK})


def current_revision(conn: sa.Connection, schema: str = DEFAULT_SCHEMA) -> str | None:
    """The flowq revision of `schema` in this database, or None when it has no flowq tables."""
    from alembic.runtime.migration import MigrationContext

    ctx = MigrationContext.configure(conn, opts={
        "version_table": VERSION_TABLE, "version_table_schema": validate_schema_name(schema)})
    return ctx.get_current_revision()


def migrate(bind: sa.Engine | sa.Connection, *, schema: str = DEFAULT_SCHEMA,
            revision: str = "head") -> Migrated:
    """Bring the flowq schema up to `revision` (default: the latest); safe to call repeatedly.

    With an Engine, migrating is one transaction of its own. With a Connection, it joins the
    connection's open transaction if there is one (commit it yourself), else commits.
    Returns what it did (`Migrated`: the revisions before and after).
    """
    from alembic import command

    schema = validate_schema_name(schema)

    def work(conn: sa.Connection) -> Migrated:
        _lock(conn)
        created = conn.execute(sa.text("SELECT 1 FROM pg_namespace WHERE nspname = :s"),
                               {"s": schema}).scalar() is None
        if created:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
            conn.execute(sa.text(f"COMMENT ON SCHEMA \"{schema}\" IS '{SCHEMA_COMMENT}'"))
        before = current_revision(conn, schema)
        command.upgrade(alembic_config(conn, schema=schema), revision)
        return Migrated(before, current_revision(conn, schema), created)

    return _in_transaction(bind, work)


def downgrade(bind: sa.Engine | sa.Connection, *, schema: str = DEFAULT_SCHEMA,
              revision: str = "base") -> None:
    """Undo flowq's migrations down to `revision`.

    Down to base (the default), it also drops flowq's version table, and the schema when
    `migrate` created it and nothing else is in it; a schema that holds anything flowq did
    not create (or that flowq did not create) is left in place, empty of flowq's objects.
    Transactions as for `migrate`.
    """
    from alembic import command

    schema = validate_schema_name(schema)

    def work(conn: sa.Connection) -> None:
        _lock(conn)
        command.downgrade(alembic_config(conn, schema=schema), revision)
        if current_revision(conn, schema) is not None:
            return
        conn.execute(sa.text(f'DROP TABLE IF EXISTS "{schema}".{VERSION_TABLE}'))
        comment = conn.execute(sa.text(
            "SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace WHERE nspname = :s"),
            {"s": schema}).scalar()
        if comment != SCHEMA_COMMENT:
            return
        try:
            with conn.begin_nested():
                # RESTRICT (the default) refuses a schema that holds any object at all: that
                # refusal, not a catalogue query of ours, is what protects other objects.
                conn.execute(sa.text(f'DROP SCHEMA "{schema}" RESTRICT'))
        except sa.exc.DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) != _DEPENDENT_OBJECTS_STILL_EXIST:
                raise

    _in_transaction(bind, work)


def sql_script(*, schema: str = DEFAULT_SCHEMA, revision: str = "head") -> str:
    """The DDL `migrate` would run on an empty database, for review (`flowq migrate --sql`)."""
    from alembic import command

    buf = io.StringIO()
    cfg = alembic_config(schema=schema, url="postgresql+psycopg://", output=buf)
    command.upgrade(cfg, revision, sql=True)
    return buf.getvalue()
