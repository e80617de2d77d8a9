"""flowq.jobs.lease: a fence token taken from a sequence on every claim, never reused.

Every write after a claim checks (id, lease). `attempts` stays the attempt counter and retry
budget only: a release may give an attempt back and `runs retry` resets it, and neither can
make an old claim's write land, because a new claim always draws a new lease.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from flowq.db.migrations import revision_schema

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    S = revision_schema()
    op.execute(sa.schema.CreateSequence(sa.Sequence("lease_seq", schema=S)))
    # Nullable and without a default: adding it rewrites nothing, even on a large table.
    # Rows running at upgrade time have no lease; their (old) worker's writes then match
    # nothing and the reaper requeues them, which an upgrade under load costs anyway.
    op.add_column("jobs", sa.Column("lease", sa.BigInteger), schema=S)
    op.execute(f"ALTER SEQUENCE {S}.lease_seq OWNED BY {S}.jobs.lease")


def downgrade() -> None:
    S = revision_schema()
    op.drop_column("jobs", "lease", schema=S)
    op.execute(f"DROP SEQUENCE IF EXISTS {S}.lease_seq")
