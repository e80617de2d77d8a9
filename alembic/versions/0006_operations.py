"""Operations: per-table autovacuum settings for a queue table, and an index of dead jobs.

- `flowq.jobs` gets autovacuum and analyze settings suited to a queue table (every row is
  inserted, updated two or three times and deleted; the table swings between empty and a
  burst): vacuum after 1% of the rows changed (and after 1% inserted), analyze after 2%, and
  no cost delay, so dead tuples are cleared while they are few and the planner never keeps
  the statistics of a table "analyzed empty" for long. `flowq doctor` checks they are in place.
- `jobs_dead_idx` (task, queue) on the dead jobs only: `flowq status` counts dead jobs by task
  and by queue without reading the retained finished rows. Built with a plain CREATE INDEX
  (in the migration's transaction): it blocks writes to `flowq.jobs` while it reads the
  table once, a second or two per million rows.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from flowq.db.migrations import revision_schema

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# Frozen here (a migration never changes); flowq.db.schema.JOBS_STORAGE_PARAMETERS mirrors it.
_SETTINGS = {
    "autovacuum_vacuum_scale_factor": "0.01",
    "autovacuum_vacuum_insert_scale_factor": "0.01",
    "autovacuum_analyze_scale_factor": "0.02",
    "autovacuum_vacuum_cost_delay": "0",
}


def upgrade() -> None:
    S = revision_schema()
    settings = ", ".join(f"{k} = {v}" for k, v in _SETTINGS.items())
    op.execute(f'ALTER TABLE "{S}".jobs SET ({settings})')
    op.create_index("jobs_dead_idx", "jobs", ["task", "queue"], schema=S,
                    postgresql_where=sa.text("status = 'dead'"))


def downgrade() -> None:
    S = revision_schema()
    op.drop_index("jobs_dead_idx", table_name="jobs", schema=S)
    op.execute(f'ALTER TABLE "{S}".jobs RESET ({", ".join(_SETTINGS)})')
