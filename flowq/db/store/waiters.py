"""The verbs of `flowq.run_waiters`: who waits for a run's end (`WaiterVerbs`).

A waiter of `flowq.wait_run` registers its run under the backend pid of its process's LISTEN
connection, so a completion announces only the runs somebody waits for, and the pruner can
delete the rows whose LISTEN connection is gone.
"""

from __future__ import annotations

from flowq.db.store.base import Verbs

__all__ = ["WaiterVerbs"]


class WaiterVerbs(Verbs):
    """Registrations of run waiters."""

    def register_waiter(self, run_id: int, token: str, pid: int) -> None:
        """Record that wait `token`, heard on LISTEN connection `pid`, waits for `run_id`
        (idempotent: a registration again moves the row to the new `pid`)."""
        self.run(self.q.register_waiter, {"run_id": run_id, "token": token, "pid": pid})

    def unregister_waiter(self, run_id: int, token: str) -> None:
        """Delete wait `token`'s registration for `run_id` (it returned)."""
        self.run(self.q.unregister_waiter, {"run_id": run_id, "token": token})
