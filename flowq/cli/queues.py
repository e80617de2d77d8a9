"""`flowq queues`: every queue with its depth, running count, limits and paused state;
`flowq queues pause NAME` / `resume NAME`.

The state lives in `flowq.queues` (see `flowq.queues`): a pause takes effect for every worker
within its poll interval, and at once for every claim statement (a plain claim never takes
jobs of a paused queue). Running jobs finish.
"""

from __future__ import annotations

import json

import click

from flowq.cli.common import age_cell, limits_cell, open_engine, schema_option, table, url_option

__all__ = ["queues"]


@click.group(invoke_without_command=True)
@url_option
@schema_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON (stable keys).")
@click.pass_context
def queues(ctx: click.Context, database_url: str | None, schema: str, as_json: bool) -> None:
    """List queues (depth, running, limits, paused); pause or resume one."""
    if ctx.invoked_subcommand is not None:
        return
    engine = open_engine(database_url, schema)
    try:
        from flowq.ops.queues import list_queues

        found = list_queues(engine, schema=schema)
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps({"queues": [q.to_dict() for q in found]}, indent=2,
                              sort_keys=True))
        return
    if not found:
        click.echo("no queues.")
        return
    headers = ["queue", "due", "later", "waiting", "running", "dead", "oldest due", "limits",
               "state"]
    rows = [[q.name, str(q.pending), str(q.scheduled), str(q.waiting), str(q.running),
             str(q.dead), age_cell(q.oldest_due_s),
             limits_cell(q.concurrency, q.rate_limit, q.rate_period_s),
             "paused" if q.paused else "active"]
            for q in found]
    click.echo(table(headers, rows))


def _set(database_url: str | None, schema: str, name: str, paused: bool) -> None:
    from flowq.define.app import did_you_mean
    from flowq.ops.queues import list_queues, pause, resume

    engine = open_engine(database_url, schema)
    try:
        known = [q.name for q in list_queues(engine, schema=schema)]
        changed = (pause if paused else resume)(engine, name, schema=schema)
    finally:
        engine.dispose()
    if name not in known:  # legitimate ahead of its jobs, but more often a typo
        hint = did_you_mean(name, known)
        click.echo(f"flowq: warning: no queue {name!r} has jobs or a declaration"
                   f"{': ' + hint if hint else ''} (the setting is kept for it all the same)",
                   err=True)
    state = "paused" if paused else "resumed"
    click.echo(f"queue {name!r} {state}." if changed else
               f"queue {name!r} was already {'paused' if paused else 'active'}; nothing changed.")


@queues.command("pause")
@click.argument("name")
@url_option
@schema_option
def pause_command(name: str, database_url: str | None, schema: str) -> None:
    """Pause queue NAME: no worker claims from it; running jobs finish."""
    _set(database_url, schema, name, True)


@queues.command("resume")
@click.argument("name")
@url_option
@schema_option
def resume_command(name: str, database_url: str | None, schema: str) -> None:
    """Resume queue NAME."""
    _set(database_url, schema, name, False)
