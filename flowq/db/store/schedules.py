"""The verbs of `flowq.schedules`: periodic runs started and listed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from flowq.db.rows import read
from flowq.db.runner import Rows
from flowq.db.store.base import Verbs

__all__ = ["ScheduleRecord", "ScheduleVerbs"]


class ScheduleVerbs(Verbs):
    """Schedules: the scheduler's pass and their listing."""

    # -- listing (flowq schedules) -------------------------------------------------------------

    def list_schedules(self) -> tuple[list[ScheduleRecord], datetime]:
        """Every recorded schedule by name, and the database's clock."""
        rows = self.run(self.q.list_schedules, {})
        name = rows.columns.index("name")
        recorded = Rows(rows.columns, [r for r in rows if r[name] is not None])
        return read(ScheduleRecord, recorded), rows[0][rows.columns.index("now")]


@dataclass(frozen=True)
class ScheduleRecord:
    """A schedule as its schema records it: the last tick it enqueued, and that run."""

    name: str
    task: str
    spec: str
    last_tick: datetime | None
    last_run_id: int | None
    updated_at: datetime
