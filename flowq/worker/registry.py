"""The workers registry, `flowq.workers`: who serves which queues and tasks, as operators,
`flowq status` and `flowq runs list` see it (which due jobs no live worker serves).

- `Registry` is one worker's entry: `register()` at start, a look every `interval` (the
  heartbeat interval, default 5 s; `run_once()`), `leave()` at a clean stop. The entry's beat
  is the `Heartbeat`'s, on its own connection (the entry keeps the worker's running jobs
  alive, `flowq.worker.heartbeat`); the look, through the maintenance pool, enters a worker
  again whose entry expired while it stalled, and reads what the other workers serve.
- `WorkerExpirer` removes the entries of workers that stopped beating for `stale` seconds
  (the worker's `stale_after`, default 30 s: the reaper's limit, so that an entry is removed
  only once the reaper would reap its jobs anyway), every `interval` (`reap_interval`,
  default 10 s), under the advisory lock `<schema>.registry` (one pass at a time across all
  workers).

At start a worker also writes its app's queue declarations (`Registry.declare_queues`), so
that every worker enforces the same limits, and says which due jobs of its tasks wait on a
queue none of its app's steps uses (`warn_stranded`: enqueued by name with a `queue=` no
worker serves by default, they would wait forever).
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from flowq.db.store import Store
from flowq.db.store.queues import QueueLimits
from flowq.db.store.workers import Definition
from flowq.storable import first_line
from flowq.worker.config import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_REAP_INTERVAL,
    DEFAULT_STALE_AFTER,
)
from flowq.worker.connection import DB_ERRORS
from flowq.worker.logs import WARNING, log_event
from flowq.worker.resolution import Elsewhere, ServedBy
from flowq.worker.services import Service

if TYPE_CHECKING:
    from flowq.define.pipeline import Pipeline
    from flowq.define.queues import QueueConfig

__all__ = ["Registry", "WorkerExpirer", "flowq_version", "warn_stranded"]


def flowq_version() -> str:
    """The installed flowq's version, as the registry shows it ("unknown" from a checkout)."""
    try:
        return importlib.metadata.version("flowq")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class Registry(Service):
    """Worker `name`'s entry in the registry: what it serves, and that it is alive."""

    name = "registry"

    def __init__(self, engine: sa.Engine, schema: str, *, worker: str,
                 queues: Sequence[str], tasks: Sequence[str], concurrency: int,
                 interval: float = DEFAULT_HEARTBEAT_INTERVAL,
                 definitions: Sequence[Pipeline] = (),
                 stale: float = DEFAULT_STALE_AFTER) -> None:
        super().__init__(interval=interval)
        self.engine = engine
        self.schema = schema
        self.worker = worker
        self.queues = list(queues)
        self.tasks = list(tasks)
        self.concurrency = concurrency
        self.definitions = list(definitions)
        self.stale = stale
        # What the other live workers serve, for `attempt.resolve` (read at each beat).
        self.elsewhere = Elsewhere()

    def register(self) -> None:
        """Enter (or refresh: a restart under the same name) this worker's entry, with the
        definitions it serves (their shapes recorded once per fingerprint)."""
        served: dict[str, list[dict[str, Any]]] = {}
        for p in self.definitions:
            served.setdefault(p.name, []).append({"version": p.version,
                                                  "fingerprint": p.fingerprint})
        with self.engine.begin() as conn:
            store = Store.of(conn, self.schema)
            if self.definitions:
                store.record_definitions([Definition(p.fingerprint, p.name, p.version, p.shape)
                                          for p in self.definitions])
            store.register_worker(
                self.worker, host=socket.gethostname(), pid=os.getpid(), queues=self.queues,
                tasks=self.tasks, concurrency=self.concurrency, version=flowq_version(),
                definitions=served)
        self.refresh()

    def refresh(self) -> None:
        """Read what the other live workers serve (`elsewhere`); on a database error the
        previous reading stays."""
        if not self.definitions:
            return
        names = sorted({p.name for p in self.definitions})
        try:
            with self.engine.connect() as conn:
                store = Store.of(conn, self.schema)
                known = store.recorded_definitions(names)
                workers = store.served_definitions(self.stale, other_than=self.worker)
        except DB_ERRORS as exc:
            log_event(WARNING, "could not read the definitions other workers serve",
                      error=first_line(exc))
            return
        self.elsewhere = Elsewhere(
            versions={r.fingerprint: r.version for r in known},
            shapes={r.fingerprint: r.shape for r in known},
            workers=tuple(ServedBy(r.name, frozenset(r.queues), _served(r.definitions))
                          for r in workers))

    def declare_queues(self, declared: Sequence[QueueConfig], keyed: Sequence[str]) -> None:
        """Write the app's queue declarations (limits) and which of its queues key their jobs
        (`concurrency_key=`), so that every worker enforces them. (A keyed enqueue marks its
        own queue too, in its transaction, whatever queue it names: this mark covers keyed
        tasks' own queues before their first enqueue, and the served queues holding keyed
        jobs that an older flowq enqueued without marking them.)"""
        with self.engine.begin() as conn:
            store = Store.of(conn, self.schema)
            if declared:
                store.declare_queues([
                    QueueLimits(d.name, d.concurrency,
                                d.rate_limit.limit if d.rate_limit else None,
                                d.rate_limit.seconds if d.rate_limit else None)
                    for d in declared], self.worker)
            if keyed:
                store.mark_keyed_queues(keyed, self.queues)

    def run_once(self) -> int:
        """Look; returns 1 when the entry had expired and was entered again, else 0."""
        with self.engine.begin() as conn:
            found = Store.of(conn, self.schema).is_registered(self.worker)
        if found:
            self.refresh()
            return 0
        self.register()  # expired while this worker was stalled: enter it again
        return 1

    def leave(self) -> None:
        """Remove the entry (a clean stop); if the database says no, it expires on its own."""
        try:
            with self.engine.begin() as conn:
                Store.of(conn, self.schema).unregister_worker(self.worker)
        except DB_ERRORS as exc:
            log_event(WARNING, "could not leave the workers registry", error=first_line(exc))


