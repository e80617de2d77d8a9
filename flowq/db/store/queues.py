"""The verbs of `flowq.queues` outside a claim: declarations, pauses, listings, metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flowq.db.store.base import Verbs

__all__ = ["QueueLimits", "QueueVerbs"]


@dataclass(frozen=True)
class QueueLimits:
    """The limits an app declares for one queue (None: no such limit): at most
    `concurrency` running, at most `rate_limit` claims per `rate_period` seconds."""

    name: str
    concurrency: int | None
    rate_limit: int | None
    rate_period: float | None


class QueueVerbs(Verbs):
    """Queues as configuration and as counts."""

    def declare_queues(self, limits: Sequence[QueueLimits], worker: str) -> None:
        """Write the `limits` `worker` declares for its queues, keeping each queue's paused
        state (a changed rate starts with a full bucket)."""
        self.run(self.q.declare_queues, {
            "names": [d.name for d in limits],
            "concurrencies": [d.concurrency for d in limits],
            "rate_limits": [d.rate_limit for d in limits],
            "rate_periods": [d.rate_period for d in limits], "worker": worker})

    def mark_keyed_queues(self, names: Sequence[str], served: Sequence[str]) -> None:
        """Mark `names` as running tasks with per-key limits, and those of `served` holding
        pending keyed jobs (enqueued by a flowq that did not mark them)."""
        self.run(self.q.mark_keyed_queues, {"names": list(names), "served": list(served)})
