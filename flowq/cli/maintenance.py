"""`flowq reap` and `flowq prune`: one pass of the worker's maintenance loops, by hand or cron.

- `reap --stale-after 30`: requeue (or bury) running jobs whose heartbeat is older than that.
- `prune --retention 259200 --dead-retention 1209600`: delete runs finished longer ago.
Both take `--database-url` and `--schema` (default "flowq").
"""

from __future__ import annotations

from typing import Final

import click

from flowq.cli.common import Phase, open_engine, schema_option, url_option

__all__ = ["prune", "reap"]

# Batches `flowq prune` deletes at most in one command (each of the pruner's batch size).
PRUNE_MAX_BATCHES: Final = 1_000_000


@click.command()
@url_option
@schema_option
@click.option("--stale-after", default=30.0, show_default=True, type=click.FloatRange(0.0),
              help="Heartbeat age (seconds) after which a running job (whose worker's "
                   "registry entry is as old) is requeued, and the entry removed.")
def reap(database_url: str | None, schema: str, stale_after: float) -> None:
    """Requeue (or bury) running jobs whose worker stopped heartbeating; one pass."""
    from flowq.worker.reaper import Reaper
    from flowq.worker.registry import WorkerExpirer
    from flowq.worker.waits import WaitExpirer

    engine = open_engine(database_url, schema)
    try:
        n = Reaper(engine, schema, stale_after=stale_after).run_once()
        # The reaper's pass used to expire dead workers' entries and timed-out waits too.
        WorkerExpirer(engine, schema, stale=stale_after).run_once()
        WaitExpirer(engine, schema).run_once()
    finally:
        engine.dispose()
    click.echo(f"reaped {n} job(s).")


@click.command()
@url_option
@schema_option
@click.option("--retention", default=3 * 86400.0, show_default=True,
              type=click.FloatRange(0.0), help="Seconds to keep finished runs.")
@click.option("--dead-retention", default=14 * 86400.0, show_default=True,
              type=click.FloatRange(0.0), help="Seconds to keep runs with a dead step.")
def prune(database_url: str | None, schema: str, retention: float, dead_retention: float
          ) -> None:
    """Delete runs that finished longer ago than the retention; one pass."""
    from flowq.worker.pruner import Pruner

    engine = open_engine(database_url, schema)
    phase = Phase(f"deleting runs finished more than {retention:,.0f}s ago "
                  f"({dead_retention:,.0f}s with a dead step), a batch per transaction")
    pruner = Pruner(engine, schema, retention=retention,
                    dead_retention=dead_retention, max_batches=1)
    n = 0
    try:
        # The pruner's pass, a batch at a time, to report each (it stops at a batch that
        # deletes nothing and leaves no work behind, such as a day partition's sweep that
        # only re-homed rows, or finds another pruner holding the lock).
        for _ in range(PRUNE_MAX_BATCHES):
            deleted = pruner.run_once()
            if not deleted and not pruner.behind:
                break
            n += deleted
            phase.update(n, "row(s) deleted")
    finally:
        phase.done()
        engine.dispose()
    click.echo(f"pruned {n} row(s).")
