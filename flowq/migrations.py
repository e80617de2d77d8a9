"""Applying flowq's alembic migrations with flowq's own version table.

The revisions live in the top-level `alembic/` of the repository and ship inside the wheel as
`flowq/_migrations`. They are applied with a version table in the flowq schema
(`flowq.alembic_version`), so flowq's history never collides with the application's own
`alembic_version`. Concurrent `migrate` calls (several workers starting at once) are
serialised by an advisory lock taken in `env.py`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from flowq.schema import DEFAULT_SCHEMA, validate_schema_name

__all__ = ["VERSION_TABLE", "alembic_config", "downgrade", "migrate", "migrations_dir",
           "sql_script"]

VERSION_TABLE = "alembic_version"


def migrations_dir() -> Path:
    """Where the revisions are: inside the installed package, else the repository's alembic/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_migrations", here.parent / "alembic"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError("flowq's migrations are missing from this installation")


def alembic_config(connection: sa.Connection | None = None, *, schema: str = DEFAULT_SCHEMA,
                   url: str | None = None, output: Any = None) -> Config:
    """An alembic Config for flowq's migrations, bound to `connection` (or `url` for --sql)."""
    cfg = Config(output_buffer=output) if output is not None else Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["connection"] = connection
    cfg.attributes["flowq_schema"] = validate_schema_name(schema)
    return cfg


def _run(bind: sa.Engine | sa.Connection, schema: str, fn: Any, *args: Any) -> None:
    if isinstance(bind, sa.Engine):
        with bind.begin() as conn:
            fn(alembic_config(conn, schema=schema), *args)
        return
    # A transaction the caller already had open stays theirs to commit (the DDL commits
    # with their work); one that only migrating began is committed here, or closing the
    # connection would silently roll the migration back.
    began_here = not bind.in_transaction()
    fn(alembic_config(bind, schema=schema), *args)
    if began_here and bind.in_transaction():
        bind.commit()


def migrate(bind: sa.Engine | sa.Connection, *, schema: str = DEFAULT_SCHEMA,
            revision: str = "head") -> None:
    """Bring the flowq schema up to `revision` (default: the latest); safe to call repeatedly.

    With an Engine, migrating is one transaction of its own. With a Connection, it joins the
    connection's open transaction if there is one (commit it yourself), else commits.
    """
    _run(bind, schema, command.upgrade, revision)


def downgrade(bind: sa.Engine | sa.Connection, *, schema: str = DEFAULT_SCHEMA,
              revision: str = "base") -> None:
    """Undo flowq's migrations down to `revision` (default: drop everything flowq made)."""
    _run(bind, schema, command.downgrade, revision)


def sql_script(*, schema: str = DEFAULT_SCHEMA, revision: str = "head") -> str:
    """The DDL `migrate` would run on an empty database, for review (`flowq migrate --sql`)."""
    buf = io.StringIO()
    cfg = alembic_config(schema=schema, url="postgresql+psycopg://", output=buf)
    command.upgrade(cfg, revision, sql=True)
    return buf.getvalue()
