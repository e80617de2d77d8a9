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

__all__ = ["MAX_LIMIT", "MAX_PERIOD", "MAX_RATE", "MIN_PERIOD", "QueueConfig", "Rate"]

# Limits are stored as PostgreSQL integers.
MAX_LIMIT: Final = 2**31 - 1
# A rate's period, in seconds, is stored as float8 and the claim refills the bucket with
# `elapsed * limit / period` (float8), then takes `floor(tokens)::int`. Each bound keeps that
# arithmetic finite and in range, so no declaration can make every claim of its queue fail:
# - MIN_PERIOD, 1 ms: a denormal period (1e-320) overflows the division; below a millisecond
#   the claim's own duration is longer than the period, so a limit there limits nothing.
# - MAX_PERIOD, 366 days (the longest wait flowq schedules, `flowq.storable.MAX_DELAY`): a
#   refill of a microsecond's elapsed time stays above float8's precision at any limit.
# - MAX_RATE, a million starts per second (`limit / period`): a claim's `now()` is its
#   transaction's start, so it can be earlier than the refill written by a claim it waited
#   for (or than a clock that stepped back); at this rate the bucket stays within `int` for a
#   lag of over half an hour (2**31 / 1e6 s). No flowq queue starts that many jobs a second,
#   so a faster rate limits nothing: declare no rate_limit.
MIN_PERIOD: Final = 0.001
MAX_PERIOD: Final = 366 * 86400.0
MAX_RATE: Final = 1_000_000


@dataclass(frozen=True)
class Rate:
    """`limit` starts per `per` (seconds or a timedelta), e.g. `Rate(100, per=timedelta(minutes=1))`.

    `limit` is an integer in [1, MAX_LIMIT], `per` in [MIN_PERIOD, MAX_PERIOD] seconds (1 ms
    to 366 days), and `limit / per` at most MAX_RATE starts per second; anything else is
    refused with `ConfigurationError` when the rate is created."""

    limit: int
    per: float | timedelta = 1.0

    def __post_init__(self) -> None:
        if (isinstance(self.limit, bool) or not isinstance(self.limit, int)
                or not 1 <= self.limit <= MAX_LIMIT):
            raise ConfigurationError(f"a rate limit must allow at least 1 start (at most "
                                     f"{MAX_LIMIT}), got {_shown(self.limit)}")
        seconds = self.seconds
        if not (math.isfinite(seconds) and MIN_PERIOD <= seconds <= MAX_PERIOD):
            raise ConfigurationError(
                f"a rate's period must be a positive number of seconds from {MIN_PERIOD} "
                f"(1 ms) to {MAX_PERIOD:.0f} (366 days), got {_shown(self.per)}")
        # A little slack for float rounding: Rate(1000, per=0.001) is a million a second.
        if self.limit > MAX_RATE * seconds * (1 + 1e-9):
            raise ConfigurationError(
                f"Rate({self.limit!r}, per={self.per!r}) allows {self.limit / seconds:,.0f} "
                f"starts per second, more than the at most {MAX_RATE:,} a rate limit can "
                f"enforce: lower the limit, lengthen the period, or declare no rate_limit")

    @property
    def seconds(self) -> float:
        per = self.per
        if isinstance(per, timedelta):
            return per.total_seconds()
        if isinstance(per, bool) or not isinstance(per, int | float):
            raise ConfigurationError(f"a rate's period must be seconds or a timedelta, got "
                                     f"{per!r}")
        try:
            return float(per)
        except OverflowError:  # an int beyond a float's range
            return math.inf


def _shown(value: object) -> str:
    """`repr(value)`, cut short: a 400-digit integer is named, not printed."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}… ({len(text)} characters)"


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
                f"most {MAX_LIMIT}), got {_shown(c)}")
        if self.rate_limit is not None and not isinstance(self.rate_limit, Rate):
            raise ConfigurationError(
                f"rate_limit of queue {self.name!r} must be a flowq.Rate(limit, per=...)")
