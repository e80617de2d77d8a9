"""The verbs of `flowq.workers` and the definitions they serve: registry, deploys, stranded jobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flowq.db.rows import column, read
from flowq.db.store.base import Verbs

__all__ = ["Definition", "HandedOverJobs", "LiveWorker", "RunsInFlight", "ServedDefinitions", "UnservedGroup", "WorkerVerbs"]


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

    # -- operations' reads (flowq status, the deploy check) ------------------------------------

    def definitions(self, pipelines: Sequence[str]) -> list[Definition]:
        """The recorded definitions of `pipelines`, by pipeline, version and first sight."""
        return read(Definition, self.run(self.q.select_definitions,
                                         {"pipelines": list(pipelines)}))

    def served_definitions(self, stale: float, *, other_than: str = "") -> list[ServedDefinitions]:
        """What the live workers (heartbeat within `stale` seconds) but `other_than` serve,
        those that registered their definitions, by name."""
        return read(ServedDefinitions, self.run(self.q.select_served_definitions,
                                                {"name": other_than, "stale": stale}))

    def runs_in_flight(self, limit: int) -> list[RunsInFlight]:
        """The active jobs grouped by task, fingerprint, step, join and argument names, up
        to `limit` groups (the deploy check's read)."""
        return read(RunsInFlight, self.run(self.q.select_runs_in_flight, {"limit": limit}))

    def live_workers(self, stale: float) -> list[LiveWorker]:
        """The registered workers whose heartbeat is younger than `stale` seconds, by name."""
        return read(LiveWorker, self.run(self.q.select_live_workers, {"stale": stale}))

    def handed_over_jobs(self, limit: int) -> list[HandedOverJobs]:
        """Pending jobs a worker left to another's definition, by task, fingerprint and the
        worker they were left to; up to `limit` groups, largest first."""
        return read(HandedOverJobs, self.run(self.q.select_handed_over_jobs, {"limit": limit}))


@dataclass(frozen=True)
class Definition:
    """A definition a worker served once: its shape by fingerprint."""

    fingerprint: str
    pipeline: str
    version: int
    shape: Any
    first_seen: datetime


@dataclass(frozen=True)
class ServedDefinitions:
    """A live worker's queues and the definitions it registered (JSON as stored: another
    process's word, checked by the reader)."""

    name: str
    queues: list[str]
    definitions: Any


@dataclass(frozen=True)
class RunsInFlight:
    """A group of active jobs: task, fingerprint their run started under, step, whether a
    join created them, their arguments' names; how many runs, the oldest, an example run."""

    task: str
    fingerprint: str | None
    step: str
    joined: bool
    names: list[str]
    runs: int
    oldest: datetime | None
    example: int


@dataclass(frozen=True)
class LiveWorker:
    """A registered worker whose heartbeat is recent."""

    name: str
    host: str
    pid: int
    queues: list[str]
    concurrency: int
    version: str
    started_at: datetime
    heartbeat_age_s: float


@dataclass(frozen=True)
class HandedOverJobs:
    """Pending jobs of `task` (started under `fingerprint`) left to worker `worker`."""

    task: str
    fingerprint: str | None
    worker: str | None
    n: int
