"""The reaper: requeues running jobs whose heartbeat is older than `stale_after` (default
30 s), unless their worker's registry entry (`flowq.workers`, named by `locked_by`; the
worker's heartbeat beats it) is younger and lists their lease: their worker died (or does
not know it holds them); and cancels the runs whose
deadline passed. The registry's expiry removes entries by the same limit
(`flowq.db.sql.fragments.stale`).

The lost attempt counts, so a job that kills every worker it lands on ends `dead`; a job
whose run was cancelled meanwhile ends `cancelled`. With the defaults (a pass every 10 s), a
job whose worker died is running again well within 60 s. At most `limit` (default 1000) jobs
per pass, their queues woken by NOTIFY.

Each pass also ends the runs whose `deadline=` passed (`flowq.DeadlineExceeded`): at most
`limit` of their unfinished rows, oldest deadline first, are cancelled as `flowq runs
cancel` does (pending, waiting and sleeping steps end `cancelled`; running ones are asked to
stop and their handler sees `ctx.cancelled` at its worker's next heartbeat). So a deadline
fires within one reaper interval (default 10 s) of passing.

And each pass counts the runs of `session.batch()` blocks that finished (at most `limit`)
and enqueues the callback of every batch whose runs have all finished, once
(`flowq.enqueueing.batch`).

A pass takes the transaction-scoped advisory lock `<schema>.reaper`, so across all workers
one pass runs at a time (no leader to elect; a pass that finds the lock taken does nothing).
`run_once()` is also `flowq reap`.
"""

from __future__ import annotations

import threading
from typing import Final

import sqlalchemy as sa

from flowq.db.store import Store
from flowq.errors import DeadlineExceeded
from flowq.worker.config import DEFAULT_REAP_INTERVAL, DEFAULT_STALE_AFTER
from flowq.worker.logs import ERROR, INFO, WARNING, log_event
from flowq.worker.services import Service

__all__ = ["DEADLINE_ERROR", "REAP_LIMIT", "Reaper"]

REAP_LIMIT: Final = 1000
# The last_error of a step its run's deadline cancelled (`%s`: the deadline, in SQL).
DEADLINE_ERROR: Final = f"DeadlineExceeded: {DeadlineExceeded().args[0]} (deadline %s)"


class Reaper(Service):
    """Requeues or buries jobs whose worker stopped heartbeating; cancels expired runs."""

    name = "reaper"

    def __init__(self, engine: sa.Engine, schema: str, *,
                 stale_after: float = DEFAULT_STALE_AFTER, limit: int = REAP_LIMIT,
                 interval: float = DEFAULT_REAP_INTERVAL, first_delay: float | None = None,
                 stopping: threading.Event | None = None) -> None:
        super().__init__(interval=interval, first_delay=first_delay, stopping=stopping)
        self.engine = engine
        self.schema = schema
        self.stale_after = stale_after
        self.limit = limit

    def run_once(self) -> int:
        """One pass; returns how many jobs were reaped or cancelled by their run's deadline,
        plus the batch callbacks enqueued (0 if another worker holds the lock)."""
        with self.engine.begin() as conn:
            # Through SQLAlchemy, in the lock's transaction.
            store = Store.of(conn, self.schema)
            if not store.try_maintenance_lock("reaper"):
                return 0
            rows = store.reap(self.stale_after, self.limit)
            expired = store.expire_deadlines(DEADLINE_ERROR, self.limit)
            store.advance_batches(self.limit)
            fired = store.start_batch_callbacks(self.limit)
        for r in rows:
            log_event(ERROR if r.status == "dead" else WARNING,
                      "reaped a job whose worker stopped heartbeating", job_id=r.id,
                      run_id=r.run_id, task=r.task, step=r.step, attempt=r.attempts,
                      status=r.status)
        for e in expired:
            log_event(WARNING, "run deadline passed: step cancelled" if e.status == "cancelled"
                      else "run deadline passed: running handler asked to stop", job_id=e.id,
                      run_id=e.run_id, task=e.task, step=e.step, status=e.status,
                      deadline=e.deadline.isoformat())
        for f in fired:
            log_event(INFO, "batch finished: callback enqueued", batch_id=f.id,
                      run_id=f.callback_run_id, runs=f.runs, succeeded=f.succeeded,
                      dead=f.dead, cancelled=f.cancelled)
        return len(rows) + len(expired) + len(fired)
