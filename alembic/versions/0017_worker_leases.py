"""Worker leases: `flowq.workers.leases`, the claims a worker's entry keeps alive.

A worker's heartbeat writes its own registry entry, with the leases of the claims it holds,
instead of updating every job it holds; the reaper takes a running job for alive while its
own `heartbeat_at` is recent, or its worker's entry is recent and lists its lease. A claim
the worker does not know it holds (a claim whose result never reached it, a completion the
server acknowledged and then lost in a crash) is not listed, so it is reaped as before.

Expand-only: one nullable column; nothing existing is touched. Workers of the previous
release leave it NULL and beat each job as before; while one is registered, workers of this
release beat each job too (their reaper reads the jobs' own heartbeats only).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY

from flowq.db.migrations import revision_schema

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("leases", ARRAY(sa.BigInteger)),
                  schema=revision_schema())


def downgrade() -> None:
    op.drop_column("workers", "leases", schema=revision_schema())
