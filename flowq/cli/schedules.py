"""`flowq schedules [MODULE:APP]`: each periodic schedule with its spec, time zone, next
tick, and the last tick it enqueued with that run's id and status.

The app is named as for every command: `MODULE:APP`, `--app MODULE:APP`, or FLOWQ_APP. The
schedules are the app's (`@app.periodic`, see `flowq.schedules`) and whatever else the
database records in `flowq.schedules` (a schedule the app no longer defines is marked so).
Without an app only the recorded ones are listed, without their next tick, and nothing can
say which of them the app defines (`--json`: `"defined": null`). Times are shown in each
schedule's time zone (`--json`: ISO 8601 in UTC).
"""

from __future__ import annotations

import json
import zoneinfo
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import click

from flowq.cli.common import app_parameters, load_app, open_engine, table, url_option

if TYPE_CHECKING:
    from flowq.ops.schedules import ScheduleInfo

__all__ = ["schedules"]


def _when(moment: datetime | None, zone: str | None) -> str:
    if moment is None:
        return "-"
    tz = timezone.utc if zone in (None, "UTC") else zoneinfo.ZoneInfo(str(zone))
    return moment.astimezone(tz).isoformat(sep=" ", timespec="seconds").replace("+00:00", "Z")


def _last(s: ScheduleInfo) -> str:
    if s.last_run_id is None:
        return "-"
    return f"{s.last_run_id} ({s.last_status})"


@click.command()
@app_parameters("The app whose schedules to list (without one: only what the database "
                "records)")
@url_option
@click.option("--schema", default=None,
              help="PostgreSQL schema holding flowq's tables (default: the app's, else flowq).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (stable keys).")
def schedules(app_spec: str | None, database_url: str | None, schema: str | None,
              as_json: bool) -> None:
    """List periodic schedules: spec, time zone, next tick, last run."""
    app = load_app(app_spec) if app_spec is not None else None
    schema = schema or (app.schema if app is not None else "flowq")
    engine = open_engine(database_url, schema)
    try:
        from flowq.ops.schedules import list_schedules

        found = list_schedules(engine, app, schema=schema)
    finally:
        engine.dispose()
    if as_json:
        # Without the app, whether it defines a schedule is unknown: null, not false.
        click.echo(json.dumps({"schedules": [
            {**s.to_dict(), **({} if app is not None else {"defined": None})} for s in found]},
            indent=2, sort_keys=True))
        return
    if not found:
        click.echo("no schedules." if app is not None else
                   "no schedules recorded (pass --app MODULE:APP to list an app's).")
        return
    headers = ["schedule", "task", "spec", "next tick", "last tick", "last run"]
    rows = [[s.name + ("" if s.defined or app is None else " (not in app)"), s.task, s.spec,
             _when(s.next_tick, s.timezone), _when(s.last_tick, s.timezone), _last(s)]
            for s in found]
    click.echo(table(headers, rows))
    if app is None:
        click.echo("flowq: without the app, the next ticks and which schedules the app still "
                   "defines are unknown: name it (`flowq schedules MODULE:APP`).", err=True)
