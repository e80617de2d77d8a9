"""The scheduler: enqueues every due tick of the app's periodic schedules, each exactly once.

Every worker runs one (`WorkerConfig.schedules`, default on; `flowq worker --no-schedules`
opts out), on a thread and a connection of its own (`flowq schedule <worker>` in
pg_stat_activity), so no prune or reap delays a tick. None of them leads: a tick's run is
enqueued with the idempotency key `flowq:schedule:<name>:<tick in UTC>`, so when several
workers find one tick due, one inserts the run and the others find it (the key's unique
index makes a concurrent inserter wait for the first one's commit, then return its run).

A pass (`run_once(now)`, which tests call with a fake clock) reads each schedule's cursor in
`flowq.schedules` with the database's clock (a worker's own clock is never used), enters a
schedule seen for the first time with its cursor at now (no backfill), and for each schedule
with due ticks (`Schedule.due_ticks`: the latest, any other less than 10 s late, or all of
them with `catch_up`, at most 1000 per pass) enqueues them oldest first, stamps each new run
with its tick (`ctx.scheduled_at`) and moves the cursor, in one transaction per schedule.

Between passes the thread sleeps until the next tick of any schedule (by the database's
clock, translated with the offset measured at each pass), at most `MAX_SLEEP` (60 s); after a
failed pass it tries again with a backoff of 0.5 s, doubling up to `DB_BACKOFF_MAX` (5 s). It
is a `flowq.worker.services.Service` (named `scheduler`) with `run_once(now=None)`.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime
from typing import Final

import sqlalchemy as sa

from flowq.db.store import Store
from flowq.define.app import FlowQ
from flowq.define.schedules import Schedule
from flowq.enqueueing.prepare import prepare_enqueue
from flowq.enqueueing.sync import execute
from flowq.worker.connection import DB_BACKOFF_MAX, DB_ERRORS
from flowq.worker.logs import ERROR, INFO, log_event
from flowq.worker.services import Service

__all__ = ["Scheduler"]

MAX_SLEEP: Final = 60.0
FIRST_BACKOFF: Final = 0.5
# Woken this much after a tick, so that the database's clock has passed it too.
WAKE_SLACK: Final = 0.005


class Scheduler(Service):
    """Enqueues the due ticks of `app`'s schedules through `engine` (see the module docstring).

    `run_once(now=None)` makes one pass and returns how many runs it created; `start()` runs
    passes on a thread until `stop()` (or until `stopping`, an event shared with the worker,
    is set)."""

    name = "scheduler"

    def __init__(self, engine: sa.Engine, app: FlowQ, *,
                 stopping: threading.Event | None = None, max_sleep: float = MAX_SLEEP) -> None:
        super().__init__(interval=max_sleep, first_delay=0.0, stopping=stopping)
        self.engine = engine
        self.app = app
        self.schedules: list[Schedule] = app.schedules
        self.schema = app.schema
        self.max_sleep = max_sleep
        self._next_tick: datetime | None = None
        self._clock_offset = 0.0  # the database's clock minus this host's, in seconds

    # -- one pass -------------------------------------------------------------------------------

    def run_once(self, now: datetime | None = None) -> int:
        """Enqueue every due tick once; `now` defaults to the database's clock."""
        if not self.schedules:
            return 0
        with self.engine.connect() as conn:
            before = time.time()
            found = Store.of(conn, self.schema).schedule_cursors([s.name for s in self.schedules])
            clock = found.now
            self._clock_offset = clock.timestamp() - (before + time.time()) / 2
        now = clock if now is None else now
        cursors = found.last_ticks
        new = [s for s in self.schedules if cursors.get(s.name) is None]
        if new:
            with self.engine.begin() as conn:
                Store.of(conn, self.schema).start_schedules(new, now)
        created = 0
        for s in self.schedules:
            after = cursors.get(s.name)
            if after is None:
                continue  # entered just now, at `now`: nothing is due yet
            ticks = s.due_ticks(after, now)
            if ticks:
                # One schedule's failure must not hold up the others; its ticks stay due.
                try:
                    created += self._enqueue(s, ticks)
                except DB_ERRORS as exc:
                    self.outage.failed("schedule pass", exc, schedule=s.name)
                except Exception as exc:
                    log_event(ERROR, "schedule failed; will retry", schedule=s.name,
                              error=repr(exc))
        nexts = [t for t in (s.next_tick(now) for s in self.schedules) if t is not None]
        self._next_tick = min(nexts, default=None)
        return created

    def _enqueue(self, s: Schedule, ticks: list[datetime]) -> int:
        """Enqueue `ticks` of `s` (oldest first) and move its cursor, in one transaction."""
        created: list[tuple[datetime, int]] = []
        last: tuple[datetime, int] | None = None
        with self.engine.begin() as conn:
            store = Store.of(conn, self.schema)
            for tick in ticks:
                run = execute(conn, prepare_enqueue(s.definition, s.args,
                                                    idempotency_key=s.key(tick), run_at=tick))
                if run.created:
                    store.stamp_scheduled_run(run.id, tick)
                    created.append((tick, run.id))
                last = (tick, run.id)
            # Nothing created: whoever created them committed the cursor with them.
            if created and last is not None:
                store.advance_schedule(s, tick=last[0], run_id=last[1])
        for tick, run_id in created:
            log_event(INFO, "scheduled", schedule=s.name, task=s.task, tick=tick.isoformat(),
                      run_id=run_id)
        if len(ticks) > 1 and s.catch_up:
            log_event(INFO, "caught up missed ticks", schedule=s.name, ticks=len(ticks),
                      runs=len(created))
        return len(created)

    # -- the thread -----------------------------------------------------------------------------

    def next_delay(self) -> float:
        """Seconds until the next tick by the database's clock, capped at `max_sleep`."""
        if self._next_tick is None:
            return self.max_sleep
        wait = self._next_tick.timestamp() - self._clock_offset - time.time() + WAKE_SLACK
        return min(self.max_sleep, max(WAKE_SLACK, wait))

    def failure_delay(self, failures: int) -> float:
        return float(min(FIRST_BACKOFF * 2 ** (failures - 1), DB_BACKOFF_MAX))

    def start(self) -> None:
        if self.schedules:
            super().start()
