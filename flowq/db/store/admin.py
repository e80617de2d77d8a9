"""The verbs of the database itself and of maintenance: schema checks, locks, clocks, health."""

from __future__ import annotations

from flowq.db.store.base import Verbs

__all__ = ["AdminVerbs"]


class AdminVerbs(Verbs):
    """The database and maintenance."""

    def try_maintenance_lock(self, service: str) -> bool:
        """Take the transaction-scoped advisory lock `<schema>.<service>` of a maintenance
        service, or not (another pass holds it): one pass at a time across all workers."""
        return bool(self.run(self.q.try_maintenance_lock,
                             {"name": f"{self.schema}.{service}"})[0][0])

    def end_backend(self, pid: int) -> None:
        """Terminate server process `pid` (an abandoned attempt's connection, whose open
        transaction would hold its row locks until its stuck handler returns)."""
        self.run(self.q.end_backend, {"pid": pid})
