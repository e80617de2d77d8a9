"""`flowq demo`: one of the two commands that bring their own database (`flowq bench` the other).

It never reads FLOWQ_DATABASE_URL or DATABASE_URL: a variable set for an application must not
aim a demo at that application's data. Without `--database-url` it starts an embedded
PostgreSQL; with it, the demo works in a schema it creates and drops (`flowq.local.demo`),
and drops or truncates nothing it did not create.
"""

from __future__ import annotations

import click

__all__ = ["demo"]


@click.command()
@click.option("--database-url", "database_url", metavar="URL", default=None,
              help="PostgreSQL database to run in, in a schema the demo creates and drops "
              "(default: a throwaway embedded server; FLOWQ_DATABASE_URL and DATABASE_URL "
              "are ignored).")
@click.option("--jobs", "n_jobs", default=2000, show_default=True, type=click.IntRange(10),
              help="How many jobs the demo enqueues and runs.")
def demo(database_url: str | None, n_jobs: int) -> None:
    """Show transactional enqueue and a worker on an embedded PostgreSQL (or --database-url)."""
    from flowq.local.demo import run_demo

    if database_url is not None:
        from flowq.db import normalize_url

        normalize_url(database_url)  # a bad URL is one sentence before anything starts
    run_demo(database_url, n_jobs=n_jobs)
