"""The verbs of the database itself and of maintenance: schema checks, locks, clocks, health."""

from __future__ import annotations

from datetime import datetime
from typing import cast

from flowq.db.store.base import Verbs

__all__ = ["AdminVerbs"]


class AdminVerbs(Verbs):
    """The database and maintenance."""

    # -- clocks (appended by the runs slice) -------------------------------------------------

    def now(self) -> datetime:
        """The database's clock (relative times such as `--since 1h` are measured on it)."""
        return cast(datetime, self.run(self.q.select_now, {})[0][0])
