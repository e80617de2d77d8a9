"""The verbs of periodic schedules' cursors (`flowq.schedules`): the scheduler's pass
(`ScheduleVerbs`).

A cursor is the last tick a schedule enqueued; it never moves back. The clock a pass reads
is the database's, never a worker's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from flowq.db.rows import column, read
from flowq.db.runner import Rows
from flowq.db.store.base import Verbs

__all__ = ["Cursors", "ScheduleRecord", "ScheduleVerbs", "Scheduled"]


class Scheduled(Protocol):
    """A schedule as its cursor's row names it (`flowq.define.schedules.Schedule` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def task(self) -> str: ...

    @property
    def spec(self) -> str: ...


@dataclass(frozen=True)
class Cursors:
    """The database's clock, and the cursor of each schedule asked for (None: not entered
    yet)."""

    now: datetime
    last_ticks: dict[str, datetime | None]


@dataclass(frozen=True)
class ScheduleRecord:
    """A schedule as its schema records it: the last tick it enqueued, and that run."""

    name: str
    task: str
    spec: str
    last_tick: datetime | None
    last_run_id: int | None
    updated_at: datetime


class ScheduleVerbs(Verbs):
    """The cursors of periodic schedules."""

    def schedule_cursors(self, names: Sequence[str]) -> Cursors:
        """The cursors of the schedules `names` (at least one), with the database's clock."""
        rows = self.run(self.q.select_schedules, {"names": list(names)})
        return Cursors(column(rows, "now")[0],
                       dict(zip(column(rows, "name"), column(rows, "last_tick"), strict=True)))

    def start_schedules(self, schedules: Sequence[Scheduled], now: datetime) -> None:
        """Enter the `schedules` not entered yet, their cursor at `now` (no backfill)."""
        self.run(self.q.start_schedules, {
            "names": [s.name for s in schedules], "tasks": [s.task for s in schedules],
            "specs": [s.spec for s in schedules], "now": now})

    def stamp_scheduled_run(self, run_id: int, tick: datetime) -> None:
        """Record on run `run_id`'s rows the tick it runs for (`ctx.scheduled_at`), in the
        transaction that enqueued it."""
        self.run(self.q.stamp_scheduled_run, {"tick": tick, "run_id": run_id})

    def advance_schedule(self, schedule: Scheduled, tick: datetime, run_id: int) -> None:
        """Move `schedule`'s cursor to `tick`, enqueued as run `run_id` (never back)."""
        self.run(self.q.advance_schedule, {
            "name": schedule.name, "task": schedule.task, "spec": schedule.spec,
            "tick": tick, "run_id": run_id})

    def list_schedules(self) -> tuple[list[ScheduleRecord], datetime]:
        """Every recorded schedule by name, and the database's clock."""
        rows = self.run(self.q.list_schedules, {})
        name = rows.columns.index("name")
        recorded = Rows(rows.columns, [r for r in rows if r[name] is not None])
        return read(ScheduleRecord, recorded), rows[0][rows.columns.index("now")]
