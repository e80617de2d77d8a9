"""The verbs of a step's durable state: checkpoints, child runs, batches, run waiters."""

from __future__ import annotations

from flowq.db.store.base import Verbs

__all__ = ["DurableVerbs"]


class DurableVerbs(Verbs):
    """Checkpoints, children, batches and waiters."""

    def prune_waiters(self, limit: int) -> int:
        """Delete up to `limit` run waiters whose LISTEN connection is gone; how many."""
        return int(self.run(self.q.prune_waiters, {"limit": limit})[0][0])
