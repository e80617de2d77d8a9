"""`flowq status`: queues, live workers, dead jobs by task and unserved due jobs, at a glance.

Reads through `flowq.ops.status.status`; `--json` prints `Status.to_dict()` (stable keys).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from flowq.cli.common import age_cell, limits_cell, open_engine, schema_option, table, url_option
from flowq.define.shape import short

if TYPE_CHECKING:
    from flowq.ops.status import Status

__all__ = ["status_command"]


def _table(headers: list[str], rows: list[list[str]]) -> None:
    click.echo(table(headers, rows, indent="  "))


def _print(st: Status) -> None:
    click.echo(f"queues ({len(st.queues)}):")
    if st.queues:
        _table(["queue", "due", "later", "waiting", "running", "dead", "oldest due",
                "ok/1m", "ok/1h", "dead/1h", "limits", "state"],
               [[q.name, str(q.pending), str(q.scheduled), str(q.waiting), str(q.running),
                 str(q.dead), age_cell(q.oldest_due_s), str(q.succeeded_last_minute),
                 str(q.succeeded_last_hour), str(q.dead_last_hour), limits_cell(q.concurrency, q.rate_limit, q.rate_period_s),
                 "paused" if q.paused else "active"] for q in st.queues])
    click.echo(f"workers ({len(st.workers)} live):")
    if st.workers:
        _table(["name", "host", "pid", "queues", "concurrency", "version", "started",
                "heartbeat"],
               [[w.name, w.host, str(w.pid), ",".join(w.queues), str(w.concurrency),
                 w.version, w.started_at.strftime("%Y-%m-%d %H:%M:%S%z"),
                 f"{age_cell(w.heartbeat_age_s)} ago"] for w in st.workers])
    click.echo(f"dead jobs by task ({sum(d.jobs for d in st.dead_by_task)}):")
    if st.dead_by_task:
        _table(["task", "dead"], [[d.task, str(d.jobs)] for d in st.dead_by_task])
    if st.unserved:
        click.echo("due jobs no live worker serves:")
        _table(["queue", "task", "jobs", "oldest due"],
               [[u.queue, u.task, str(u.jobs), age_cell(u.oldest_due_s)] for u in st.unserved])
    else:
        click.echo("due jobs no live worker serves: none.")
    if st.handed_over:
        click.echo("jobs left to a worker whose definition can run them (a deploy in "
                   "progress; `flowq deploy-check` says which runs the new code cannot "
                   "continue):")
        _table(["task", "definition", "left to", "jobs"],
               [[h.task, short(h.fingerprint), h.worker or "-", str(h.jobs)]
                for h in st.handed_over])


@click.command("status")
@url_option
@schema_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON (stable keys).")
def status_command(database_url: str | None, schema: str, as_json: bool) -> None:
    """Show queues, live workers, dead jobs by task and due jobs no worker serves."""
    engine = open_engine(database_url, schema)
    try:
        from flowq.ops.status import status

        st = status(engine, schema=schema)
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps(st.to_dict(), indent=2, sort_keys=True))
    else:
        _print(st)
