"""Checkpoints: `flowq.checkpoints`, what a step recorded inside its handler.

One row per (run, step, map instance, name): the stored result of a `ctx.checkpoint(...)`
(returned without calling its function again when the step's handler runs again), a durable
`ctx.sleep` (its deadline) and a step's snooze count (`flowq.snoozes`). `map_index` is -1
outside a mapped step, so that the key is a plain primary key. Older workers never read it.
The pruner deletes a run's rows with the run.

Expand-only: one new, empty table and its primary key; nothing existing is touched.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from flowq.db.migrations import revision_schema

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("run_id", sa.BigInteger, primary_key=True),
        sa.Column("step", sa.Text, primary_key=True),
        sa.Column("map_index", sa.Integer, primary_key=True),
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("result", JSONB, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        schema=revision_schema(),
    )


def downgrade() -> None:
    op.drop_table("checkpoints", schema=revision_schema())
