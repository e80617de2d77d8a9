"""`flowq.workers`: the registry of live workers."""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.schema import CAPABILITIES
from flowq.db.sql.fragments import S, Statements

__all__ = ["WorkerStatements"]

# What this release's code understands of the shared tables, as an SQL array's items.
_CAPABILITIES = ", ".join(f"'{c}'" for c in CAPABILITIES)


class WorkerStatements(Statements):
    """The statements of `flowq.workers`, for one schema."""

    @cached_property
    def register_worker(self) -> TextClause:
        """Register a worker in the registry (or refresh it).

        Register worker :name (or refresh it, if it exists: a restart under the same name),
        with what this release's code understands of the shared tables (`capabilities`)."""
        return self.sql(f"""
            INSERT INTO {S}.workers (name, host, pid, queues, tasks, concurrency, version,
                                     capabilities)
            VALUES (:name, :host, :pid, CAST(:queues AS text[]), CAST(:tasks AS text[]),
                    :concurrency, :version, ARRAY[{_CAPABILITIES}])
            ON CONFLICT (name) DO UPDATE
               SET host = excluded.host, pid = excluded.pid, queues = excluded.queues,
                   tasks = excluded.tasks, concurrency = excluded.concurrency,
                   version = excluded.version, capabilities = excluded.capabilities,
                   started_at = now(), heartbeat_at = now()""")

    @cached_property
    def beat_worker(self) -> TextClause:
        """Refresh a worker's heartbeat in the registry.

        Refresh worker :name's heartbeat; no row when it expired (then register again)."""
        return self.sql(f"""
            UPDATE {S}.workers SET heartbeat_at = now() WHERE name = :name RETURNING name""")

    @cached_property
    def unregister_worker(self) -> TextClause:
        """Remove a worker from the registry (a clean stop).

        Remove worker :name (a clean stop)."""
        return self.sql(f"DELETE FROM {S}.workers WHERE name = :name")

    @cached_property
    def expire_workers(self) -> TextClause:
        """Remove workers whose heartbeat expired.

        Remove workers whose heartbeat is older than :stale seconds (they died)."""
        return self.sql(f"""
            DELETE FROM {S}.workers
             WHERE heartbeat_at < now() - make_interval(secs => :stale) RETURNING name""")

    @cached_property
    def select_unserved_jobs(self) -> TextClause:
        """Group the due jobs that no live worker serves.

        Due jobs that no live worker (heartbeat within :stale seconds) serves: none listens
        on their queue with their task in its app. Up to :limit (queue, task) groups, largest
        first. Scans the pending jobs: for an operator's eyes, not a hot path."""
        return self.sql(f"""
            SELECT j.queue, j.task, count(*) AS n,
                   extract(epoch FROM now() - min(j.run_at))::float8 AS oldest_s
              FROM {S}.jobs j
             WHERE j.status = 'pending' AND j.run_at <= now()
               AND NOT EXISTS (
                   SELECT 1 FROM {S}.workers w
                    WHERE j.queue = ANY(w.queues) AND j.task = ANY(w.tasks)
                      AND w.heartbeat_at >= now() - make_interval(secs => :stale))
             GROUP BY j.queue, j.task ORDER BY count(*) DESC LIMIT :limit""")

    @cached_property
    def select_live_workers(self) -> TextClause:
        """List the workers whose heartbeat is recent.

        The registered workers whose heartbeat is younger than :stale seconds, by name."""
        return self.sql(f"""
            SELECT name, host, pid, queues, concurrency, version, started_at,
                   -- now() is the transaction's start: a beat committed since is younger
                   GREATEST(extract(epoch FROM now() - heartbeat_at), 0)::float8
                       AS heartbeat_age_s
              FROM {S}.workers
             WHERE heartbeat_at >= now() - make_interval(secs => :stale)
             ORDER BY name""")
