"""The verbs of the database itself and of maintenance: schema checks, locks, clocks, health."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from flowq.db.rows import read, read_one
from flowq.db.store.base import Verbs

__all__ = ["AdminVerbs", "Backend", "DeadTaskCount", "LongTransaction", "TableHealth"]


@dataclass(frozen=True)
class TableHealth:
    """`flowq.jobs`' statistics, sizes and settings, and its pending index (`table_health`)."""

    n_live_tup: int | None
    n_dead_tup: int | None
    vacuum_age_s: float | None
    analyze_age_s: float | None
    table_bytes: int | None
    heap_bytes: int | None
    reloptions: list[str] | None
    row_width: float | None
    pending_index_bytes: int | None
    pending_index_entries: float | None
    pending: int | None


@dataclass(frozen=True)
class LongTransaction:
    """Another session whose transaction is old and holds back the xmin horizon."""

    pid: int
    application_name: str
    usename: str
    state: str
    age_s: float
    xmin_age: int | None
    query: str


@dataclass(frozen=True)
class Backend:
    """This session's server process, its port, the autovacuum setting, and whether the
    server is a standby in recovery."""

    pid: int
    port: int | None
    autovacuum: str
    in_recovery: bool


@dataclass(frozen=True)
class DeadTaskCount:
    """How many dead jobs a task has."""

    task: str
    jobs: int


class AdminVerbs(Verbs):
    """The database and maintenance."""

    def try_maintenance_lock(self, service: str) -> bool:
        """Take the transaction-scoped advisory lock `<schema>.<service>` of a maintenance
        service, or not (another pass holds it): one pass at a time across all workers."""
        return bool(self.run(self.q.try_maintenance_lock,
                             {"name": f"{self.schema}.{service}"})[0][0])

    def end_backend(self, pid: int) -> None:
        """Terminate server process `pid` (an abandoned attempt's connection, whose open
        transaction would hold its row locks until its stuck handler returns)."""
        self.run(self.q.end_backend, {"pid": pid})

    def schema_exists(self) -> bool:
        """Whether the schema's jobs table exists: a query that cannot fail, so a missing
        schema is reported before an INSERT would abort the caller's transaction."""
        return self.run(self.q.check_schema, {})[0][0] is not None

    def now(self) -> datetime:
        """The database's clock as of the transaction's start (`now()`)."""
        value: datetime = self.run(self.q.select_now, {})[0][0]
        return value

    def clock(self) -> float:
        """The database's wall clock (`clock_timestamp()`), as seconds since the epoch."""
        return float(self.run(self.q.select_clock, {})[0][0])

    def lock_maintenance_shared(self, service: str) -> None:
        """Wait for `service`'s lock in shared mode until the transaction ends: a pass under
        way is waited for, and one that tries the lock meanwhile does nothing."""
        self.run(self.q.lock_maintenance_shared, {"name": f"{self.schema}.{service}"})

    def lead_metrics(self, name: str, pid: int) -> tuple[bool, int]:
        """Whether this session collects the queue metrics (it is backend `pid`, which took
        the session lock `name`, or it takes it now), and its backend pid."""
        [(leads, backend)] = self.run(self.q.lock_metrics_collector, {"name": name, "pid": pid})
        return bool(leads), int(backend)

    def set_statement_timeout(self, ms: int) -> None:
        """Bound every statement of the current transaction to `ms` milliseconds."""
        self.run(self.q.set_statement_timeout, {"ms": ms})

    def table_health(self) -> TableHealth | None:
        """`flowq.jobs`' statistics and its pending index (None: no such table)."""
        return read_one(TableHealth, self.run(self.q.select_table_health, {}))

    def long_transactions(self, min_age: float) -> list[LongTransaction]:
        """Other sessions whose transaction began more than `min_age` seconds ago and holds
        back the xmin horizon, oldest first, up to 10."""
        return read(LongTransaction, self.run(self.q.select_long_transactions, {"age": min_age}))

    def backend(self) -> Backend:
        """This session's backend (pid, server port), autovacuum, and recovery state."""
        found = read_one(Backend, self.run(self.q.select_backend, {}))
        assert found is not None  # a SELECT without FROM: always one row
        return found

    def send_probe(self, channel: str, payload: str) -> None:
        """NOTIFY `channel` with `payload` (the doctor's LISTEN round trip)."""
        self.run(self.q.send_probe, {"channel": channel, "payload": payload})

    def dead_by_task(self, limit: int) -> list[DeadTaskCount]:
        """Dead jobs by task, most first, up to `limit` tasks."""
        return read(DeadTaskCount, self.run(self.q.select_dead_by_task, {"limit": limit}))
