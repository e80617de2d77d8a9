"""Periodic schedules: what `@app.periodic(...)` defines, and which ticks are due when.

A `Schedule` names a task or pipeline, the arguments every run of it gets, and when it ticks:

- `cron="*/5 * * * *"`: a cron expression (5 fields: minute hour day-of-month month
  day-of-week; or 6 with seconds first; or `@hourly`, `@daily`, `@midnight`, `@weekly`,
  `@monthly`, `@yearly`, `@annually`), evaluated in `timezone` (an IANA name, default
  "UTC") by cronsim, with Debian cron's rules across DST changes: a time skipped when
  clocks go forward fires at the first instant after the gap, a time that occurs twice when
  they go back fires once; a job with `*` or a step in its minute or hour field fires at
  every matching instant of real time.
- `every=timedelta(...)`: at least 1 s; the ticks are the multiples of it since 1970-01-01
  00:00 UTC, so every worker computes the same instants (`every=timedelta(hours=1)` fires
  on the hour, UTC). It takes no timezone: use `cron` for wall-clock times.

`name` (default: the task's or pipeline's name) identifies the schedule in the database and
in each tick's idempotency key (`flowq:schedule:<name>:<tick in UTC>`); it is unique per app.
`args` (default none) must be JSON and fit the first step, checked when the schedule is
defined (or, for a pipeline that has no steps yet, when a worker starts).

Which ticks run (`Schedule.due_ticks`): a pass sees the ticks after the schedule's cursor (the
last tick enqueued; for a schedule seen for the first time, that moment: no backfill) up to
now. By default the latest of them runs, and with it every other one less than `LATE_GRACE`
(10 s) old: those are merely late (a slow pass, a worker restarting), not missed. Older ones
were missed (every worker was down) and are skipped. With `catch_up=True` all of them run,
oldest first, at most `MAX_TICKS_PER_PASS` (1000) per pass (the next pass goes on from there).
"""

from __future__ import annotations

import math
import zoneinfo
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone, tzinfo
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar

from cronsim import CronSim, CronSimError

from flowq.errors import ConfigurationError, FlowqError, NaiveDatetimeError
from flowq.jsonargs import JSONError, dumps_checked
from flowq.names import validate_name, validate_priority

__all__ = ["KEY_PREFIX", "LATE_GRACE", "MAX_TICKS_PER_PASS", "MIN_EVERY", "Schedulable",
           "Schedule", "make_schedule", "utc"]

DEFAULT_TIMEZONE: Final = "UTC"
MIN_EVERY: Final = timedelta(seconds=1)
# A tick found within this of its time is late, not missed: it runs even without catch_up.
LATE_GRACE: Final = timedelta(seconds=10)
# How many ticks of one schedule a pass enqueues at most (catch-up of a long outage).
MAX_TICKS_PER_PASS: Final = 1000
KEY_PREFIX: Final = "flowq:schedule:"

UTC: Final = timezone.utc
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND: Final = timedelta(microseconds=1)
_ALIASES: Final = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
                   "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
                   "@hourly": "0 * * * *"}
# How far back `latest_tick` looks at first, then further: each window is scanned forward
# (cronsim's reverse iteration disagrees with its forward one around DST changes).
_LOOKBACK: Final = (timedelta(minutes=1), timedelta(hours=1), timedelta(days=1),
                    timedelta(days=32), timedelta(days=400))


class Schedulable(Protocol):
    """What a schedule needs of the task or pipeline it enqueues (a `Pipeline`, which
    imports this module through the app): its name, priority and steps, and the checks an
    enqueue of a tick would make."""

    @property
    def name(self) -> str: ...

    @property
    def priority(self) -> int: ...

    @property
    def steps(self) -> Sequence[object]: ...

    def check_start_arguments(self, args: dict[str, Any], what: str = ...) -> None: ...

    def key_of(self, args: dict[str, Any]) -> str | None: ...


if TYPE_CHECKING:
    # A bare `Schedule` is `Schedule[Any]` (see flowq.define.pipeline for the default);
    # the app's are `Schedule[Pipeline]`.
    from typing_extensions import TypeVar as TypeVarWithDefault

    D = TypeVarWithDefault("D", bound=Schedulable, default=Any)
else:
    D = TypeVar("D", bound=Schedulable)


