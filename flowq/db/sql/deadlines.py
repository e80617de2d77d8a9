"""Run deadlines (revision 0013): the reaper's pass that cancels runs whose deadline passed.

A run's deadline sits on each of its rows (`flowq.jobs.deadline`, copied to the steps it
creates later); the pass ends the unfinished ones as `flowq runs cancel` does
(`fragments.CANCELLABLE`, `fragments.cancel`), served by the partial index
`jobs_deadline_idx`, which holds only rows with a deadline that a cancellation still changes.
"""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.sql.fragments import S, Statements, cancel, notify_ended_row

__all__ = ["DeadlineStatements"]

# The predicate of `jobs_deadline_idx` (flowq.db.schema), written the same way here so the
# planner can prove the index serves the pass: `CANCELLABLE` spelled out.
EXPIRABLE = ("deadline IS NOT NULL AND status IN ('pending', 'running', 'waiting') "
             "AND NOT cancel_requested")


class DeadlineStatements(Statements):
    """The statements of run deadlines, for one schema."""

    @cached_property
    def cancel_expired_jobs(self) -> TextClause:
        """Cancel the unfinished rows of runs whose deadline passed.

        Up to :limit rows with a deadline before now() that a cancellation still changes,
        oldest deadline first, skipping rows locked by a write in flight (the next pass
        takes them, or the successor it creates, which inherits the deadline; FOR UPDATE
        checks the condition again on a row that changed meanwhile): pending and
        waiting ones end `cancelled` with :error (a format string given the deadline),
        running ones get `cancel_requested`. Returns what changed; a run that ends is
        announced to `flowq.wait_run` (`notify_ended_row`)."""
        return self.sql(f"""
            WITH expired AS (
                SELECT id FROM {S}.jobs
                 WHERE {EXPIRABLE} AND deadline <= now()
                 ORDER BY deadline
                 LIMIT :limit
                 FOR UPDATE SKIP LOCKED
            )
            UPDATE {S}.jobs j
               SET {cancel("format(CAST(:error AS text), j.deadline)")}
              FROM expired e
             WHERE j.id = e.id
            RETURNING j.id, j.run_id, j.task, j.step, j.status, j.deadline,
                      {notify_ended_row("j.status = 'cancelled'")} AS ended""")
