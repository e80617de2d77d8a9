"""Queue permits: `flowq.permits`, what each worker holds of a limited queue's concurrency.

A queue with only a `concurrency` limit is claimed under permits that a worker leases in
batches (one short transaction under the queue's row lock) instead of locking the queue's
row on every claim; see `flowq.db.sql.permits`. The table is new: older workers never read it
and keep claiming the limited way, counting running jobs under the queue's lock. They do not
count the permits newer workers hold: while both releases serve a limited queue, it can run
more than its limit by the permits not yet used (docs/queues.md says to stop the older
workers of limited queues first).

Expand-only: one new, empty table and its primary key; nothing existing is touched.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from flowq.db.migrations import revision_schema

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "permits",
        sa.Column("queue", sa.Text, primary_key=True),
        sa.Column("worker", sa.Text, primary_key=True),
        sa.Column("held", sa.Integer, nullable=False),
        sa.Column("concurrency", sa.Integer, nullable=False),
        sa.Column("leased_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.CheckConstraint("held >= 0", name="permits_held_check"),
        schema=revision_schema(),
    )


def downgrade() -> None:
    op.drop_table("permits", schema=revision_schema())
