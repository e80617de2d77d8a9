"""The waits' expiry: steps waiting for a signal (`wait_for=`) past their `wait_timeout` are
made runnable, so that they run without the payload and fail with `SignalTimeout` (their
retry policy decides what happens next).

A pass every `interval` (the worker's `reap_interval`, default 10 s) expires up to `limit`
(default 1000) waits, oldest deadline first, and wakes their queues by NOTIFY; so a wait
times out within one interval of its deadline. Like the reaper, a pass takes a
transaction-scoped advisory lock (`<schema>.waits`): one pass at a time across all workers.
`flowq reap` runs one pass too.
"""

from __future__ import annotations

import threading
from typing import Final

import sqlalchemy as sa

from flowq.db.store import Store
from flowq.worker.config import DEFAULT_REAP_INTERVAL
from flowq.worker.logs import WARNING, log_event
from flowq.worker.services import Service

__all__ = ["EXPIRE_LIMIT", "WaitExpirer"]

EXPIRE_LIMIT: Final = 1000


class WaitExpirer(Service):
    """Ends the waits of steps whose signal did not come by their timeout."""

    name = "waits"

    def __init__(self, engine: sa.Engine, schema: str, *, limit: int = EXPIRE_LIMIT,
                 interval: float = DEFAULT_REAP_INTERVAL, first_delay: float | None = None,
                 stopping: threading.Event | None = None) -> None:
        super().__init__(interval=interval, first_delay=first_delay, stopping=stopping)
        self.engine = engine
        self.schema = schema
        self.limit = limit

    def run_once(self) -> int:
        """One pass; returns how many waits timed out (0 if another worker holds the lock)."""
        with self.engine.begin() as conn:
            store = Store.of(conn, self.schema)
            if not store.try_maintenance_lock("waits"):
                return 0
            ids = store.expire_waits(self.limit)
        if ids:
            log_event(WARNING, "steps stopped waiting for their signal (timeout)",
                      job_ids=",".join(str(i) for i in ids))
        return len(ids)
