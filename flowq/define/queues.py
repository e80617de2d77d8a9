"""Queues as configuration: the limits a queue declares, enforced in the claim by every worker.

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

Pausing, resuming and listing queues are operations on the database: `flowq.ops.queues`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

from flowq.errors import ConfigurationError

__all__ = ["MAX_LIMIT", "QueueConfig", "Rate"]

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
