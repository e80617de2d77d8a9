"""`flowq migrate`: create or upgrade flowq's tables, or (`--sql`) print the DDL for review.

Options: `--database-url` (default: FLOWQ_DATABASE_URL, then DATABASE_URL), `--schema`
(default "flowq"), `--sql`.
"""

from __future__ import annotations

import click

from flowq.cli.common import require_url, schema_option, url_option
from flowq.db import create_engine

__all__ = ["migrate"]


@click.command()
@url_option
@schema_option
@click.option("--sql", is_flag=True, help="Print the DDL instead of running it.")
def migrate(database_url: str | None, schema: str, sql: bool) -> None:
    """Create or upgrade flowq's tables (idempotent)."""
    from flowq.migrations import migrate as run_migrate
    from flowq.migrations import sql_script

    if sql:
        click.echo(sql_script(schema=schema))
        return
    engine = create_engine(require_url(database_url))
    try:
        run_migrate(engine, schema=schema)
    finally:
        engine.dispose()
    click.echo(f"flowq schema {schema!r} is up to date.")
