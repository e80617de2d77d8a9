"""The statements of `flowq.run_waiters`: who waits for a run's end (`flowq.wait_run`).

A waiter registers (run, token, pid of its process's LISTEN connection) after its LISTEN is
up and before it reads the run, and deletes its row when it returns: a completion whose
statement began after the registration committed announces the run's end
(`fragments.notify_ended`), and one that began before it is seen by the waiter's read or by
its next one, soon after (`flowq.ops.results.RECHECK`). The pruner deletes the rows whose
LISTEN connection is gone (a waiter killed mid-wait).
"""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.sql.fragments import S, Statements

__all__ = ["WaiterStatements"]


class WaiterStatements(Statements):
    """The statements of `flowq.run_waiters`, for one schema."""

    @cached_property
    def register_waiter(self) -> TextClause:
        """Record that wait :token, on LISTEN connection :pid, waits for run :run_id.

        Idempotent (a re-registration after the LISTEN connection changed moves it to the
        new :pid), so a waiter may send it on every pass of its loop."""
        return self.sql(f"""
            INSERT INTO {S}.run_waiters (run_id, token, pid)
            VALUES (CAST(:run_id AS bigint), CAST(:token AS text), CAST(:pid AS int))
            ON CONFLICT (run_id, token) DO UPDATE SET pid = EXCLUDED.pid""")

    @cached_property
    def unregister_waiter(self) -> TextClause:
        """Delete the registration of wait :token for run :run_id (it returned)."""
        return self.sql(f"""
            DELETE FROM {S}.run_waiters
             WHERE run_id = CAST(:run_id AS bigint) AND token = CAST(:token AS text)""")

    @cached_property
    def prune_waiters(self) -> TextClause:
        """Delete the registrations whose LISTEN connection no longer exists; returns how many.

        A waiter killed mid-wait leaves its row; once its connection's backend is gone (no
        row of that pid in `pg_stat_activity`) nobody can hear the notification it asked
        for. At most :limit rows per call."""
        return self.sql(f"""
            WITH gone AS (
                SELECT w.run_id, w.token FROM {S}.run_waiters w
                 WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = w.pid)
                 LIMIT :limit
            ), deleted AS (
                DELETE FROM {S}.run_waiters w USING gone
                 WHERE w.run_id = gone.run_id AND w.token = gone.token
                RETURNING 1)
            SELECT count(*) FROM deleted""")
