"""The verbs of `flowq.workers` and the definitions they serve: registry, deploys, stranded jobs."""

from __future__ import annotations

from dataclasses import dataclass

from flowq.db.rows import column, read
from flowq.db.store.base import Verbs

__all__ = ["UnservedGroup", "WorkerVerbs"]


@dataclass(frozen=True)
class UnservedGroup:
    """Due jobs of one task on one queue that no live worker serves: how many, and how long
    the oldest has been due (seconds)."""

    queue: str
    task: str
    n: int
    oldest_s: float


class WorkerVerbs(Verbs):
    """Workers, their registry and what they serve."""

    # -- read by `flowq.ops.runs` (appended by the runs slice) -------------------------------

    def unserved_jobs(self, stale_after: float, limit: int) -> list[UnservedGroup]:
        """Due jobs no worker heartbeating within `stale_after` seconds serves, by (queue,
        task), the `limit` largest groups first."""
        return read(UnservedGroup, self.run(self.q.select_unserved_jobs,
                                            {"stale": stale_after, "limit": limit}))

    def version_fingerprints(self, version: int, task: str | None) -> list[str]:
        """The fingerprints `flowq.definitions` records for pipeline version `version` (of
        `task` only, unless None): what runs of that version started under."""
        rows = self.run(self.q.select_version_fingerprints, {"version": version, "task": task})
        return [str(f) for f in column(rows, "fingerprint")]
