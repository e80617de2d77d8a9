"""`flowq signal RUN_ID NAME [--payload JSON]`: send a signal to a run waiting for it.

Calls `flowq.signal` in a transaction of its own, committed when the command succeeds: the
step waiting for NAME runs with the payload (JSON, default null), or takes it when the run
reaches that step. Needs no app: without one, the signal's name is checked against the shape
the run's definition was recorded under (`flowq.definitions`, written by the workers that
served it); `--app MODULE:APP` (or FLOWQ_APP) checks it against today's code instead.

Errors are one sentence with exit code 2, as for every command: a run that does not exist
or has ended, a name no step of the run waits for, a payload that is not JSON, a second
signal of that name with another payload. The same payload again changes nothing (exit 0).
Options: `--database-url` (default: FLOWQ_DATABASE_URL, then DATABASE_URL), `--schema`
(default "flowq"), `--json` (`{"run_id", "name", "created", "delivered"}`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from flowq.cli.common import app_parameters, load_app, open_engine, schema_option, url_option
from flowq.errors import SignalError

if TYPE_CHECKING:
    import sqlalchemy as sa

__all__ = ["signal_command"]


def _payload(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise SignalError(f"--payload is not JSON ({exc}): pass a JSON value, e.g. --payload "
                          "'{\"by\": \"ann\"}' (a string in double quotes: '\"yes\"')") from None


def _check_recorded(conn: sa.Connection, run_id: int, name: str, schema: str) -> bool:
    """Refuse `name` when no app of this process defines the run's task and the shape its run
    started under, as a worker recorded it, has no step waiting for `name`. False when
    nothing could be checked: no app here defines the task, and no worker recorded it.

    `flowq.signal` checks against the definitions this process imported; a command run
    without the app has none, and would record a signal nobody will ever take."""
    from flowq.db.schema import ACTIVE_STATUSES
    from flowq.db.store import Store
    from flowq.define.app import find_definition

    store = Store.of(conn, schema)
    rows = store.run_jobs(run_id)
    if (not rows or not any(r.status in ACTIVE_STATUSES for r in rows)
            or find_definition(rows[0].task, schema) is not None):
        return True  # flowq.signal says the run is missing or ended, or checks the name
    task = rows[0].task
    started = {r.fingerprint for r in rows if r.fingerprint is not None}
    shapes = [d.shape for d in store.recorded_definitions([task]) if d.fingerprint in started]
    if not shapes:
        return False  # never recorded: nothing here can tell what the run waits for
    waited = sorted({str(s["wait_for"]) for shape in shapes for s in shape.get("steps", ())
                     if s.get("wait_for")})
    if name not in waited:
        raise SignalError(
            f"no step of run {run_id} ({task!r}) waits for signal {name!r} "
            + (f"(it waits for {', '.join(map(repr, waited))})" if waited else
               "(none of its steps waits for a signal)")
            + "; if today's code differs from what the run started on, pass --app MODULE:APP")
    return True


@click.command("signal")
@click.argument("run_id", type=int)
@click.argument("name")
@click.option("--payload", default=None, metavar="JSON",
              help="The signal's payload, a JSON value (default: null).")
@app_parameters("An app to check NAME against (default: the definition the run started "
                "on, as its workers recorded it)",
                positional=False)
@url_option
@schema_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON (stable keys).")
def signal_command(run_id: int, name: str, payload: str | None, app_spec: str | None,
                   database_url: str | None, schema: str, as_json: bool) -> None:
    """Send signal NAME to run RUN_ID: the step waiting for it runs with --payload."""
    value = _payload(payload)
    if app_spec is not None:
        load_app(app_spec)  # registers its definitions, which `flowq.signal` checks against
    import flowq

    engine = open_engine(database_url, schema)
    try:
        with engine.begin() as conn:
            checked = _check_recorded(conn, run_id, name, schema)
            sent = flowq.signal(conn, run_id, name, value, schema=schema)
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps({"run_id": sent.run_id, "name": sent.name,
                               "created": sent.created, "delivered": sent.delivered},
                              indent=2, sort_keys=True))
    elif not sent.created:
        click.echo(f"signal {name!r} was already sent to run {run_id} with this payload; "
                   "nothing changed.")
    elif sent.delivered:
        click.echo(f"signal {name!r} delivered to run {run_id}: the step waiting for it runs "
                   "next.")
    else:
        click.echo(f"signal {name!r} recorded for run {run_id}: the step that waits for it "
                   "takes it when the run reaches it.")
        if not checked:
            click.echo(f"flowq: warning: nothing here knows whether a step of run {run_id} "
                       f"waits for {name!r} (no worker recorded its definition): pass --app "
                       "MODULE:APP to check.", err=True)
