"""The pruner: deletes whole runs finished more than `retention` ago (default 3 days;
`dead_retention`, default 14 days, for a run with a dead step), and keeps the day partitions
of `flowq.job_history` (`flowq.db.history`).

A pass (every `interval`, default 60 s):
1. creates the partitions of today and the next `days_ahead` days (default 2) that are
   missing (the worker also does it as it starts, before its first completion);
2. retires each day partition older than the retention: sweeps it a batch of `limit` runs
   (default 1000) at a time, re-homing the rows of kept runs and pruning the others with
   what hangs off them, then drops it. A sweep left unfinished at the end of a pass goes on
   from where it stopped at this pruner's next pass;
3. deletes runs row by row where no day partition took them (the DEFAULT partition, finished
   rows still in `jobs`), in batches of at most `limit` runs;
4. moves the finished rows an earlier release left in `jobs` to history, `limit` at a time.
Each of 2-4 makes at most `max_batches` (default 10) batches per pass and stops at the first
that does nothing. Whole runs only, so a retained run keeps its history and its idempotency
key. Each batch is its own transaction under the advisory lock `<schema>.pruner`: one
pruner at a time across all workers, and no batch holds its locks for long; a pass that finds
the lock taken ends there. `run_once()` is also `flowq prune`. Each pass also deletes up to
`limit` registrations of `flowq.run_waiters` left by a waiter that died mid-wait (their
LISTEN connection is gone).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import date
from typing import Final

import sqlalchemy as sa

from flowq.db import history
from flowq.db.store import Store
from flowq.worker.config import DEFAULT_DEAD_RETENTION, DEFAULT_PRUNE_INTERVAL, DEFAULT_RETENTION
from flowq.worker.logs import INFO, WARNING, log_event
from flowq.worker.services import Service

__all__ = ["PRUNE_LIMIT", "PRUNE_MAX_BATCHES", "Pruner"]

PRUNE_LIMIT: Final = 1000
PRUNE_MAX_BATCHES: Final = 10


@dataclass
class _Sweep:
    """Where this pruner's sweep of one day stands: the last run id done, and whether the
    day is swept (only its DROP left)."""

    after: int = 0
    done: bool = False


class Pruner(Service):
    """Deletes runs that finished long enough ago, in bounded batches, and keeps the day
    partitions of history."""

    name = "pruner"

    def __init__(self, engine: sa.Engine, schema: str, *,
                 retention: float = DEFAULT_RETENTION,
                 dead_retention: float = DEFAULT_DEAD_RETENTION, limit: int = PRUNE_LIMIT,
                 max_batches: int = PRUNE_MAX_BATCHES, interval: float = DEFAULT_PRUNE_INTERVAL,
                 days_ahead: int = history.DAYS_AHEAD, first_delay: float | None = None,
                 stopping: threading.Event | None = None) -> None:
        super().__init__(interval=interval, first_delay=first_delay, stopping=stopping)
        self.engine = engine
        self.schema = schema
        self.retention = retention
        self.dead_retention = dead_retention
        self.limit = limit
        self.max_batches = max_batches
        self.days_ahead = days_ahead
        # Work a further pass would do at once (a sweep under way, a batch that came back
        # full): `flowq prune` goes on while there is.
        self.behind = False
        self._sweeps: dict[date, _Sweep] = {}

    def ensure_partitions(self) -> history.Partitioned:
        """Create the missing day partitions (step 1 of a pass; the worker's start too)."""
        with self.engine.connect() as conn:
            done = history.ensure_partitions(conn, self.schema, self.days_ahead)
        if done.created:
            log_event(INFO, "created history partitions",
                      days=",".join(f"{d:%Y-%m-%d}" for d in done.created))
        for day, error in done.refused.items():
            log_event(WARNING, "could not create a history partition", day=f"{day:%Y-%m-%d}",
                      error=error)
        return done

    def run_once(self) -> int:
        """One pass (see the module docstring); returns how many job rows were deleted."""
        self.behind = False
        if self.ensure_partitions().busy:
            return 0
        total = 0
        with self.engine.connect() as conn:
            for step in (self._retire_days, self._prune_rows, self._move_finished):
                done = step(conn)
                if done is None:  # another pruner holds the lock
                    return total
                total += done
        with self.engine.begin() as conn:
            Store.of(conn, self.schema).prune_waiters(self.limit)
        if total:
            log_event(INFO, "pruned finished runs", rows=total)
        return total

    def _retire_days(self, conn: sa.Connection) -> int | None:
        """Step 2: sweep and drop the days older than the retention; rows deleted."""
        schema = self.schema
        deleted = 0
        batches = 0
        expired = history.expired_days(conn, schema, self.retention)
        self._sweeps = {day: self._sweeps.get(day, _Sweep()) for day in expired}
        for day, sweep in self._sweeps.items():
            while not sweep.done:
                if batches == self.max_batches:
                    self.behind = True
                    return deleted
                swept = history.sweep_day(conn, schema, day, after=sweep.after,
                                          retention=self.retention,
                                          dead_retention=self.dead_retention,
                                          limit=self.limit)
                if swept is None:
                    return None
                batches += 1
                deleted += swept.deleted
                sweep.done = swept.last_run_id is None
                sweep.after = swept.last_run_id or sweep.after
            dropped = history.drop_day(conn, schema, day)
            if dropped is None:
                return None
            if dropped < 0:  # its lock was not granted in time: the next pass
                log_event(INFO, "history partition busy; dropping it at the next pass",
                          day=f"{day:%Y-%m-%d}")
                continue
            deleted += dropped
            log_event(INFO, "dropped history partition", day=f"{day:%Y-%m-%d}", rows=dropped)
        return deleted

    def _prune_rows(self, conn: sa.Connection) -> int | None:
        """Step 3: the rule row by row, for what no day partition took; rows deleted."""
        deleted = 0
        for _ in range(self.max_batches):
            batch = history.prune_runs(conn, self.schema, retention=self.retention,
                                       dead_retention=self.dead_retention, limit=self.limit)
            if batch is None:
                return None
            deleted += batch
            if batch == 0:
                return deleted
        self.behind = True
        return deleted

    def _move_finished(self, conn: sa.Connection) -> int | None:
        """Step 4: move an earlier release's finished rows out of `jobs` (not counted: no row
        is deleted)."""
        for _ in range(self.max_batches):
            moved = history.move_finished(conn, self.schema, self.limit)
            if moved is None:
                return None
            if moved < self.limit:
                return 0
        self.behind = True
        return 0
