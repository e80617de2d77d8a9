"""Flow control: queue limits and pauses, per-key concurrency, uniqueness, schedules.

- `flowq.queues`: one row per declared queue: a global `concurrency` cap (running jobs across
  every worker), a `rate_limit` of starts per `rate_period` seconds (a token bucket: `tokens`
  left as of `refilled_at`), `paused`, and `keyed` (some task on it limits concurrency per
  key). Declared in code, written by workers at start; pause/resume write `paused` only.
- `jobs.concurrency_key`, `jobs.key_limit`: a job's key (JSON text of the argument it names)
  and how many jobs of that key may run at once in its queue.
- `flowq.uniques`: which run holds a uniqueness key while it is active.
- `flowq.schedules`: each periodic schedule's last enqueued tick and run;
  `jobs.scheduled_at`: the tick a scheduled run runs for (`ctx.scheduled_at`).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from flowq.db.migrations import revision_schema

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    S = revision_schema()
    op.create_table(
        "queues",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("concurrency", sa.Integer),
        sa.Column("rate_limit", sa.Integer),
        sa.Column("rate_period", sa.Float(precision=53)),
        sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("keyed", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("tokens", sa.Float(precision=53)),
        sa.Column("refilled_at", sa.DateTime(timezone=True)),
        sa.Column("declared_at", sa.DateTime(timezone=True)),
        sa.Column("declared_by", sa.Text),
        sa.CheckConstraint("concurrency IS NULL OR concurrency >= 1",
                           name="queues_concurrency_check"),
        sa.CheckConstraint("(rate_limit IS NULL) = (rate_period IS NULL) AND "
                           "(rate_limit IS NULL OR (rate_limit >= 1 AND rate_period > 0))",
                           name="queues_rate_check"),
        schema=S,
    )
    op.add_column("jobs", sa.Column("concurrency_key", sa.Text), schema=S)
    op.add_column("jobs", sa.Column("key_limit", sa.Integer), schema=S)
    op.add_column("jobs", sa.Column("scheduled_at", sa.DateTime(timezone=True)), schema=S)
    op.create_table(
        "uniques",
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("run_id", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        schema=S,
    )
    # The pruner deletes the keys of the runs it prunes.
    op.create_index("uniques_run_id_idx", "uniques", ["run_id"], schema=S)
    op.create_table(
        "schedules",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("task", sa.Text, nullable=False),
        sa.Column("spec", sa.Text, nullable=False),
        sa.Column("last_tick", sa.DateTime(timezone=True)),
        sa.Column("last_run_id", sa.BigInteger),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        schema=S,
    )


def downgrade() -> None:
    S = revision_schema()
    op.drop_table("schedules", schema=S)
    op.drop_table("uniques", schema=S)
    op.drop_column("jobs", "scheduled_at", schema=S)
    op.drop_column("jobs", "key_limit", schema=S)
    op.drop_column("jobs", "concurrency_key", schema=S)
    op.drop_table("queues", schema=S)
