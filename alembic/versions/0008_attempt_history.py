"""Attempt history: `jobs.started_at` and `jobs.attempt_log`.

- `started_at` (timestamptz): when the row's latest attempt started, kept from the claim's
  `locked_at` by the statements that end an attempt (success, retry, dead, cancelled, reaped),
  which clear the claim columns. It costs no write of its own: those statements rewrite the
  row anyway. The dashboard's charts read started-per-minute and pickup delay from it.
- `attempt_log` (jsonb, NULL until an attempt fails): the attempts that failed before the
  row's current one, appended by the fenced retry and end statements and by the reaper, each
  `{"attempt", "started_at", "finished_at", "worker", "error"}`, the error cut to
  `flowq.db.sql.fragments.ATTEMPT_ERROR_CHARS` and the list to the latest
  `ATTEMPT_LOG_LENGTH` entries. A step whose first attempt succeeds never writes it.

Expand-only: two nullable columns without a default change only the catalogue (no table
rewrite, whatever the size of `flowq.jobs`), under a brief ACCESS EXCLUSIVE lock that queues
behind any open transaction on the table, so run it when no long transaction holds
`flowq.jobs` (older code keeps working: it never names the columns). No index is added.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from flowq.db.migrations import revision_schema

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("started_at", sa.DateTime(timezone=True)),
                  schema=revision_schema())
    op.add_column("jobs", sa.Column("attempt_log", JSONB), schema=revision_schema())


def downgrade() -> None:
    op.drop_column("jobs", "attempt_log", schema=revision_schema())
    op.drop_column("jobs", "started_at", schema=revision_schema())
