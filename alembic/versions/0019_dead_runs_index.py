"""Dead runs by run id: `job_history_dead_run_idx`, (run_id) INCLUDE (task, queue), dead rows.

A page of dead runs (`flowq runs list --status dead`, a bulk redrive's `select_dead_runs`)
walks run ids in order and keeps the dead ones. Revision 0018's `job_history_dead_idx` holds
the dead rows by (task, queue), so such a page read every dead row's heap tuple and sorted
them: 100,750 buffers and 0.75 s a page with 10,000,000 retained rows (`flowq bench
--scenario indexes`). This index holds the same rows by run id, with the task and queue
beside them, so the page and `flowq status`'s dead counts are index-only reads of the dead
rows alone.

Expand-only: `job_history_dead_idx` stays (a later contract revision may drop it). A plain
CREATE INDEX on the partitioned table, which builds it on every partition, in the
migration's transaction (`flowq.migrate` applies every revision in one transaction, where
CREATE INDEX CONCURRENTLY cannot run), like 0006 and 0013: it blocks completions' writes to
`job_history` while it reads the table once (0.14 s for 1,000,000 rows, cached), so run it
when the history is small or the workers quiet. Partitions created later (a day's, by
`flowq.db.history`) get it when they are attached.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

from flowq.db.migrations import revision_schema

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    s = revision_schema()
    op.execute(f"CREATE INDEX job_history_dead_run_idx ON {s}.job_history (run_id) "
               "INCLUDE (task, queue) WHERE status = 'dead'")


def downgrade() -> None:
    op.drop_index("job_history_dead_run_idx", table_name="job_history",
                  schema=revision_schema())
