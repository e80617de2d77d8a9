"""Deprecated: `flowq.schedules` was split into `flowq.define.schedules` (KEY_PREFIX, LATE_GRACE,
MAX_TICKS_PER_PASS, MIN_EVERY, Schedule, make_schedule) and `flowq.ops.schedules`
(ScheduleInfo, list_schedules); this shim goes in flowq 0.2.
"""

from __future__ import annotations

from flowq.define.schedules import (
    KEY_PREFIX,
    LATE_GRACE,
    MAX_TICKS_PER_PASS,
    MIN_EVERY,
    Schedule,
    make_schedule,
)
from flowq.deprecated import warn_moved
from flowq.ops.schedules import ScheduleInfo, list_schedules

__all__ = ["KEY_PREFIX", "LATE_GRACE", "MAX_TICKS_PER_PASS", "MIN_EVERY", "Schedule",
           "ScheduleInfo", "list_schedules", "make_schedule"]

warn_moved(__name__, "flowq.define.schedules or flowq.ops.schedules")
