"""Run waiters: `flowq.run_waiters`, who waits for a run's end (`flowq.wait_run`).

One row per wait in progress: the run, a token of that wait and the backend pid of the
waiting process's LISTEN connection. A completion sends the run-end notification only for
runs a row names, so a run nobody waits for costs no NOTIFY. Written and deleted by the
waiter; the pruner deletes the rows of LISTEN connections that no longer exist.

Expand-only: one new, empty table and its primary key; nothing existing is touched. Workers
of the previous release keep notifying every run's end (harmless); waiters of the previous
release do not register, so against workers of this release they find their run by their
fallback poll (every 5 s) instead of a notification: upgrade the processes that call
`wait_run` with the workers.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from flowq.db.migrations import revision_schema

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_waiters",
        sa.Column("run_id", sa.BigInteger, primary_key=True),
        sa.Column("token", sa.Text, primary_key=True),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        schema=revision_schema(),
    )


def downgrade() -> None:
    op.drop_table("run_waiters", schema=revision_schema())
