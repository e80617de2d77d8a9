"""The pruner: deletes whole runs finished more than `retention` ago (default 3 days;
`dead_retention`, default 14 days, for a run with a dead step).

A pass (every `interval`, default 60 s) deletes in batches of at most `limit` runs (default
1000), at most `max_batches` (default 10) per pass, and stops at the first batch that deletes
nothing; whole runs only, so a retained run keeps its history and its idempotency key. Each
batch is its own transaction under the advisory lock `<schema>.pruner`: one pruner at a time
across all workers, and no batch holds its locks for long. `run_once()` is also `flowq prune`.
Each pass also deletes up to `limit` registrations of `flowq.run_waiters` left by a waiter
that died mid-wait (their LISTEN connection is gone).
"""

from __future__ import annotations

import threading
from typing import Final

import sqlalchemy as sa

from flowq.db.sql import Queries
from flowq.worker.config import DEFAULT_DEAD_RETENTION, DEFAULT_PRUNE_INTERVAL, DEFAULT_RETENTION
from flowq.worker.logs import INFO, log_event
from flowq.worker.services import Service

__all__ = ["PRUNE_LIMIT", "PRUNE_MAX_BATCHES", "Pruner"]

PRUNE_LIMIT: Final = 1000
PRUNE_MAX_BATCHES: Final = 10


class Pruner(Service):
    """Deletes runs that finished long enough ago, in bounded batches."""

    name = "pruner"

    def __init__(self, engine: sa.Engine, queries: Queries, *,
                 retention: float = DEFAULT_RETENTION,
                 dead_retention: float = DEFAULT_DEAD_RETENTION, limit: int = PRUNE_LIMIT,
                 max_batches: int = PRUNE_MAX_BATCHES, interval: float = DEFAULT_PRUNE_INTERVAL,
                 first_delay: float | None = None,
                 stopping: threading.Event | None = None) -> None:
        super().__init__(interval=interval, first_delay=first_delay, stopping=stopping)
        self.engine = engine
        self.queries = queries
        self.retention = retention
        self.dead_retention = dead_retention
        self.limit = limit
        self.max_batches = max_batches

    def run_once(self) -> int:
        """Up to `max_batches` batches; returns how many rows were deleted."""
        q = self.queries
        total = 0
        for _ in range(self.max_batches):
            with self.engine.begin() as conn:
                if not conn.execute(q.try_maintenance_lock,
                                    {"name": f"{q.schema}.pruner"}).scalar():
                    return total
                deleted = int(conn.execute(q.prune_jobs, {
                    "retention": self.retention, "dead_retention": self.dead_retention,
                    "limit": self.limit}).scalar_one())
            total += deleted
            if deleted == 0:
                break
        with self.engine.begin() as conn:
            conn.execute(q.prune_waiters, {"limit": self.limit})
        if total:
            log_event(INFO, "pruned finished runs", rows=total)
        return total
