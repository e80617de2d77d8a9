"""The verbs of the database itself and of maintenance: schema checks, locks, clocks, health."""

from __future__ import annotations

from flowq.db.store.base import Verbs

__all__ = ["AdminVerbs"]


class AdminVerbs(Verbs):
    """The database and maintenance."""
