"""Maintenance: the heartbeat of this worker's jobs, the reaper and the pruner.

- `Heartbeat` refreshes `heartbeat_at` of every job this worker holds, in one statement,
  every `interval` (default 5 s), on its own thread and connection. Jobs whose fence (id,
  lease) no longer matches were taken from us.
- `Reaper` requeues running jobs whose heartbeat is older than `stale_after` (default 30 s):
  their worker died. The lost attempt counts, so a job that kills every worker ends `dead`.
  With the defaults, a job whose worker died is running again well within 60 s.
- `Pruner` deletes whole runs finished more than `retention` ago (default 3 days; 14 days
  for runs with a dead step), at most `limit` runs per batch and `max_batches` per pass.

Reaper and pruner each take a transaction-scoped advisory lock, so across all workers only
one pass of each runs at a time. Each has `run_once()` for tests and `flowq reap`/`prune`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import sqlalchemy as sa

from flowq.db.rows import Claim
from flowq.db.schema import notify_channel
from flowq.db.sql import Queries
from flowq.storable import first_line
from flowq.worker.connection import DB_ERRORS, DedicatedConnection
from flowq.worker.logs import ERROR, INFO, WARNING, log_event

__all__ = ["DEFAULT_RETENTION", "DEFAULT_STALE_AFTER", "Heartbeat", "Pruner", "Reaper"]

DEFAULT_HEARTBEAT_INTERVAL: Final = 5.0
DEFAULT_STALE_AFTER: Final = 30.0
DEFAULT_REAP_INTERVAL: Final = 10.0
DEFAULT_PRUNE_INTERVAL: Final = 60.0
DEFAULT_RETENTION: Final = 3 * 86400.0
DEFAULT_DEAD_RETENTION: Final = 14 * 86400.0
REAP_LIMIT: Final = 1000
PRUNE_LIMIT: Final = 1000
PRUNE_MAX_BATCHES: Final = 10


class Heartbeat:
    """Refreshes the heartbeats of the claims returned by `claims()`, on a thread and a
    connection of its own: no maintenance statement (a prune waiting on a lock, a slow reap)
    can delay it past `stale_after` and get this worker's live jobs reaped."""

    def __init__(self, conn: DedicatedConnection, queries: Queries,
                 claims: Callable[[], list[Claim]],
                 unsettled: Callable[[], list[Claim]] | None = None, *,
                 interval: float = DEFAULT_HEARTBEAT_INTERVAL) -> None:
        self.conn = conn
        self.q = queries
        self.claims = claims
        # The claims whose handler is still running (default: `claims`). Only those can be
        # reported lost: a claim whose outcome is being written may stop matching the fence
        # because we just completed it ourselves (the completer reports a dropped outcome).
        self.unsettled = unsettled or claims
        self.interval = interval
        self._reported: set[Claim] = set()  # lost claims already logged, while they run on
        # Called after each beat of the claims (the worker's own registry entry).
        self.also: Callable[[], None] | None = None
        # Called with the claims whose run was cancelled while they run (the executor tells
        # their handlers).
        self.on_cancelled: Callable[[list[Claim]], None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> list[int]:
        """Beat once; returns the ids that are no longer ours (lost to the reaper)."""
        # In id order, as the completer writes its batches: two statements that lock the
        # same rows in one order cannot deadlock (a beat covers the batch being written).
        held = sorted(self.claims())
        if not held:
            return []
        rows = self.conn.execute(self.q.heartbeat_jobs, {"ids": [c[0] for c in held],
                                                         "leases": [c[1] for c in held]})
        alive = {r[0] for r in rows}
        cancelled = {r[0] for r in rows if r[1]}
        if cancelled and self.on_cancelled is not None:
            self.on_cancelled([c for c in held if c[0] in cancelled])
        # A job that completed between reading the claims and the UPDATE no longer matches
        # either: only a claim whose handler still runs after the UPDATE was taken from us.
        running = set(self.unsettled())
        lost = [c for c in held if c[0] not in alive and c in running]
        for job_id, lease in lost:
            if (job_id, lease) not in self._reported:  # once per claim, not every beat
                log_event(WARNING, "lost the claim on a running job (reaped after a stale "
                          "heartbeat); its result will be discarded", job_id=job_id,
                          lease=lease)
        self._reported = set(lost)
        return [c[0] for c in lost]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="flowq-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.conn.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.run_once()
                if self.also is not None:
                    self.also()
            except DB_ERRORS as exc:
                log_event(WARNING, "heartbeat failed; will retry", error=first_line(exc))
            except Exception as exc:  # never let the heartbeat die silently
                log_event(ERROR, "heartbeat crashed; will retry", error=repr(exc))


@dataclass
class Reaper:
    """Requeues or buries jobs whose worker stopped heartbeating."""

    engine: sa.Engine
    queries: Queries
    stale_after: float = DEFAULT_STALE_AFTER
    limit: int = REAP_LIMIT

    def run_once(self) -> int:
        """One pass; returns how many jobs were reaped (0 if another worker holds the lock)."""
        with self.engine.begin() as conn:
            if not conn.execute(self.queries.try_maintenance_lock,
                                {"name": f"{self.queries.schema}.reaper"}).scalar():
                return 0
            rows = conn.execute(self.queries.reap_jobs, {
                "stale": self.stale_after, "limit": self.limit,
                "channel": notify_channel(self.queries.schema)}).all()
            # Registry entries of workers that stopped heartbeating (twice the jobs' margin:
            # an entry only informs, a live worker re-registers if it ever loses its own).
            expired = conn.execute(self.queries.expire_workers,
                                   {"stale": 2 * self.stale_after}).scalars().all()
            # Steps whose signal did not come by their timeout: runnable, to fail with
            # SignalTimeout (their retry policy decides).
            timed_out = conn.execute(self.queries.expire_waits, {
                "limit": self.limit, "channel": notify_channel(self.queries.schema)}).all()
        if timed_out:
            log_event(WARNING, "steps stopped waiting for their signal (timeout)",
                      job_ids=",".join(str(r.id) for r in timed_out))
        if expired:
            log_event(WARNING, "removed workers that stopped heartbeating from the registry",
                      workers=",".join(expired))
        for r in rows:
            log_event(ERROR if r.status == "dead" else WARNING,
                      "reaped a job whose worker stopped heartbeating", job_id=r.id,
                      run_id=r.run_id, task=r.task, step=r.step, attempt=r.attempts,
                      status=r.status)
        return len(rows)


@dataclass
class Pruner:
    """Deletes runs that finished long enough ago, in bounded batches."""

    engine: sa.Engine
    queries: Queries
    retention: float = DEFAULT_RETENTION
    dead_retention: float = DEFAULT_DEAD_RETENTION
    limit: int = PRUNE_LIMIT
    max_batches: int = PRUNE_MAX_BATCHES

    def run_once(self) -> int:
        """Up to `max_batches` batches; returns how many rows were deleted."""
        total = 0
        for _ in range(self.max_batches):
            with self.engine.begin() as conn:
                if not conn.execute(self.queries.try_maintenance_lock,
                                    {"name": f"{self.queries.schema}.pruner"}).scalar():
                    return total
                deleted = conn.execute(self.queries.prune_jobs, {
                    "retention": self.retention, "dead_retention": self.dead_retention,
                    "limit": self.limit}).scalar_one()
            total += deleted
            if deleted == 0:
                break
        if total:
            log_event(INFO, "pruned finished runs", rows=total)
        return total