def utc(moment: datetime, what: str = "a time") -> datetime:
    if not isinstance(moment, datetime) or moment.utcoffset() is None:
        raise NaiveDatetimeError(f"{what} must be a timezone-aware datetime, got {moment!r}")
    return moment.astimezone(UTC)


@dataclass(frozen=True, eq=False)
class Schedule(Generic[D]):
    """A periodic schedule of a task or pipeline (see the module docstring)."""

    name: str
    definition: D
    cron: str | None
    every: timedelta | None
    args: dict[str, Any]
    timezone: str
    catch_up: bool
    _zone: tzinfo = field(repr=False)
    _expr: str = field(default="", repr=False)  # `cron` with its alias expanded

    @property
    def task(self) -> str:
        return self.definition.name

    @property
    def spec(self) -> str:
        """When it ticks, for people: `*/5 * * * * (Europe/Paris)`, `every 30s`."""
        if self.every is not None:
            return f"every {_interval(self.every)}"
        return f"{self.cron} ({self.timezone})"

    def key(self, tick: datetime) -> str:
        """The idempotency key of the run of `tick`: one run per tick, whoever enqueues it."""
        stamp = utc(tick).isoformat().replace("+00:00", "Z")
        return f"{KEY_PREFIX}{self.name}:{stamp}"

    def _after(self, after: datetime) -> Iterator[datetime]:
        """The ticks strictly after `after`, in UTC, oldest first (ends if there are none)."""
        after = utc(after)
        if self.every is not None:
            step = self.every // _MICROSECOND
            k = (after - _EPOCH) // _MICROSECOND // step + 1
            while True:
                try:
                    yield _EPOCH + _MICROSECOND * (k * step)
                except OverflowError:
                    return
                k += 1
        # cronsim works in wall-clock time: from a start inside a repeated hour it may give an
        # instant before the start (it drops the fold), so those are skipped.
        try:
            for tick in CronSim(self._expr, after.astimezone(self._zone)):
                tick = tick.astimezone(UTC)
                if tick > after:
                    yield tick
        except OverflowError:  # past year 9999
            return

    def next_tick(self, after: datetime) -> datetime | None:
        """The first tick strictly after `after` (UTC), or None if it never ticks again."""
        return next(self._after(after), None)

    def ticks(self, after: datetime, until: datetime,
              limit: int = MAX_TICKS_PER_PASS) -> list[datetime]:
        """The ticks t with `after` < t <= `until`, oldest first, at most `limit` of them."""
        until = utc(until)
        found: list[datetime] = []
        for tick in self._after(after):
            if tick > until or len(found) >= limit:
                break
            found.append(tick)
        return found

    def latest_tick(self, after: datetime, until: datetime) -> datetime | None:
        """The latest tick t with `after` < t <= `until`, or None."""
        after, until = utc(after), utc(until)
        if until <= after:
            return None
        if self.every is not None:
            step = self.every // _MICROSECOND
            tick = _EPOCH + _MICROSECOND * ((until - _EPOCH) // _MICROSECOND // step * step)
            return tick if tick > after else None
        for window in (*_LOOKBACK, None):
            start = after if window is None or until - window <= after else until - window
            last = None
            for tick in self._after(start):
                if tick > until:
                    break
                last = tick
            if last is not None or start == after:
                return last
        return None  # pragma: no cover - the last window starts at `after`

    def due_ticks(self, after: datetime, now: datetime) -> list[datetime]:
        """The ticks a pass at `now` enqueues when the cursor is `after`: the latest due one
        and every other one less than `LATE_GRACE` old (with `catch_up`, every due one,
        oldest first, at most `MAX_TICKS_PER_PASS`)."""
        after, now = utc(after), utc(now)
        if self.catch_up:
            return self.ticks(after, now)
        recent = self.ticks(max(after, now - LATE_GRACE), now)
        if recent:
            return recent
        latest = self.latest_tick(after, now)
        return [] if latest is None else [latest]

    def check(self) -> None:
        """Raise ConfigurationError unless the arguments fit the step(s) a run of the
        definition starts with (for a pipeline, once it has steps), and give it a valid
        concurrency key and priority: what an enqueue of a tick would refuse."""
        if not self.definition.steps:
            raise ConfigurationError(
                f"schedule {self.name!r}: pipeline {self.task!r} has no steps")
        try:
            validate_priority(self.definition.priority)
            self.definition.check_start_arguments(self.args, f"arguments for {self.task!r}")
            self.definition.key_of(self.args)
        except FlowqError as exc:
            raise ConfigurationError(f"schedule {self.name!r}: {exc}") from None


def _interval(every: timedelta) -> str:
    seconds = every.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _zone(name: object, schedule: str) -> tzinfo:
    if not isinstance(name, str):
        raise ConfigurationError(
            f"timezone of schedule {schedule!r} must be an IANA name such as 'Europe/Paris', "
            f"got {name!r}")
    if name == "UTC":
        return UTC  # cronsim's fast path, and the same instants
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
        raise ConfigurationError(
            f"timezone {name!r} of schedule {schedule!r} is not a known IANA time zone (e.g. "
            f"'UTC', 'Europe/Paris', 'America/New_York'): {exc}") from None


def _cron(expr: object, zone: tzinfo, schedule: str) -> str:
    if not isinstance(expr, str):
        raise ConfigurationError(f"cron of schedule {schedule!r} must be a string such as "
                                 f"'*/5 * * * *', got {expr!r}")
    expanded = _ALIASES.get(expr.strip().lower(), expr)
    try:
        first = next(CronSim(expanded, datetime.now(zone)), None)
    except CronSimError as exc:
        raise ConfigurationError(
            f"cron expression {expr!r} of schedule {schedule!r} is not valid ({exc}): use 5 "
            "fields, minute hour day-of-month month day-of-week (e.g. '*/5 * * * *'), 6 with "
            "seconds first, or @hourly, @daily, @weekly, @monthly, @yearly") from None
    if first is None:
        raise ConfigurationError(
            f"cron expression {expr!r} of schedule {schedule!r} never fires")
    return expanded


def _every(every: object, schedule: str) -> timedelta:
    if isinstance(every, int | float) and not isinstance(every, bool):
        if not math.isfinite(every):
            raise ConfigurationError(f"every of schedule {schedule!r} must be finite, "
                                     f"got {every!r}")
        every = timedelta(seconds=every)
    if not isinstance(every, timedelta):
        raise ConfigurationError(f"every of schedule {schedule!r} must be a timedelta (or "
                                 f"seconds), got {every!r}")
    if every < MIN_EVERY:
        raise ConfigurationError(
            f"every of schedule {schedule!r} must be at least {MIN_EVERY.total_seconds():g} "
            f"second, got {every!r}"
            + (" (zero or negative)" if every <= timedelta(0) else ""))
    return every


def make_schedule(definition: D, *, cron: str | None, every: timedelta | float | None,
                  name: str | None, args: Mapping[str, Any] | None, timezone: str,
                  catch_up: bool) -> Schedule[D]:
    """Validate a schedule's options (not its arguments: `Schedule.check`)."""
    schedule = validate_name("schedule", definition.name if name is None else name)
    if (cron is None) == (every is None):
        raise ConfigurationError(
            f"schedule {schedule!r} needs exactly one of cron='*/5 * * * *' or "
            "every=timedelta(...)" + (", not both" if cron is not None else ""))
    if not isinstance(catch_up, bool):
        raise ConfigurationError(f"catch_up of schedule {schedule!r} must be True or False")
    zone = _zone(timezone, schedule)
    if every is not None and timezone != DEFAULT_TIMEZONE:
        raise ConfigurationError(
            f"schedule {schedule!r}: timezone applies to cron schedules; every= ticks are "
            "multiples of the interval since 1970-01-01 UTC (for wall-clock times use cron, "
            "e.g. cron='0 9 * * *', timezone=...)")
    if args is None:
        args = {}
    if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
        raise ConfigurationError(f"args of schedule {schedule!r} must be a dict of keyword "
                                 f"arguments, got {args!r}")
    try:
        dumps_checked(dict(args), "args")
    except JSONError as exc:
        raise ConfigurationError(f"args of schedule {schedule!r}: {exc}") from None
    return Schedule(
        name=schedule, definition=definition, cron=cron if every is None else None,
        every=None if every is None else _every(every, schedule), args=dict(args),
        timezone=timezone, catch_up=catch_up, _zone=zone,
        _expr="" if cron is None else _cron(cron, zone, schedule))
