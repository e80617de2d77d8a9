"""Queue operations: pause and resume a queue, and list every queue with its state.

`pause(target, name)` / `resume(target, name)` (and `flowq queues pause|resume NAME`): no
worker claims from a paused queue; running jobs finish. The state lives in the database
(`flowq.queues`), so every worker obeys it. `list_queues(bind)` (and `flowq queues`) shows
every queue with its depth, running count, limits and paused state. What a queue declares in
code (`app.queue(...)`) is `flowq.define.queues`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import sqlalchemy as sa

from flowq.db.sql import queries
from flowq.names import DEFAULT_SCHEMA, validate_queue
from flowq.ops import binds
from flowq.ops.binds import Bind

__all__ = ["QueueInfo", "list_queues", "pause", "resume"]


@dataclass(frozen=True)
class QueueInfo:
    """One line of `list_queues`: a queue's jobs by state, its limits and whether it is paused."""

    name: str
    pending: int  # due now
    scheduled: int  # pending, due later
    waiting: int
    running: int
    dead: int
    oldest_due_s: float | None
    concurrency: int | None
    rate_limit: int | None
    rate_period_s: float | None
    paused: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _set_paused(target: Bind, name: str, paused: bool, schema: str) -> bool:
    q = queries(schema)
    params = {"name": validate_queue(name), "paused": paused}
    if isinstance(target, sa.Engine):
        with target.begin() as conn:
            return bool(conn.execute(q.set_queue_paused, params).scalar())
    return bool(target.execute(q.set_queue_paused, params).scalar())


def pause(target: Bind, name: str, *, schema: str = DEFAULT_SCHEMA) -> bool:
    """Pause queue `name`: no worker claims from it (running jobs finish). In `target`'s
    transaction (an Engine: its own). True if it was not paused already."""
    return _set_paused(target, name, True, schema)


def resume(target: Bind, name: str, *, schema: str = DEFAULT_SCHEMA) -> bool:
    """Resume queue `name`. True if it was paused."""
    return _set_paused(target, name, False, schema)


def list_queues(bind: Bind, *, schema: str = DEFAULT_SCHEMA) -> list[QueueInfo]:
    """Every queue that has jobs or a declaration, by name."""
    q = queries(schema)

    def read(conn: sa.Connection) -> list[QueueInfo]:
        return [QueueInfo(**r._mapping) for r in conn.execute(q.list_queues)]

    return binds.read(bind, read)
