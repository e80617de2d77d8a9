"""Child runs: `flowq.children`, which run a step started with `ctx.start_child`.

One row per child run (its run id, the primary key), naming its parent: the parent's run,
step and map instance (`map_index` -1 outside a mapped step, as in `flowq.checkpoints`), that
step's job row (the one its retries and suspensions keep: what the completion ending the
child makes due, by primary key) and the checkpoint that started it (`flowq.child.N`). Written in the transaction that enqueues the
child and records that checkpoint; read by `ctx.wait`, by the cancel of a run (its children,
recursively) and by `flowq runs show`. The pruner deletes a run's rows (as a parent) with the
run. Older workers never read it.

Expand-only: one new, empty table, its primary key and an index on the parent; nothing
existing is touched.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from flowq.db.migrations import revision_schema

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "children",
        sa.Column("run_id", sa.BigInteger, primary_key=True),
        sa.Column("parent_run_id", sa.BigInteger, nullable=False),
        sa.Column("parent_step", sa.Text, nullable=False),
        sa.Column("parent_map_index", sa.Integer, nullable=False),
        sa.Column("parent_job_id", sa.BigInteger, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        schema=revision_schema(),
    )
    op.create_index("children_parent_idx", "children", ["parent_run_id"],
                    schema=revision_schema())


def downgrade() -> None:
    op.drop_table("children", schema=revision_schema())
