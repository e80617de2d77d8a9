"""alembic environment for flowq's own migrations (see flowq/db/migrations.py).

Run through `flowq migrate` / `flowq.migrate(engine)`, which pass the connection and the
target schema in `config.attributes`, and which have already taken the migration lock and
bounded the transaction's lock waits (`lock_timeout`, retried there as a whole). The version
table lives in the flowq schema, so the application's own `alembic_version` is never touched.
The `--sql` script bounds its lock waits the same way; applied by hand, it fails instead of
stalling claims, and is to be run again.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from flowq.db.migrations import LOCK_TIMEOUT, MIGRATE_LOCK, VERSION_TABLE, compared
from flowq.db.schema import metadata
from flowq.names import DEFAULT_SCHEMA

config = context.config
schema: str = config.attributes.get("flowq_schema", DEFAULT_SCHEMA)



def _configure(**kwargs: object) -> None:
    context.configure(
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        include_schemas=True,
        include_name=compared(schema),
        transaction_per_migration=False,
        **kwargs,
    )


def run_offline() -> None:
    _configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True,
               dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.execute(f"SET LOCAL lock_timeout = '{round(LOCK_TIMEOUT * 1000)}ms'")
        context.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        context.run_migrations()


def run_online() -> None:
    connection: sa.Connection | None = config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("flowq migrations run through flowq.migrate(), not the alembic CLI")
    connection.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATE_LOCK})
    connection.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
