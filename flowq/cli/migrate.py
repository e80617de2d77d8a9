"""`flowq migrate`: create or upgrade flowq's tables, or (`--sql`) print the DDL for review.

Options: `--database-url` (default: FLOWQ_DATABASE_URL, then DATABASE_URL), `--schema`
(default "flowq"), `--sql`. It says what it did: created the schema, upgraded it from one
revision to another, or found it already up to date. While running workers hold locks on
flowq's tables it waits for each lock at most half a second, then rolls back and tries again
(one line on stderr per retry, about a minute in all; `flowq.db.migrations`).
"""

from __future__ import annotations

import click

from flowq.cli.common import require_url, schema_option, url_option

__all__ = ["migrate"]


@click.command()
@url_option
@schema_option
@click.option("--sql", is_flag=True, help="Print the DDL instead of running it.")
def migrate(database_url: str | None, schema: str, sql: bool) -> None:
    """Create or upgrade flowq's tables (idempotent)."""
    from flowq.db.migrations import migrate as run_migrate
    from flowq.db.migrations import sql_script

    if sql:
        click.echo(sql_script(schema=schema))
        return
    from flowq.db import create_engine

    engine = create_engine(require_url(database_url))
    try:
        done = run_migrate(engine, schema=schema,
                           on_retry=lambda line: click.echo(line, err=True))
    finally:
        engine.dispose()
    if done.created_schema:
        click.echo(f"created flowq schema {schema!r} at revision {done.after}.")
    elif done.before is None:
        click.echo(f"created flowq's tables in the existing schema {schema!r} at revision "
                   f"{done.after}.")
    elif done.changed:
        click.echo(f"upgraded flowq schema {schema!r} from revision {done.before} to "
                   f"{done.after}.")
    else:
        click.echo(f"flowq schema {schema!r} is already up to date (revision {done.after}).")
