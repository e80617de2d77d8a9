"""flowq.jobs: one row per step of a run, with the claim, reaper, run and prune indexes.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from flowq.db.migrations import revision_schema

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    S = revision_schema()
    op.execute(sa.schema.CreateSequence(sa.Sequence("run_id_seq", schema=S)))
    op.create_table(
        "jobs",
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
        sa.Column("run_id", sa.BigInteger, nullable=False,
                  server_default=sa.text(f"nextval('{S}.run_id_seq'::regclass)")),
        sa.Column("task", sa.Text, nullable=False),
        sa.Column("step", sa.Text, nullable=False),
        sa.Column("step_index", sa.SmallInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("queue", sa.Text, nullable=False, server_default=sa.text("'default'")),
        sa.Column("status", sa.Text, nullable=False, server_default=sa.text("'pending'")),
        sa.Column("priority", sa.SmallInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("max_attempts", sa.Integer, nullable=False, server_default=sa.text("10")),
        sa.Column("args", postgresql.JSONB, nullable=False,
                  server_default=sa.text("'{}'::jsonb")),
        sa.Column("result", postgresql.JSONB),
        sa.Column("last_error", sa.Text),
        sa.Column("idempotency_key", sa.Text),
        sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("run_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.Column("locked_at", sa.DateTime(timezone=True)),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True)),
        sa.Column("locked_by", sa.Text),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'succeeded', 'dead', 'cancelled')",
            name="jobs_status_check",
        ),
        sa.CheckConstraint("attempts >= 0 AND max_attempts >= 1", name="jobs_attempts_check"),
        schema=S,
    )
    op.execute(f"ALTER SEQUENCE {S}.run_id_seq OWNED BY {S}.jobs.run_id")
    op.create_index("jobs_pending_idx", "jobs", ["queue", "priority", "run_at", "id"],
                    schema=S, postgresql_where=sa.text("status = 'pending'"))
    op.create_index("jobs_running_idx", "jobs", ["heartbeat_at"], schema=S,
                    postgresql_where=sa.text("status = 'running'"))
    op.create_index("jobs_run_id_idx", "jobs", ["run_id"], schema=S)
    op.create_index("jobs_finished_idx", "jobs", ["finished_at"], schema=S,
                    postgresql_where=sa.text("status IN ('succeeded', 'dead', 'cancelled')"))
    op.create_index("jobs_idempotency_key_idx", "jobs", ["idempotency_key"], unique=True,
                    schema=S, postgresql_where=sa.text("idempotency_key IS NOT NULL"))


def downgrade() -> None:
    S = revision_schema()
    op.drop_table("jobs", schema=S)
    op.execute(f"DROP SEQUENCE IF EXISTS {S}.run_id_seq")