class WorkerExpirer(Service):
    """Removes the registry entries of workers that stopped beating `stale` seconds ago."""

    name = "registry-expiry"

    def __init__(self, engine: sa.Engine, schema: str, *,
                 stale: float = DEFAULT_STALE_AFTER, interval: float = DEFAULT_REAP_INTERVAL,
                 first_delay: float | None = None,
                 stopping: threading.Event | None = None) -> None:
        super().__init__(interval=interval, first_delay=first_delay, stopping=stopping)
        self.engine = engine
        self.schema = schema
        self.stale = stale

    def run_once(self) -> int:
        """One pass; returns how many entries expired (0 if another worker holds the lock)."""
        with self.engine.begin() as conn:
            store = Store.of(conn, self.schema)
            if not store.try_maintenance_lock("registry"):
                return 0
            expired = store.expire_workers(self.stale)
        if expired:
            log_event(WARNING, "removed workers that stopped heartbeating from the registry",
                      workers=",".join(expired))
        return len(expired)


def _served(definitions: Any) -> dict[str, tuple[tuple[int, str], ...]]:
    """A registry entry's `definitions` as `ServedBy` holds them; what is not of the shape
    this release writes is left out (an entry is another process's word, not trusted)."""
    served: dict[str, tuple[tuple[int, str], ...]] = {}
    if not isinstance(definitions, dict):
        return served
    for name, versions in definitions.items():
        if isinstance(versions, list):
            served[str(name)] = tuple(
                (v["version"], v["fingerprint"]) for v in versions
                if isinstance(v, dict) and isinstance(v.get("version"), int)
                and isinstance(v.get("fingerprint"), str))
    return served


def warn_stranded(engine: sa.Engine, schema: str, tasks: Sequence[str],
                  queues: Sequence[str]) -> int:
    """Log due jobs of `tasks` waiting on queues outside `queues` (those their app's steps
    use, which its workers serve by default); returns how many (queue, task) groups."""
    with engine.connect() as conn:
        rows = Store.of(conn, schema).stranded_jobs(tasks, queues)
    for r in rows:
        log_event(WARNING, "due jobs wait on a queue no worker of this app serves by default: "
                  "start one with --queues including it, or enqueue with the task's own queue",
                  queue=r.queue, task=r.task, jobs=r.n, oldest_due_s=round(r.oldest_s, 1))
    return len(rows)
