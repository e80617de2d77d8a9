"""Tracing: `jobs.trace_context`, the W3C trace context a job was enqueued under.

A nullable jsonb column (`{"traceparent": ..., "tracestate": ...}`, NULL when the enqueue was
not traced): `flowq.tracing` writes it at enqueue, the worker reads it with the claim and
starts each attempt's span as its child, and a pipeline's later steps copy it from the step
that creates them. Adding a nullable column without a default only changes the catalogue:
no table rewrite, whatever the size of `flowq.jobs`.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from flowq.db.migrations import revision_schema

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("trace_context", JSONB), schema=revision_schema())


def downgrade() -> None:
    op.drop_column("jobs", "trace_context", schema=revision_schema())
