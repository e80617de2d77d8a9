"""The enqueue options: the one list, with their types, that every signature forwarding them uses.

`EnqueueOptions` is a TypedDict, so a function taking `**options: Unpack[EnqueueOptions]` is
checked by a type checker like one spelling the nine keywords out (`Task.options`,
`Pipeline.options`, `flowq.enqueueing.prepare.prepare_enqueue`). What each option means, and how
it is checked, is `flowq.enqueue`'s (see `flowq.enqueueing.sync.enqueue`); every one is
optional, and one left out means its default:

- `idempotency_key` (None): names the run; a second enqueue with it returns the first run;
- `queue` (None: the first step's), `priority` (None: the pipeline's, lower first);
- `run_at` (an aware datetime) or `delay` (seconds or a timedelta): not due before then;
- `deadline` (None: the task's or pipeline's default, else none): an aware datetime, or
  seconds or a timedelta from the enqueue, after which the run's unfinished steps are
  cancelled (`flowq.DeadlineExceeded`);
- `schema` (None: the task's app's, else "flowq"): the flowq schema;
- `unique` (False) / `unique_key` (None): one active run per task and arguments, or per key.

`RESERVED_OPTIONS` is the same list as names: a handler may not take a parameter named like
one (enqueue would take it as the option), which `flowq.define.step` checks at definition.
It lives here, under the definitions, because they need it; enqueue imports it from here.

The time rules live here too, once, for every option and default that is a time: a due
time or deadline is an aware datetime between `MIN_RUN_AT` and `MAX_RUN_AT`
(`as_time`); a duration is finite seconds or a timedelta that keeps it in that range from
now (`as_interval`); a deadline is also in the future (`check_deadline`).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from typing import Final, TypedDict

from flowq.errors import InvalidArgumentsError

__all__ = ["MAX_RUN_AT", "MIN_RUN_AT", "RESERVED_OPTIONS", "EnqueueOptions", "as_interval",
           "as_time", "check_deadline"]

# The due times accepted (run_at, or the database's now() plus delay), and deadlines: what
# PostgreSQL's timestamptz and Python's datetime (years 1-9999) can both hold, with two days
# to spare so that psycopg can read them back in any session time zone (an offset is under
# a day) and a duration checked on this machine's clock still fits on the database's.
MIN_RUN_AT: Final = datetime(1, 1, 3, tzinfo=timezone.utc)
MAX_RUN_AT: Final = datetime(9999, 12, 30, tzinfo=timezone.utc)
_RANGE: Final = f"between {MIN_RUN_AT.date()} and {MAX_RUN_AT.date()} UTC"


class EnqueueOptions(TypedDict, total=False):
    """Options of one enqueue (`flowq.enqueue`'s keywords besides the handler's arguments)."""

    idempotency_key: str | None
    queue: str | None
    priority: int | None
    run_at: datetime | None
    delay: float | timedelta | None
    deadline: datetime | float | timedelta | None
    schema: str | None
    unique: bool
    unique_key: str | None


RESERVED_OPTIONS: Final[frozenset[str]] = frozenset(EnqueueOptions.__optional_keys__)


def as_time(value: object, what: str) -> datetime:
    """`value` as a point in time the database can hold, or one sentence why not."""
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgumentsError(
            f"{what} must be a timezone-aware datetime (e.g. datetime.now(timezone.utc)), "
            f"got {value!r}")
    # Compared as aware datetimes: no conversion to UTC, which could itself overflow.
    if not MIN_RUN_AT <= value <= MAX_RUN_AT:
        raise InvalidArgumentsError(f"{what} must be {_RANGE}, got {value!r}")
    return value


def as_interval(value: object, what: str, lands: str = "make the job due") -> timedelta:
    """`value` (seconds or a timedelta) as a timedelta that, added to now, the database can
    hold, or one sentence why not. `lands` says what the duration does, for that sentence."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise InvalidArgumentsError(f"{what} must be a finite number of seconds, got {value!r}")
        try:
            interval = timedelta(seconds=value)
        except OverflowError:
            interval = timedelta.max if value > 0 else timedelta.min  # refused just below
    elif isinstance(value, timedelta):
        interval = value
    else:
        raise InvalidArgumentsError(f"{what} must be seconds (a number) or a timedelta, "
                                    f"got {value!r}")
    if interval:
        now = datetime.now(timezone.utc)  # the database's clock adds it; the margin covers skew
        if not MIN_RUN_AT - now <= interval <= MAX_RUN_AT - now:
            raise InvalidArgumentsError(f"{what} must {lands} {_RANGE}, got {value!r}")
    return interval


def check_deadline(value: object, what: str = "deadline", *,
                   absolute: bool = True) -> datetime | timedelta:
    """A run's deadline: an aware datetime in the future (when `absolute`), or a positive
    duration from the enqueue; one sentence why not. Zero or less would cancel the run
    before it could start, which is never what was meant."""
    if isinstance(value, datetime):
        if not absolute:
            raise InvalidArgumentsError(
                f"{what} must be seconds (a number) or a timedelta: a default deadline "
                f"counts from each enqueue, got {value!r}")
        when = as_time(value, what)
        if when <= datetime.now(timezone.utc):
            raise InvalidArgumentsError(f"{what} {value!r} has already passed: the run would "
                                        "be cancelled before it could start")
        return when
    interval = as_interval(value, what, "end the run")
    if interval <= timedelta(0):
        raise InvalidArgumentsError(f"{what} must be a positive duration, got {value!r}: the "
                                    "run would be cancelled before it could start")
    return interval
