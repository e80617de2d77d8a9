"""`status(bind)`: the whole of a flowq schema at a glance (`flowq status`).

One call reads, in one connection:

- per queue (every queue with unfinished or dead jobs, a declaration, or jobs that ended in
  the last hour): jobs due (`pending`), due later (`scheduled`), `waiting`, `running`, `dead`,
  the age of the oldest due job, jobs that succeeded in the last minute and hour and died in
  the last hour, and the limits and paused state of `flowq.queues` (`flowq.ops.queues.list_queues`);
- the live workers of `flowq.workers` (heartbeat younger than `stale_after`);
- dead jobs by task;
- due jobs that no live worker serves (`flowq.ops.runs.unserved_jobs`);
- jobs a worker left to another whose definition can run them (a deploy in progress:
  `flowq.worker.resolution.resolve`), by task, definition and the worker they wait for.

Every statement reads through an index that holds only what it counts (the partial pending,
waiting, running and dead indexes; `jobs_finished_idx` from an hour ago on), so the time does
not grow with the finished rows the pruner retains (docs/operations.md has the figure at a
million). `Status.to_dict()` has stable keys: `flowq status --json` prints it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from flowq.db.store import Store
from flowq.names import DEFAULT_SCHEMA
from flowq.ops.queues import QueueInfo, list_queues
from flowq.ops.runs import UNSERVED_STALE_AFTER, UnservedJobs, unserved_jobs

__all__ = ["DeadTask", "HandedOver", "QueueStatus", "Status", "WorkerStatus", "status"]

Bind = sa.Engine | sa.Connection


@dataclass(frozen=True)
class QueueStatus(QueueInfo):
    """One queue (`flowq.ops.queues.QueueInfo`: jobs by state, limits, paused) and its throughput."""

    succeeded_last_minute: int = 0
    succeeded_last_hour: int = 0
    dead_last_hour: int = 0


@dataclass(frozen=True)
class WorkerStatus:
    """A live worker process, as registered in `flowq.workers`."""

    name: str
    host: str
    pid: int
    queues: list[str]
    concurrency: int
    version: str
    started_at: datetime
    heartbeat_age_s: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["started_at"] = self.started_at.isoformat()
        return d


@dataclass(frozen=True)
class DeadTask:
    """How many dead jobs one task has."""

    task: str
    jobs: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HandedOver:
    """Pending jobs of `task` (started under `fingerprint`) that a worker left to `worker`,
    which serves a definition able to run them."""

    task: str
    fingerprint: str | None
    worker: str | None
    jobs: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Status:
    """What `status` found, as of the database's `now()` (`at`)."""

    at: datetime
    queues: list[QueueStatus] = field(default_factory=list)
    workers: list[WorkerStatus] = field(default_factory=list)
    dead_by_task: list[DeadTask] = field(default_factory=list)
    unserved: list[UnservedJobs] = field(default_factory=list)
    handed_over: list[HandedOver] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at.isoformat(),
                "queues": [q.to_dict() for q in self.queues],
                "workers": [w.to_dict() for w in self.workers],
                "dead_by_task": [d.to_dict() for d in self.dead_by_task],
                "unserved": [u.to_dict() for u in self.unserved],
                "handed_over": [h.to_dict() for h in self.handed_over]}


def status(bind: Bind, *, schema: str = DEFAULT_SCHEMA,
           stale_after: float = UNSERVED_STALE_AFTER, limit: int = 20) -> Status:
    """Read the state of `schema` (see the module's docstring). A worker is live while its
    registry heartbeat is younger than `stale_after` seconds; `limit` caps the dead tasks
    and the unserved (queue, task) groups listed, largest first."""
    if isinstance(bind, sa.Engine):
        with bind.connect() as conn:
            return _read(conn, schema, stale_after, limit)
    return _read(bind, schema, stale_after, limit)


def _read(conn: sa.Connection, schema: str, stale_after: float, limit: int) -> Status:
    store = Store.of(conn, schema)
    at = store.now()
    done = {r.queue: r for r in store.recent_completions()}
    found = {i.name: i for i in list_queues(conn, schema=schema)}
    queue_list: list[QueueStatus] = []
    for name in sorted(found.keys() | done.keys()):
        info, d = found.get(name), done.get(name)
        queue_list.append(QueueStatus(
            name=name,
            pending=info.pending if info else 0,
            scheduled=info.scheduled if info else 0,
            waiting=info.waiting if info else 0,
            running=info.running if info else 0,
            dead=info.dead if info else 0,
            oldest_due_s=info.oldest_due_s if info else None,
            succeeded_last_minute=d.succeeded_last_minute if d else 0,
            succeeded_last_hour=d.succeeded_last_hour if d else 0,
            dead_last_hour=d.dead_last_hour if d else 0,
            concurrency=info.concurrency if info else None,
            rate_limit=info.rate_limit if info else None,
            rate_period_s=info.rate_period_s if info else None,
            paused=info.paused if info else False))
    workers = [WorkerStatus(name=r.name, host=r.host, pid=r.pid, queues=list(r.queues),
                            concurrency=r.concurrency, version=r.version,
                            started_at=r.started_at, heartbeat_age_s=r.heartbeat_age_s)
               for r in store.live_workers(stale_after)]
    dead = [DeadTask(r.task, r.jobs) for r in store.dead_by_task(limit)]
    unserved = unserved_jobs(conn, schema=schema, stale_after=stale_after, limit=limit)
    handed = [HandedOver(r.task, r.fingerprint, r.worker, r.n)
              for r in store.handed_over_jobs(limit)]
    return Status(at=at, queues=queue_list, workers=workers, dead_by_task=dead,
                  unserved=unserved, handed_over=handed)
