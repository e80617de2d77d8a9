"""Deploys: `jobs.fingerprint`, `workers.definitions` and the table `flowq.definitions`.

- `jobs.fingerprint` (text, NULL for runs enqueued before this revision or by name without
  the definition): the fingerprint of the definition a run started under
  (`flowq.define.shape`), written by enqueue and copied by completion to the steps it creates.
- `workers.definitions` (jsonb, NULL for an earlier release's worker): what each live worker
  serves, `{pipeline: [{"version": N, "fingerprint": F}, ...]}`, written by `register_worker`.
- `flowq.definitions`: one row per fingerprint ever served (`fingerprint` primary key,
  `pipeline`, `version`, `shape` jsonb, `first_seen`), written once at worker start: the
  deploy check compares new code with the shape the runs in flight started under even after
  the workers of that code stopped.

Expand-only: two nullable columns without a default change only the catalogue (no table
rewrite, whatever the size of `flowq.jobs`), under a brief ACCESS EXCLUSIVE lock that queues
behind any open transaction on the table; one new, empty table. No index on `flowq.jobs`:
the deploy check reads the active rows through the partial indexes of their statuses. Older
code never names the new columns (its runs have no fingerprint: they continue on the newest
version that has their step).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from flowq.db.migrations import revision_schema

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = revision_schema()
    op.add_column("jobs", sa.Column("fingerprint", sa.Text), schema=schema)
    op.add_column("workers", sa.Column("definitions", JSONB), schema=schema)
    op.create_table(
        "definitions",
        sa.Column("fingerprint", sa.Text, primary_key=True),
        sa.Column("pipeline", sa.Text, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("shape", JSONB, nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        schema=schema,
    )


def downgrade() -> None:
    schema = revision_schema()
    op.drop_table("definitions", schema=schema)
    op.drop_column("workers", "definitions", schema=schema)
    op.drop_column("jobs", "fingerprint", schema=schema)
