"""Run filters: which runs `list_runs` lists and `retry_runs` redrives.

`task` (the run's task or pipeline name), `queue` (a run matches if any of its steps is on
it), and `since`/`until` on the run's creation (its first row's `created_at`), each an aware
datetime, a timedelta (that long before the database's `now()`, read once), or text: an ISO
8601 time (one without an offset is this machine's local time, as the CLI prints times) or a
duration ago such as `90s`, `30m`, `1h`, `2d`, `1w`, `1h30m` (`parse_when`). A run is in
the window when `since <= created < until`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from flowq.db.store import Store
from flowq.db.store.runs import RunWindow
from flowq.errors import ConfigurationError, InvalidArgumentsError
from flowq.names import validate_name, validate_queue

__all__ = ["RunFilters", "When", "check_count", "parse_when", "run_filters"]

When = datetime | timedelta | str
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_WHEN_HELP: Final = ("an ISO 8601 time (2024-05-01, 2024-05-01T10:00, 2024-05-01T10:00+02:00) "
                     "or a duration ago such as 90s, 30m, 1h, 2d, 1w, 1h30m")


def parse_when(text: str) -> datetime | timedelta:
    """`since`/`until` text: a duration ago (`30m`, `1h30m`: a timedelta) or an ISO 8601 time
    (an aware datetime; without an offset, this machine's local time). InvalidArgumentsError
    otherwise."""
    compact = text.strip().replace(" ", "").lower()
    if compact and _DURATION.sub("", compact) == "":
        try:
            return timedelta(seconds=sum(float(n) * _UNITS[u]
                                         for n, u in _DURATION.findall(compact)))
        except OverflowError:
            raise InvalidArgumentsError(f"{text!r} is too long ago") from None
    iso = text.strip()
    if iso.endswith(("Z", "z")):  # Python 3.10's fromisoformat knows no "Z"
        iso = iso[:-1] + "+00:00"
    try:
        at = datetime.fromisoformat(iso)
    except ValueError:
        raise InvalidArgumentsError(f"cannot read {text!r} as a time: give {_WHEN_HELP}"
                                    ) from None
    return at if at.tzinfo is not None else at.astimezone()


def _when(what: str, value: When | None) -> datetime | timedelta | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = parse_when(value)
    if isinstance(value, timedelta):
        if value < timedelta(0):
            raise InvalidArgumentsError(f"{what} must be a duration ago of at least 0, "
                                        f"got {value!r}")
        return value
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise InvalidArgumentsError(
                f"{what} must be a timezone-aware datetime (or a timedelta ago), got {value!r}")
        return value
    raise InvalidArgumentsError(f"{what} must be a datetime, a timedelta or text ({_WHEN_HELP}), "
                                f"got {value!r}")


@dataclass(frozen=True)
class RunFilters:
    """Checked filters; `window` resolves them, reading the clock for durations ago."""

    task: str | None
    queue: str | None
    since: datetime | timedelta | None
    until: datetime | timedelta | None
    version: int | None = None  # the pipeline version the runs started on (revision 0014)

    def window(self, store: Store) -> RunWindow:
        """The runs they select; durations ago are measured on the database's clock."""
        since, until = self.since, self.until
        if isinstance(since, timedelta) or isinstance(until, timedelta):
            now = store.now()
            try:
                since = now - since if isinstance(since, timedelta) else since
                until = now - until if isinstance(until, timedelta) else until
            except OverflowError:
                raise InvalidArgumentsError("since/until is too long ago") from None
        if since is not None and until is not None and since >= until:
            raise InvalidArgumentsError(
                f"since ({since.isoformat()}) is not before until ({until.isoformat()}): no "
                "run can match")
        # A version is a number per pipeline: its runs are those of the fingerprints
        # recorded under it (`flowq.definitions`), none if none is.
        fingerprints = (None if self.version is None
                        else store.version_fingerprints(self.version, self.task))
        return RunWindow(task=self.task, queue=self.queue, since=since, until=until,
                         fingerprints=fingerprints)


def run_filters(task: str | None, queue: str | None, since: When | None,
             until: When | None, version: int | None = None) -> RunFilters:
    """Check the filters (InvalidArgumentsError naming the wrong one)."""
    if version is not None:
        version = check_count("version", version, 1)
    if task is not None:
        try:
            validate_name("task", task)
        except ConfigurationError as exc:
            raise InvalidArgumentsError(str(exc)) from None
    return RunFilters(task=task, queue=None if queue is None else validate_queue(queue),
                    since=_when("since", since), until=_when("until", until), version=version)


def check_count(what: str, value: object, minimum: int) -> int:
    """`value` if it is an integer of at least `minimum`, else InvalidArgumentsError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentsError(f"{what} must be an integer of at least {minimum}, "
                                    f"got {value!r}")
    return value
