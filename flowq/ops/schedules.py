"""Schedule inspection: every schedule an app defines or its schema records, with its ticks.

`list_schedules(bind, app)` (and `flowq schedules`) shows each schedule's spec, its next tick
and the last tick it enqueued, with that run's id and status. What a schedule is and which
ticks are due is `flowq.define.schedules`; the scheduler that enqueues them runs in the
worker (`flowq.worker.scheduler`). `run_schedule_now` enqueues a schedule's run at once, off
its ticks (the dashboard's "Run now").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

import sqlalchemy as sa

from flowq.db.store import Store
from flowq.define.schedules import utc
from flowq.enqueueing.sync import enqueue
from flowq.errors import RunNotFoundError, UnknownTaskError
from flowq.names import DEFAULT_SCHEMA, validate_schema_name
from flowq.ops import binds
from flowq.ops.binds import Bind
from flowq.ops.runs import get_run

if TYPE_CHECKING:
    from flowq.define.app import FlowQ

__all__ = ["ScheduleInfo", "list_schedules", "run_schedule_now"]


@dataclass(frozen=True)
class ScheduleInfo:
    """A schedule as `flowq schedules` shows it: its spec, its next tick after now, and the
    last tick it enqueued with that run's id and status (`pruned` once the run is gone).
    `defined` is False for a schedule the database knows and the app no longer defines."""

    name: str
    task: str
    spec: str
    timezone: str | None
    catch_up: bool | None
    next_tick: datetime | None
    last_tick: datetime | None
    last_run_id: int | None
    last_status: str | None
    defined: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {k: v.isoformat() if isinstance(v, datetime) else v
                for k, v in asdict(self).items()}


def list_schedules(bind: Bind, app: FlowQ | None = None, *, schema: str | None = None,
                   now: datetime | None = None) -> list[ScheduleInfo]:
    """Every schedule of `app` and every other one recorded in its schema (`schema`, default
    the app's, else "flowq"), by name. Without the app, the next ticks are unknown. `now`
    (default: the database's clock) is when the next tick is counted from."""
    schema = schema or (app.schema if app is not None else DEFAULT_SCHEMA)
    validate_schema_name(schema)
    defined = {s.name: s for s in app.schedules} if app is not None else {}

    def read(conn: sa.Connection) -> list[ScheduleInfo]:
        recorded, db_now = Store.of(conn, schema).list_schedules()
        clock = db_now if now is None else now
        rows = {r.name: r for r in recorded}
        found = []
        for name in sorted(defined.keys() | rows.keys()):
            s, row = defined.get(name), rows.get(name)
            last_run_id = None if row is None else row.last_run_id
            status: str | None = None
            if last_run_id is not None:
                try:
                    status = get_run(conn, last_run_id, schema).status
                except RunNotFoundError:
                    status = "pruned"
            if s is not None:
                task, spec, next_tick = s.task, s.spec, s.next_tick(clock)
            else:
                assert row is not None
                task, spec, next_tick = row.task, row.spec, None
            found.append(ScheduleInfo(
                name=name, task=task, spec=spec,
                timezone=None if s is None else s.timezone,
                catch_up=None if s is None else s.catch_up, next_tick=next_tick,
                last_tick=None if row is None or last_run_id is None else utc(cast(datetime, row.last_tick)),
                last_run_id=last_run_id, last_status=status, defined=s is not None))
        return found

    return binds.read(bind, read)


def run_schedule_now(target: Bind, apps: Sequence[FlowQ], name: str, *,
                     schema: str = DEFAULT_SCHEMA) -> int:
    """Enqueue a run of schedule `name` (defined by one of `apps`) now, with its arguments,
    outside its ticks: its cursor does not move and the next tick still runs. In `target`'s
    transaction (an Engine: its own). The new run's id; UnknownTaskError when no app
    defines that schedule."""
    validate_schema_name(schema)
    found = next((s for app in apps if app.schema == schema for s in app.schedules
                  if s.name == name), None)
    if found is None:
        raise UnknownTaskError(f"no schedule named {name[:80]!r} is defined by the app: "
                               "start the dashboard with --app MODULE:APP (the app that "
                               "declares it)")
    if isinstance(target, sa.Engine):
        with target.begin() as conn:
            return enqueue(conn, found.definition, **found.args).id
    return enqueue(target, found.definition, **found.args).id
