"""Join shards: the instances of a large map count down on several rows, not one.

- `flowq.join_shards` (run_id, step, parent, shard) -> remaining: the instance counters of a
  map of `flowq.worker.graph.SHARDED_MAP_ITEMS` items or more (see `flowq.db.schema`). A
  completing instance updates its shard's row; only the one that brings a shard to zero
  updates the join's row in `flowq.joins`, so a map of `ctx.session` instances (each
  committed in its own transaction) no longer queues every completion on one row lock.
- `flowq.workers.capabilities` (text[], NULL for a worker of an earlier release): a map is
  counted in shards only while every registered worker says `join_shards`, since a worker of
  the previous release would count an instance on the join's row directly.

Expand-only: a new table, and a nullable column without a default on the small
`flowq.workers` table (a catalogue change, no rewrite). The previous release keeps working:
it never names either, and the maps it starts are counted as before by both releases.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY

from flowq.db.migrations import revision_schema

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "join_shards",
        sa.Column("run_id", sa.BigInteger, primary_key=True),
        sa.Column("step", sa.Text, primary_key=True),
        sa.Column("parent", sa.Text, primary_key=True),
        sa.Column("shard", sa.SmallInteger, primary_key=True),
        sa.Column("remaining", sa.Integer, nullable=False),
        schema=revision_schema(),
    )
    op.add_column("workers", sa.Column("capabilities", ARRAY(sa.Text)),
                  schema=revision_schema())


def downgrade() -> None:
    op.drop_column("workers", "capabilities", schema=revision_schema())
    op.drop_table("join_shards", schema=revision_schema())
