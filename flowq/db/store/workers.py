"""The verbs of the workers registry (`flowq.workers`) and of the definitions workers record
and serve (`flowq.definitions`), with the reads of due jobs by who serves them (stranded,
unserved, handed over): `WorkerVerbs`.

Registering, beating (the heartbeat's, `ClaimVerbs.heartbeat`) and expiring are by worker
name; a definition is recorded once per fingerprint (a fingerprint names one shape).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flowq.db.rows import column, read
from flowq.db.store.base import Verbs

__all__ = ["Definition", "HandedOver", "LiveWorker", "RecordedDefinition", "RunsInFlight", "ServedDefinitions", "Stranded", "WorkerVerbs"]


@dataclass(frozen=True)
class Definition:
    """A definition a worker serves, as it records it: `shape` is any JSON value."""

    fingerprint: str
    pipeline: str
    version: int
    shape: Any


@dataclass(frozen=True)
class RecordedDefinition:
    """A definition as `flowq.definitions` recorded it, first seen at `first_seen`."""

    fingerprint: str
    pipeline: str
    version: int
    shape: Any
    first_seen: datetime


@dataclass(frozen=True)
class ServedDefinitions:
    """What one live worker serves: its queues, and its `definitions` as it registered them
    (`{pipeline: [{version, fingerprint}]}`, another process's word: not trusted)."""

    name: str
    queues: list[str]
    definitions: Any


@dataclass(frozen=True)
class Stranded:
    """Due jobs of one (queue, task) that no worker serves: how many, the oldest's wait."""

    queue: str
    task: str
    n: int
    oldest_s: float


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
class HandedOver:
    """Pending jobs of one task and fingerprint that a worker left to worker `worker`."""

    task: str
    fingerprint: str | None
    worker: str
    n: int


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


class WorkerVerbs(Verbs):
    """The workers registry and the definitions its workers serve."""

    # -- the registry ------------------------------------------------------------------------
    def register_worker(self, name: str, *, host: str, pid: int, queues: Sequence[str],
                        tasks: Sequence[str], concurrency: int, version: str,
                        definitions: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
        """Enter worker `name` (or refresh its entry: a restart under the same name) with
        what it serves (`definitions`: `{pipeline: [{version, fingerprint}]}`); it holds no
        lease yet."""
        self.run(self.q.register_worker, {
            "name": name, "host": host, "pid": pid, "queues": list(queues),
            "tasks": list(tasks), "concurrency": concurrency, "version": version,
            "definitions": json.dumps(definitions)})

    def is_registered(self, name: str) -> bool:
        """Whether worker `name` has an entry (False: it expired, register again)."""
        return bool(self.run(self.q.find_worker, {"name": name}))

    def unregister_worker(self, name: str) -> None:
        """Remove worker `name`'s entry (a clean stop)."""
        self.run(self.q.unregister_worker, {"name": name})

    def expire_workers(self, stale: float) -> list[str]:
        """Remove the entries of workers that stopped beating `stale` seconds ago; their
        names."""
        return [str(n) for n in column(self.run(self.q.expire_workers, {"stale": stale}),
                                       "name")]

    def live_workers(self, stale: float) -> list[LiveWorker]:
        """The workers that beat within `stale` seconds, by name."""
        return read(LiveWorker, self.run(self.q.select_live_workers, {"stale": stale}))

    def record_definitions(self, definitions: Sequence[Definition]) -> None:
        """Record each of `definitions` unless its fingerprint is recorded already."""
        self.run(self.q.record_definitions, {
            "fingerprints": [d.fingerprint for d in definitions],
            "pipelines": [d.pipeline for d in definitions],
            "versions": [d.version for d in definitions],
            "shapes": [json.dumps(d.shape) for d in definitions]})

    def recorded_definitions(self, pipelines: Sequence[str]) -> list[RecordedDefinition]:
        """The recorded definitions of `pipelines`, by pipeline, version and first sight."""
        return read(RecordedDefinition, self.run(self.q.select_definitions,
                                                 {"pipelines": list(pipelines)}))

    def served_definitions(self, stale: float, other_than: str = "") -> list[ServedDefinitions]:
        """What the live workers (beat within `stale` seconds) other than `other_than` that
        registered their definitions serve, by name."""
        return read(ServedDefinitions, self.run(self.q.select_served_definitions,
                                                {"name": other_than, "stale": stale}))

    def stranded_jobs(self, tasks: Sequence[str], queues: Sequence[str]) -> list[Stranded]:
        """Due jobs of `tasks` on queues outside `queues` (those their app's steps use): up
        to 20 (queue, task) groups, largest first."""
        return read(Stranded, self.run(self.q.find_stranded_jobs,
                                       {"tasks": list(tasks), "queues": list(queues)}))

    def unserved_jobs(self, stale: float, limit: int) -> list[Stranded]:
        """Due jobs no live worker (beat within `stale` seconds) serves: up to `limit`
        (queue, task) groups, largest first."""
        return read(Stranded, self.run(self.q.select_unserved_jobs,
                                       {"stale": stale, "limit": limit}))

    def handed_over_jobs(self, limit: int) -> list[HandedOver]:
        """Pending jobs a worker left to another's definition: up to `limit` groups by task,
        fingerprint and the worker they were left to, largest first."""
        return read(HandedOver, self.run(self.q.select_handed_over_jobs, {"limit": limit}))

    def version_fingerprints(self, version: int, task: str | None) -> list[str]:
        """The fingerprints `flowq.definitions` records for pipeline version `version` (of
        `task` only, unless None): what runs of that version started under."""
        rows = self.run(self.q.select_version_fingerprints, {"version": version, "task": task})
        return [str(f) for f in column(rows, "fingerprint")]

    def definitions(self, pipelines: Sequence[str]) -> list[Definition]:
        """The recorded definitions of `pipelines`, by pipeline, version and first sight."""
        return read(Definition, self.run(self.q.select_definitions,
                                         {"pipelines": list(pipelines)}))

    def runs_in_flight(self, limit: int) -> list[RunsInFlight]:
        """The active jobs grouped by task, fingerprint, step, join and argument names, up
        to `limit` groups (the deploy check's read)."""
        return read(RunsInFlight, self.run(self.q.select_runs_in_flight, {"limit": limit}))
