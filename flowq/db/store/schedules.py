"""The verbs of `flowq.schedules`: periodic runs started and listed."""

from __future__ import annotations

from flowq.db.store.base import Verbs

__all__ = ["ScheduleVerbs"]


class ScheduleVerbs(Verbs):
    """Schedules: the scheduler's pass and their listing."""
