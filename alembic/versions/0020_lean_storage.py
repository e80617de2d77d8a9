"""Fewer bytes of WAL per job: `jobs` filled to half its pages; a redundant history index goes.

Measured with `pg_walinspect` over a drain of no-op jobs (claim a batch, complete it): each
job wrote six B-tree entries (`jobs`: primary key, run id, running; `job_history`: primary
key, run id, finish time), about 66 bytes of WAL each, and its claim, which cannot be a HOT
update (it changes `status`, in the predicate of the partial indexes), wrote its new row
version on another page about half the time: the whole tuple in the WAL record, and a
second lock record on the old version while PostgreSQL looked for room.

- `jobs` gets `fillfactor = 50` (in `JOBS_STORAGE_PARAMETERS`): an enqueue fills a page to half, so the
  claim writes its new version beside the old one (one page, the record compressed to the
  columns that changed, no second lock record), and the completion's DELETE leaves room
  that page pruning gives back. The price is a backlog's heap twice as large: `jobs` holds
  live rows only (revision 0018). Applies to pages written from now on; nothing is rewritten.
- `job_history_dead_idx` (dead rows by task, queue) goes: revision 0019's
  `job_history_dead_run_idx` holds the same rows with task and queue beside the run id, and
  serves every reader of dead rows (index-only); a dead row paid for both.

Not done: `job_history_finished_idx` as a BRIN (one B-tree entry less per job, ~64 bytes of
WAL): over `flowq bench --scenario indexes` data, whose rows are not written in time order,
the planner reads whole day partitions for `flowq status`' completions and the dashboard's
activity instead.

Online: the previous release reads these tables with the same statements; its readers of
dead rows are served by `job_history_dead_run_idx`. A worker of a release before 0018 keeps
finished rows in `jobs` and never reads `job_history`. Catalog changes only: nothing is read
or rewritten.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from flowq.db.migrations import revision_schema

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

# Frozen here (a migration never changes); flowq.db.schema.JOBS_STORAGE_PARAMETERS mirrors it.
_FILLFACTOR = "50"


def upgrade() -> None:
    s = revision_schema()
    op.execute(f'ALTER TABLE "{s}".jobs SET (fillfactor = {_FILLFACTOR})')
    op.drop_index("job_history_dead_idx", table_name="job_history", schema=s)


def downgrade() -> None:
    s = revision_schema()
    op.create_index("job_history_dead_idx", "job_history", ["task", "queue"], schema=s,
                    postgresql_where=sa.text("status = 'dead'"))
    op.execute(f'ALTER TABLE "{s}".jobs RESET (fillfactor)')
