"""Queues as configuration: global limits enforced in the claim, and pause/resume.

Declare a queue's limits in code, beside its tasks::

    app.queue("emails", concurrency=5, rate_limit=flowq.Rate(100, per=timedelta(minutes=1)))

- `concurrency`: at most that many jobs of the queue run at once, across every worker
  process and host.
- `rate_limit`: at most `Rate.limit` starts per `Rate.per`, across every worker (a token
  bucket holding at most `limit` tokens: a burst of `limit`, then `limit` per period).

A worker writes its app's declarations to `flowq.queues` when it starts (the last worker to
start wins when two disagree: deploy one declaration), and every worker re-reads the table
every poll interval, so all of them enforce what the table says. Limits are enforced by
PostgreSQL in the claim: a claim on a limited queue locks the queue's row, counts what is
running (in a new snapshot, after the lock), and claims at most what is left, so concurrent
workers can never over-admit. A queue without limits is claimed as before, with one primary
key lookup to check it has none. Jobs waiting on a limit stay `pending`: they burn no attempt
and need no heartbeat.

`pause(target, name)` / `resume(target, name)` (and `flowq queues pause|resume NAME`): no
worker claims from a paused queue; running jobs finish. The state lives in the database.
`list_queues(bind)` (and `flowq queues`) shows every queue with its depth, running count,
limits and paused state.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Final

import sqlalchemy as sa

from flowq.db.schema import DEFAULT_SCHEMA
from flowq.db.sql import queries
from flowq.errors import ConfigurationError

__all__ = ["QueueConfig", "QueueInfo", "Rate", "list_queues", "pause", "resume"]

Bind = sa.Engine | sa.Connection
# Limits are stored as PostgreSQL integers.
MAX_LIMIT: Final = 2**31 - 1


@dataclass(frozen=True)
class Rate:
    """`limit` starts per `per` (seconds or a timedelta), e.g. `Rate(100, per=timedelta(minutes=1))`."""

    limit: int
    per: float | timedelta = 1.0

    def __post_init__(self) -> None:
        if (isinstance(self.limit, bool) or not isinstance(self.limit, int)
                or not 1 <= self.limit <= MAX_LIMIT):
            raise ConfigurationError(f"a rate limit must allow at least 1 start (at most "
                                     f"{MAX_LIMIT}), got {self.limit!r}")
        if not math.isfinite(self.seconds) or self.seconds <= 0:
            raise ConfigurationError(f"a rate's period must be positive, got {self.per!r}")

    @property
    def seconds(self) -> float:
        per = self.per
        if isinstance(per, timedelta):
            return per.total_seconds()
        if isinstance(per, bool) or not isinstance(per, int | float):
            raise ConfigurationError(f"a rate's period must be seconds or a timedelta, got "
                                     f"{per!r}")
        return float(per)


@dataclass(frozen=True)
class QueueConfig:
    """A queue as declared with `FlowQ.queue`."""

    name: str
    concurrency: int | None = None
    rate_limit: Rate | None = None

    def __post_init__(self) -> None:
        c = self.concurrency
        if c is not None and (isinstance(c, bool) or not isinstance(c, int)
                              or not 1 <= c <= MAX_LIMIT):
            raise ConfigurationError(
                f"concurrency of queue {self.name!r} must be an integer of at least 1 (and at "
                f"most {MAX_LIMIT}), got {c!r}")
        if self.rate_limit is not None and not isinstance(self.rate_limit, Rate):
            raise ConfigurationError(
                f"rate_limit of queue {self.name!r} must be a flowq.Rate(limit, per=...)")


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


def _name(name: object) -> str:
    from flowq.app import validate_queue  # flowq.app imports this module

    return validate_queue(name)


def _set_paused(target: Bind, name: str, paused: bool, schema: str) -> bool:
    q = queries(schema)
    params = {"name": _name(name), "paused": paused}
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

    if isinstance(bind, sa.Engine):
        with bind.connect() as conn:
            return read(conn)
    return read(bind)
