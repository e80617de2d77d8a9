"""Progress and forks: `jobs.progress` and `jobs.forked_from`.

- `progress` (jsonb, NULL until a handler reports any): the latest `ctx.progress(done,
  total, message)` of the row's attempt, `{"done", "total", "message", "at"}`, written by the
  worker's heartbeat (at most once per beat, in the heartbeat's own statement) so that a
  tight loop of `ctx.progress` costs no write of its own.
- `forked_from` (bigint, NULL unless forked): on the first row of a run made by
  `flowq.runs.fork`, the run it was forked from (`flowq runs show` links the two). No
  foreign key: runs are pruned on their own.

Expand-only: two nullable columns without a default change only the catalogue (no table
rewrite, whatever the size of `flowq.jobs`), under a brief ACCESS EXCLUSIVE lock that queues
behind any open transaction on the table, so run it when no long transaction holds
`flowq.jobs` (older code keeps working: it never names the columns). No index is added.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from flowq.db.migrations import revision_schema

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("progress", JSONB), schema=revision_schema())
    op.add_column("jobs", sa.Column("forked_from", sa.BigInteger), schema=revision_schema())


def downgrade() -> None:
    op.drop_column("jobs", "forked_from", schema=revision_schema())
    op.drop_column("jobs", "progress", schema=revision_schema())
