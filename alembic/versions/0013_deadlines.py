"""Run deadlines and batches: `flowq.jobs.deadline` and its partial index; `flowq.batches`.

- `deadline` (timestamptz, nullable, no default): when the run's unfinished steps are
  cancelled (NULL: never). Adding a nullable column without a default changes the catalog
  only (no table rewrite). Workers of the previous release neither read nor write it: their
  enqueues and the steps they create carry no deadline (a run started by the new release
  whose later step an older worker creates loses its deadline from that step on).
- `jobs_deadline_idx` (deadline) on the rows with a deadline that a cancellation still
  changes (active, not yet asked to stop): the deadline pass reads only those. Built with a
  plain CREATE INDEX in the migration's transaction, like 0006's `jobs_dead_idx`:
  `flowq.migrate` applies every revision in one transaction under its advisory lock, where
  CREATE INDEX CONCURRENTLY cannot run. It blocks writes to `flowq.jobs` while it reads the
  table once, a second or two per million rows (the new column is all NULL, so the index
  itself starts empty).

- `flowq.batches`, `flowq.batch_runs` and `batch_id_seq` (new, empty): `session.batch()`'s
  runs and the callback enqueued once they have all finished (flowq.db.schema says how).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from flowq.db.migrations import revision_schema

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    S = revision_schema()
    op.add_column("jobs", sa.Column("deadline", sa.DateTime(timezone=True)), schema=S)
    op.create_index("jobs_deadline_idx", "jobs", ["deadline"], schema=S,
                    postgresql_where=sa.text(
                        "deadline IS NOT NULL AND status IN ('pending', 'running', 'waiting') "
                        "AND NOT cancel_requested"))
    op.execute(sa.schema.CreateSequence(sa.Sequence("batch_id_seq", schema=S)))
    op.create_table(
        "batches",
        sa.Column("id", sa.BigInteger, primary_key=True),
        sa.Column("task", sa.Text, nullable=False),
        sa.Column("step", sa.Text, nullable=False),
        sa.Column("queue", sa.Text, nullable=False),
        sa.Column("priority", sa.SmallInteger, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("args", JSONB, nullable=False),
        sa.Column("runs", sa.Integer, nullable=False),
        sa.Column("succeeded", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("dead", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("cancelled", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.Column("fired_at", sa.DateTime(timezone=True)),
        sa.Column("callback_run_id", sa.BigInteger),
        schema=S,
    )
    op.create_index("batches_open_idx", "batches", ["id"], schema=S,
                    postgresql_where=sa.text("fired_at IS NULL"))
    op.create_index("batches_fired_idx", "batches", ["fired_at"], schema=S,
                    postgresql_where=sa.text("fired_at IS NOT NULL"))
    op.create_table(
        "batch_runs",
        sa.Column("batch_id", sa.BigInteger, primary_key=True),
        sa.Column("run_id", sa.BigInteger, primary_key=True),
        schema=S,
    )


def downgrade() -> None:
    S = revision_schema()
    op.drop_table("batch_runs", schema=S)
    op.drop_index("batches_fired_idx", table_name="batches", schema=S)
    op.drop_index("batches_open_idx", table_name="batches", schema=S)
    op.drop_table("batches", schema=S)
    op.execute(sa.schema.DropSequence(sa.Sequence("batch_id_seq", schema=S)))
    op.drop_index("jobs_deadline_idx", table_name="jobs", schema=S)
    op.drop_column("jobs", "deadline", schema=S)
