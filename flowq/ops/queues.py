"""Queue operations: pause and resume a queue, and list every queue with its state.

`pause(target, name)` / `resume(target, name)` (and `flowq queues pause|resume NAME`): no
worker claims from a paused queue; running jobs finish. The state lives in the database
(`flowq.queues`), so every worker obeys it. `list_queues(bind)` (and `flowq queues`) shows
every queue with its depth, running count, limits and paused state. What a queue declares in
code (`app.queue(...)`) is `flowq.define.queues`.
"""

from __future__ import annotations

import sqlalchemy as sa

from flowq.db.store import Store
from flowq.db.store.queues import QueueInfo
from flowq.names import DEFAULT_SCHEMA, validate_queue, validate_schema_name
from flowq.ops import binds
from flowq.ops.binds import Bind

__all__ = ["QueueInfo", "list_queues", "pause", "resume"]


def _set_paused(target: Bind, name: str, paused: bool, schema: str) -> bool:
    validate_schema_name(schema)  # before a connection is taken, as it always was
    name = validate_queue(name)
    if isinstance(target, sa.Engine):
        with target.begin() as conn:
            return Store.of(conn, schema).set_queue_paused(name, paused)
    return Store.of(target, schema).set_queue_paused(name, paused)


def pause(target: Bind, name: str, *, schema: str = DEFAULT_SCHEMA) -> bool:
    """Pause queue `name`: no worker claims from it (running jobs finish). In `target`'s
    transaction (an Engine: its own). True if it was not paused already."""
    return _set_paused(target, name, True, schema)


def resume(target: Bind, name: str, *, schema: str = DEFAULT_SCHEMA) -> bool:
    """Resume queue `name`. True if it was paused."""
    return _set_paused(target, name, False, schema)


def list_queues(bind: Bind, *, schema: str = DEFAULT_SCHEMA) -> list[QueueInfo]:
    """Every queue that has jobs or a declaration, by name."""
    validate_schema_name(schema)
    return binds.read(bind, lambda conn: Store.of(conn, schema).list_queues())
