"""flowq.workers: the live workers, each registered at start and heartbeating.

What each worker serves (queues, the tasks its app defines) is what `flowq runs list` needs to
say which due jobs no live worker serves. Entries of dead workers expire (the reaper deletes
them).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from flowq.db.migrations import revision_schema

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("queues", postgresql.ARRAY(sa.Text), nullable=False),
        sa.Column("tasks", postgresql.ARRAY(sa.Text), nullable=False),
        sa.Column("concurrency", sa.Integer, nullable=False),
        sa.Column("version", sa.Text, nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        schema=revision_schema(),
    )


def downgrade() -> None:
    op.drop_table("workers", schema=revision_schema())
