"""Make values a user controls storable before they reach the database, and never raise doing so.

A handler's exception text, a `CancelRun` reason, a `RetryStep(after=...)` or a retry policy's
wait all come from user code, and any of them can be something PostgreSQL refuses: a NUL
character or a lone surrogate in a `text` column, an infinite or astronomically large
interval. One such value must not fail the statement that records it (and with it every
outcome batched beside it), so the worker passes each through here first:

- `storable_text(text)`: NUL written out as `\\x00`, lone surrogates as `\\udcff` escapes,
  capped at `MAX_TEXT_CHARS` (the head and the tail are kept);
- `describe(exc)`: `Type: message`, then the traceback from the first frame outside flowq
  (the worker's and the test kit's frames that called the handler are dropped; the frames
  of flowq calls the handler made, and the whole exception chain, are kept); an exception
  whose `__str__` raises is described by its type name;
- `clamp_delay(seconds)` / `delay_of(after)`: a delay in [0, `MAX_DELAY`] seconds.
"""

from __future__ import annotations

import math
import os
import traceback
from datetime import datetime, timedelta, timezone
from typing import Final

__all__ = ["MAX_DELAY", "MAX_TEXT_CHARS", "clamp_delay", "delay_of", "describe", "first_line",
           "safe_str", "storable_text"]

MAX_TEXT_CHARS: Final = 8000
# The longest wait flowq schedules (a year and a day): a policy or `RetryStep` asking for more
# is clamped to it, so `now() + delay` always fits a timestamptz and a Python datetime.
MAX_DELAY: Final = 366 * 86400.0
# flowq's own source files: the frames `describe` drops from the head of a traceback.
_FLOWQ_DIR: Final = os.path.dirname(os.path.abspath(__file__)) + os.sep


def safe_str(value: object) -> str:
    """`str(value)`, or `<TypeName>` when that raises (an exception's `__str__` can)."""
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except BaseException:  # a hostile __str__ may raise anything, even SystemExit
        return f"<{_type_name(value)}>"


def _type_name(value: object) -> str:
    try:
        return str(type(value).__name__)
    except BaseException:
        return "object"


def storable_text(text: object, limit: int = MAX_TEXT_CHARS) -> str:
    """`text` as PostgreSQL's `text` type stores it: no NUL, valid UTF-8, at most `limit`."""
    s = safe_str(text)
    if "\x00" in s:
        s = s.replace("\x00", "\\x00")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates (e.g. from surrogateescape decoding)
        s = s.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(s) > limit:
        keep = max(0, (limit - 40) // 2)
        s = f"{s[:keep]}\n… [{len(s) - 2 * keep} characters cut] …\n{s[len(s) - keep:]}"
    return s


def describe(exc: BaseException) -> str:
    """`Type: message` first (what `last_error` is read for), then the traceback; storable."""
    head = f"{_type_name(exc)}: {safe_str(exc)}"
    try:
        described = traceback.TracebackException.from_exception(exc)
        _drop_callers(described, set())
        tb = "".join(described.format()).strip()
    except BaseException:
        tb = ""
    return storable_text(f"{head}\n\n{tb}" if tb else head)


def _drop_callers(described: traceback.TracebackException, seen: set[int]) -> None:
    """Drop flowq's frames from the head of each traceback of the chain: what called the
    handler (executor, attempt, tracing, the test kit) tells the reader nothing. A traceback
    that is flowq's only (an error flowq raised before any user code ran) is kept whole."""
    if id(described) in seen:
        return
    seen.add(id(described))
    frames = list(described.stack)
    first = next((i for i, frame in enumerate(frames)
                  if not os.path.abspath(frame.filename).startswith(_FLOWQ_DIR)), 0)
    if first:
        described.stack = traceback.StackSummary.from_list(frames[first:])
    linked = [described.__cause__, described.__context__,
              *(getattr(described, "exceptions", None) or ())]
    for other in linked:
        if other is not None:
            _drop_callers(other, seen)


def first_line(text: object) -> str:
    """The first non-empty line of `text` (an error message); for an exception without a
    message its type name, else ''."""
    for line in safe_str(text).splitlines():
        if line.strip():
            return line.strip()
    return _type_name(text) if isinstance(text, BaseException) else ""


def clamp_delay(seconds: float) -> float:
    """A wait in [0, MAX_DELAY]: negative or NaN means now, beyond the cap means the cap."""
    if math.isnan(seconds) or seconds <= 0:
        return 0.0
    return min(float(seconds), MAX_DELAY)


def delay_of(after: object) -> float:
    """Seconds until `RetryStep(after=...)`: a number of seconds, a timedelta or a datetime
    (naive means UTC); clamped to [0, MAX_DELAY] (infinity is the cap, minus infinity and
    negatives are now). ValueError for anything else, and for NaN, which names no time."""
    if after is None:
        return 0.0
    if isinstance(after, timedelta):
        return clamp_delay(after.total_seconds())
    if isinstance(after, datetime):
        aware = after if after.tzinfo else after.replace(tzinfo=timezone.utc)
        try:
            return clamp_delay((aware - datetime.now(timezone.utc)).total_seconds())
        except (OverflowError, ValueError):
            return MAX_DELAY
    if isinstance(after, bool) or not isinstance(after, int | float):
        raise ValueError(f"RetryStep(after=...) takes seconds, a timedelta or a datetime, "
                         f"not {_type_name(after)}")
    try:
        seconds = float(after)
    except OverflowError:  # an int beyond a float's range
        return MAX_DELAY if after > 0 else 0.0
    # One rule for every number: infinity is clamped like 1e300 (to MAX_DELAY), minus
    # infinity like any negative (at once). Only NaN, which is no time, is refused.
    if math.isnan(seconds):
        raise ValueError("RetryStep(after=nan) is not a delay: pass a number of seconds, a "
                         "timedelta or a datetime")
    return clamp_delay(seconds)
