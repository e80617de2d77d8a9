"""Workflows: DAG joins, map instances, signals and the `waiting` status.

- `jobs.map_index`: the item position of one instance of a mapped step (NULL otherwise).
- `jobs.joined`: the row was created by a join (see `flowq.joins`): its arguments are the
  static parents' results, and the results of mapped parents are collected when it runs.
- `jobs.status` may be `waiting`: a step waiting for a signal, until `run_at` (its timeout).
- `flowq.joins`: one counter per join step of a run, decremented by the transaction that
  completes each parent (or map instance): the one that reaches zero creates the step.
- `flowq.signals`: one row per (run, signal name): the payload once sent, and the step once
  reached. Sender and step meet on its primary key, so neither can miss the other.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from flowq.db.migrations import revision_schema

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_OLD_STATUSES = "status IN ('pending', 'running', 'succeeded', 'dead', 'cancelled')"
_NEW_STATUSES = "status IN ('pending', 'running', 'succeeded', 'dead', 'cancelled', 'waiting')"


def upgrade() -> None:
    S = revision_schema()
    # Nullable, or with a constant default: adding them rewrites nothing.
    op.add_column("jobs", sa.Column("map_index", sa.Integer), schema=S)
    op.add_column("jobs", sa.Column("joined", sa.Boolean, nullable=False,
                                    server_default=sa.false()), schema=S)
    op.drop_constraint("jobs_status_check", "jobs", schema=S)
    op.create_check_constraint("jobs_status_check", "jobs", _NEW_STATUSES, schema=S)
    op.create_index("jobs_waiting_idx", "jobs", ["run_at"], schema=S,
                    postgresql_where=sa.text("status = 'waiting'"))
    op.create_table(
        "joins",
        sa.Column("run_id", sa.BigInteger, primary_key=True),
        sa.Column("step", sa.Text, primary_key=True),
        sa.Column("parents", sa.Integer, nullable=False),
        sa.Column("remaining", sa.Integer, nullable=False),
        sa.Column("inputs", postgresql.JSONB, nullable=False,
                  server_default=sa.text("'{}'::jsonb")),
        schema=S,
    )
    op.create_table(
        "signals",
        sa.Column("run_id", sa.BigInteger, primary_key=True),
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("payload", postgresql.JSONB),
        sa.Column("sent_at", sa.DateTime(timezone=True)),
        sa.Column("step", sa.Text),
        sa.Column("timeout_s", sa.Float(precision=53)),
        sa.Column("reached_at", sa.DateTime(timezone=True)),
        schema=S,
    )


def downgrade() -> None:
    S = revision_schema()
    op.drop_table("signals", schema=S)
    op.drop_table("joins", schema=S)
    op.drop_index("jobs_waiting_idx", "jobs", schema=S)
    op.execute(f"UPDATE {S}.jobs SET status = 'pending' WHERE status = 'waiting'")
    op.drop_constraint("jobs_status_check", "jobs", schema=S)
    op.create_check_constraint("jobs_status_check", "jobs", _OLD_STATUSES, schema=S)
    op.drop_column("jobs", "joined", schema=S)
    op.drop_column("jobs", "map_index", schema=S)
