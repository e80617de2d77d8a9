"""The verbs of `flowq.queues` outside a claim: declarations, pauses, listings, metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from flowq.db.rows import read
from flowq.db.store.base import Verbs

__all__ = ["ActivityCount", "QueueCompletions", "QueueInfo", "QueueLimits", "QueueMetrics", "QueueVerbs"]


@dataclass(frozen=True)
class QueueLimits:
    """The limits an app declares for one queue (None: no such limit): at most
    `concurrency` running, at most `rate_limit` claims per `rate_period` seconds."""

    name: str
    concurrency: int | None
    rate_limit: int | None
    rate_period: float | None


if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class QueueInfo:
    """One line of `list_queues`: a queue's jobs by state, its limits and whether it is paused."""

    name: str
    pending: int  # due now
    scheduled: int  # pending, due later
    waiting: int
    running: int
    dead: int
    oldest_due_s: float | None
    concurrency: int | None
    rate_limit: int | None
    rate_period_s: float | None
    paused: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class QueueCompletions:
    """A queue's jobs that ended in the last hour: succeeded in the last minute and hour,
    dead in the last hour."""

    queue: str
    succeeded_last_minute: int
    succeeded_last_hour: int
    dead_last_hour: int


@dataclass(frozen=True)
class QueueMetrics:
    """A queue's due, scheduled and running jobs, and its oldest due job's age (0: none)."""

    queue: str
    due: int
    scheduled: int
    running: int
    oldest_s: float


@dataclass(frozen=True)
class ActivityCount:
    """One figure of a queue's activity in one time bucket (`kind`: finished, dead,
    started with the pickup delay's p50 and p95, failed, due, taken; or `read`, how many
    finished rows were read)."""

    queue: str
    kind: str
    bucket: int
    n: int
    p50: float | None
    p95: float | None


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

    def set_queue_paused(self, name: str, paused: bool) -> bool:
        """Pause or resume queue `name`; whether that changed anything."""
        return bool(self.run(self.q.set_queue_paused, {"name": name, "paused": paused})[0][0])

    def list_queues(self) -> list[QueueInfo]:
        """Every queue with unfinished or dead jobs or a declaration, by name."""
        return read(QueueInfo, self.run(self.q.list_queues, {}))

    def recent_completions(self) -> list[QueueCompletions]:
        """Per queue, the jobs that ended in the last hour."""
        return read(QueueCompletions, self.run(self.q.select_completions, {}))

    def queue_metrics(self) -> list[QueueMetrics]:
        """Per queue with pending or running jobs, its gauges, by queue name."""
        return read(QueueMetrics, self.run(self.q.select_queue_metrics, {}))

    def queue_activity(self, since: datetime, bucket: int, limit: int) -> list[ActivityCount]:
        """Per queue and bucket of `bucket` seconds from `since` on, what was due, started,
        finished, failed and died, reading at most `limit` rows of each kind."""
        return read(ActivityCount, self.run(self.q.select_queue_activity, {
            "since": since, "bucket": bucket, "limit": limit}))
