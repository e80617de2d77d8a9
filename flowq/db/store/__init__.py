"""The store: typed verbs over every statement flowq sends, the only place parameters are built.

A `Store` sends through one `flowq.db.runner.Runner` (a dedicated psycopg connection, a
handler's `ctx.session`, a caller's SQLAlchemy connection, a test's) for one schema. Each verb
takes Python values, builds every bind parameter of its statement in one place, and gives
back frozen dataclasses read by column name (`flowq.db.rows.read`). Callers never see a
statement, a bind name, an array parameter or a column position: outside `flowq/db`, nothing
imports `flowq.db.sql` (tests/unit/test_imports.py).

The verbs are grouped by table family, one module each:
- `claims`: the worker's (claims, permits, fenced writes, reaping, checkpoints of a claim);
- `enqueue`: runs and jobs inserted, idempotency and unique keys, signals, batches;
- `runs`: runs and their history as operators read and act on them;
- `queues`, `workers`, `schedules`: the tables of those names outside a claim;
- `durable`: checkpoints, child runs, batches and run waiters;
- `admin`: the database itself and maintenance.
"""

from __future__ import annotations

from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.orm import Session

from flowq.db.runner import runner
from flowq.db.store.admin import AdminVerbs
from flowq.db.store.claims import ClaimVerbs, LimitedClaim, PermittedClaim, QueueControl
from flowq.db.store.durable import DurableVerbs
from flowq.db.store.enqueue import EnqueueVerbs
from flowq.db.store.queues import QueueVerbs
from flowq.db.store.runs import RunVerbs
from flowq.db.store.schedules import ScheduleVerbs
from flowq.db.store.waiters import WaiterVerbs
from flowq.db.store.workers import WorkerVerbs
from flowq.names import DEFAULT_SCHEMA

__all__ = ["LimitedClaim", "PermittedClaim", "QueueControl", "Store"]


class Store(ClaimVerbs, EnqueueVerbs, RunVerbs, QueueVerbs, WorkerVerbs, ScheduleVerbs,
            DurableVerbs, AdminVerbs, WaiterVerbs):
    """flowq's typed verbs on `run`, for the flowq schema `schema`."""

    @classmethod
    def of(cls, conn: psycopg.Connection[Any] | sa.Connection | Session,
           schema: str = DEFAULT_SCHEMA, *, direct: bool = False) -> Store:
        """The store of any connection flowq is handed (`flowq.db.runner.runner`): through
        SQLAlchemy's `execute` unless `direct` (sent on its psycopg connection, prepared,
        when SQLAlchemy already holds a transaction there)."""
        return cls(runner(conn, direct=direct), schema)
