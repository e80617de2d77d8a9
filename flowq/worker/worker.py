"""The worker: `Worker` wires the parts and runs their lifecycle (start, run, stop, signals,
the graceful shutdown and the release of what did not finish).

The parts, each small and in its own module: the `Producer` (the claim loop, its wake-ups and
the claim-ahead) over a `Claimer` (claims only for free slots, in batches, one queue at a
time in rotation) and a `Listener` (LISTEN: wakes the loop), an `Executor` (threads and an
event loop, a timeout watchdog; decides each outcome), a `Completer` (fenced, batched
writes), and the services of `flowq.worker.services`, each on its own thread: the
`Heartbeat` (its own thread and connection too: it beats the worker's registry entry, which
keeps its running jobs alive), the `Registry`'s look at its entry, and with
`maintenance` the `Reaper`, the `WaitExpirer`, the `WorkerExpirer` and the `Pruner`
(`flowq.worker.maintenance`), with `schedules` the `Scheduler`. At start it rides out a
database briefly unreachable (`flowq.worker.startup`). Options and defaults:
`flowq.worker.config`.

Each role has its own connection (or small pool) named in `application_name` (`flowq
claim`, `flowq complete`, `flowq heartbeat`, `flowq maintain`, `flowq session`, `flowq
listen`), so operators can see them in pg_stat_activity, and a dropped connection in one
role never stalls another.

Behind PgBouncer in transaction pooling mode (`pgbouncer=True`, `flowq worker --pgbouncer`)
every connection is made safe for it (see `flowq.worker.connection`): no LISTEN through the
pooler (poll only, or LISTEN on the direct `listen_url`), no session-level advisory lock (the
metrics' queue gauges are collected only through `listen_url`), and no `pg_terminate_backend`
of an abandoned attempt's backend (the pid a pooled connection reports is PgBouncer's).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Final

from sqlalchemy.engine import URL

from flowq.db import describe_url, normalize_url
from flowq.db.checks import ensure_schema
from flowq.db.rows import Claim, ClaimedJob
from flowq.db.schema import notify_channel, schema_map
from flowq.db.store import Store
from flowq.define.app import FlowQ
from flowq.durable.session import StepSession
from flowq.errors import ConfigurationError, WorkerStopError
from flowq.storable import first_line
from flowq.worker.claimer import Claimer
from flowq.worker.completer import Completer
from flowq.worker.config import WorkerConfig
from flowq.worker.connection import WorkerConnections
from flowq.worker.executor import Executor
from flowq.worker.heartbeat import Heartbeat
from flowq.worker.listener import Listener
from flowq.worker.logs import INFO, WARNING, log_event
from flowq.worker.maintenance import maintenance_loops
from flowq.worker.producer import Producer
from flowq.worker.registry import Registry, warn_stranded
from flowq.worker.scheduler import Scheduler
from flowq.worker.services import Service
from flowq.worker.startup import ride_out
from flowq.worker.supervisor import SUPERVISOR_ENV, SupervisorWatch

if TYPE_CHECKING:
    from flowq.worker.metrics import WorkerMetrics

__all__ = ["Worker", "WorkerConfig"]

# `running()`: how long after the grace period the thread may take before it is an error.
STOP_SLACK: Final = 30.0

class Worker:
    """Runs the jobs of `app` from the database at `url` until `stop()` or a signal."""

    def __init__(self, app: FlowQ, url: str | URL, config: WorkerConfig | None = None) -> None:
        self.app = app
        self.config = config or WorkerConfig()
        self.config.validate()
        app.check()
        self.url = normalize_url(url)
        self.listen_url = (normalize_url(self.config.listen_url)
                           if self.config.listen_url else None)
        self.queues = list(self.config.queues or app.queues)
        if not self.queues:
            raise ConfigurationError("the app defines no tasks, so there is no queue to serve: "
                                     "register tasks or pass --queues")
        schema = app.schema
        self.channel = notify_channel(app.schema)
        c = self.config
        self.connections = WorkerConnections(
            self.url, c.name, concurrency=c.concurrency, heartbeat_interval=c.heartbeat_interval,
            pgbouncer=c.pgbouncer, listen_url=self.listen_url,
            schedules=c.schedules and bool(app.schedules))
        self.engines = self.connections.engines
        maintain = self.engines["maintain"]
        smap = schema_map(app.schema)
        session_bind = self.engines["session"]
        if smap:
            session_bind = session_bind.execution_options(schema_translate_map=smap)
        pgb = c.pgbouncer
        self.claim_conn = self.connections.claim
        self.complete_conn = self.connections.complete
        # The producer's doorbell: every part that frees capacity or learns of a due job
        # rings it. The parts are built before the producer (it reads them), so their
        # callbacks reach it through the methods below.
        self._wake = threading.Event()
        self.metrics: WorkerMetrics | None = None
        if c.metrics_port is not None:
            from flowq.worker.metrics import WorkerMetrics  # prometheus_client only when asked for

            self.metrics = WorkerMetrics(
                worker=c.name, concurrency=c.concurrency, queues=self.queues,
                in_flight=lambda: self.executor.active, schema=schema,
                conn=self.connections.metrics())
        self.completer = Completer(self.complete_conn, schema, job_log=c.job_log,
                                   on_written=self._wake.set, on_scheduled=self._wake_at,
                                   metrics=self.metrics, outage=self.connections.outage)
        # Set when the worker starts stopping: ends the claim loop and the maintenance
        # services at once (the heartbeat and the registry's beat run on until the end).
        self._stopping = threading.Event()
        self._signals = 0
        self._signalled: int | None = None  # set by the signal handler, acted on by the loop
        self.executor = Executor(
            app, self.completer, concurrency=c.concurrency,
            session_factory=lambda: StepSession(bind=session_bind),
            on_slot_free=self._on_slot_free,
            on_start=self.metrics.observe_pickup if self.metrics is not None else None,
            # Behind PgBouncer a session's backend pid is PgBouncer's own (not a server's):
            # never terminate by it. An abandoned attempt's transaction then ends when its
            # handler does.
            end_backend=None if pgb else self._end_backend,
            elsewhere=lambda: self.registry.elsewhere)
        self.claimer = Claimer(self.claim_conn, schema, self.queues, c.name,
                               self.executor.submit, held=self._held_claims)
        self.producer = Producer(c, self.claimer, self.executor, self.completer,
                                 wake=self._wake,
                                 stopping=self._stopping, interrupted=self._interrupted,
                                 outage=self.connections.outage)
        self.listener: Listener | None = None
        conninfo = self.connections.listen_conninfo()
        if c.listen and conninfo is not None:
            self.listener = Listener(conninfo, self.channel, self.queues,
                                     self.producer.notified,
                                     application_name=f"flowq listen {c.name}"[:63],
                                     wake_in=self.producer.wake_at,
                                     outage=self.connections.outage)
        self.heartbeat = Heartbeat(
            self.connections.heartbeat, schema, self._held_claims,
            unsettled=self.executor.unsettled_claims, worker=c.name,
            interval=c.heartbeat_interval,
            on_cancelled=self.executor.cancel)
        self.registry = Registry(maintain, schema, worker=c.name, queues=self.queues,
                                 tasks=[p.name for p in app], concurrency=c.concurrency,
                                 interval=c.heartbeat_interval,
                                 definitions=app.definitions, stale=c.stale_after)
        stopping = self._stopping
        loops = maintenance_loops(maintain, schema, c, stopping)
        self.reaper, self.waits = loops.reaper, loops.waits
        self.expirer, self.pruner = loops.expirer, loops.pruner
        # Periodic schedules: a thread and a connection of their own (see its module).
        self.scheduler: Scheduler | None = None
        if "schedule" in self.engines:
            self.scheduler = Scheduler(self.engines["schedule"], app, stopping=stopping)
        supervisor = os.environ.get(SUPERVISOR_ENV)
        self.supervisor_watch = (SupervisorWatch(supervisor, self._orphaned, stopping=stopping)
                                 if supervisor else None)
        self._hint: threading.Thread | None = None
        for service in (self.heartbeat, self.registry, *self.services):
            service.outage = self.connections.outage

    @property
    def services(self) -> list[Service]:
        """The background loops this worker runs besides the heartbeat and the registry's
        beat (which outlive the drain), in the order they start."""
        running: list[Service] = []
        if self.config.maintenance:
            running += [self.reaper, self.waits, self.expirer, self.pruner]
        if self.scheduler is not None:
            running.append(self.scheduler)
        if self.supervisor_watch is not None:
            running.append(self.supervisor_watch)
        return running

    @property
    def claimed(self) -> int:
        return self.producer.claimed

    def claim(self, limit: int) -> list[ClaimedJob]:
        """Claim up to `limit` due jobs without running them (the bench measures claims)."""
        return self.producer.claim(limit)

    def check_database(self) -> None:
        """Raise a one-sentence flowq error if the database is unreachable, not migrated, or
        migrated to an older revision than this flowq needs. An unreachable database is tried
        again with backoff for `config.start_timeout` seconds first."""
        self._ride_out(self._check_schema)

    def _check_schema(self) -> None:
        ensure_schema(self.engines["maintain"], self.app.schema, current=True)

    def _prepare_database(self) -> None:
        """The start-up statements; each is an upsert, so a retry after a partial run is safe."""
        self._check_schema()
        self.registry.declare_queues(self.app.declared_queues, self.app.keyed_queues)
        self.claimer.refresh()  # which of our queues are paused or limited, now
        self.registry.register()

    def _ride_out(self, start: Callable[[], None]) -> None:
        """Run `start`, riding out an unreachable database (`flowq.worker.startup`)."""
        ride_out(start, self.url, self.config.start_timeout, self._stopping)

    def warn_stranded(self) -> int:
        """Log due jobs of this app's tasks waiting on queues no step of the app uses (a
        producer's `queue=` that no worker serves by default); returns how many groups."""
        return warn_stranded(self.engines["maintain"], self.app.schema, [p.name for p in self.app],
                             self.app.queues)

    # -- what the parts report (they are built before the producer) ----------------------------

    def _wake_at(self, delay: float) -> None:
        self.producer.wake_at(delay)

    def _on_slot_free(self, in_flight: int) -> None:
        self.producer.slot_freed(in_flight)

    def _held_claims(self) -> list[Claim]:
        return self.executor.running_claims() + self.completer.pending_claims()

    def _end_backend(self, pid: int) -> None:
        with self.engines["maintain"].connect() as conn:
            Store.of(conn, self.app.schema).end_backend(pid)

    def _orphaned(self) -> None:
        self._signalled = signal.SIGTERM  # the claim loop starts a clean shutdown

    def _interrupted(self) -> bool:
        """Whether a signal (or the supervisor's end) asks to stop: then stop claiming."""
        if self._signalled is None:
            return False
        log_event(INFO, "shutting down: no new claims; waiting for running jobs",
                  signal=signal.Signals(self._signalled).name,
                  grace_s=self.config.shutdown_grace, running=self.executor.in_flight)
        self.stop()
        return True

    # -- the lifecycle ------------------------------------------------------------------------

    def start_parts(self) -> None:
        c = self.config
        if self.metrics is not None and c.metrics_port is not None:
            # First: a port in use stops the worker before anything started.
            self.metrics.serve(c.metrics_addr, range(c.metrics_port,
                                                     c.metrics_port + c.metrics_ports))
            log_event(INFO, "serving metrics", url=f"http://{c.metrics_addr}:"
                      f"{self.metrics.port}/metrics")
        try:
            self._ride_out(self._prepare_database)
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            raise
        if c.maintenance:
            self._ensure_partitions_quietly()
        self.completer.start()
        self.executor.start()
        self.heartbeat.start()
        self.registry.start()
        if self.listener is not None:
            self.listener.start()
        self._hint = threading.Thread(target=self._warn_stranded_quietly,
                                      name="flowq-stranded-check", daemon=True)
        self._hint.start()
        for service in self.services:
            service.start()
        log_event(INFO, "worker started", database=describe_url(self.url),
                  queues=",".join(self.queues), concurrency=c.concurrency,
                  worker=c.name, listen=self.listener is not None,
                  **({"pgbouncer": True} if c.pgbouncer else {}),
                  poll_s=c.poll_interval)

    def _ensure_partitions_quietly(self) -> None:
        # Before the first completion: a fresh database gets today's partition of history
        # before its rows would land in the DEFAULT one (where the day cannot be attached).
        try:
            self.pruner.ensure_partitions()
        except Exception as exc:  # the pruner's passes try again: never stop the worker
            log_event(WARNING, "could not create history partitions", error=first_line(exc))

    def _warn_stranded_quietly(self) -> None:
        try:
            self.warn_stranded()
        except Exception as exc:  # a hint only: never stop the worker for it
            log_event(WARNING, "could not look for stranded jobs", error=first_line(exc))

    def run(self, *, install_signals: bool | None = None, until_idle: bool = False,
            idle_horizon: float = 0.0) -> None:
        """Run until `stop()` (or SIGTERM/SIGINT), or with `until_idle` until no job is due
        within `idle_horizon` seconds (so retries scheduled shortly are waited for) and
        nothing is running.

        Signal handlers are installed only in the main thread (default `None`): a worker
        embedded in a thread (a web app's lifespan, a test) is stopped with `stop()`, and
        `run()` returns once running handlers finished or the grace period ran out."""
        if install_signals is None:
            install_signals = threading.current_thread() is threading.main_thread()
        if install_signals:
            self._install_signals()
        self.producer.idle_horizon = idle_horizon
        self.start_parts()
        try:
            self.producer.run(until_idle)
        finally:
            self._shutdown()

    @contextlib.contextmanager
    def running(self) -> Iterator[Worker]:
        """Run on a thread of this process for the duration of the block (as a web app's
        lifespan or a script embeds a worker; no signal handlers), then stop: running
        handlers finish within the grace period. Re-raises what the worker raised; raises
        FlowqError if it has not stopped 30 s after the grace period."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self.run(install_signals=False)
            except BaseException as exc:  # surfaced to the caller, not lost in the thread
                errors.append(exc)

        thread = threading.Thread(target=run, name="flowq-worker", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.stop()
            thread.join(self.config.shutdown_grace + STOP_SLACK)
        if thread.is_alive():
            raise WorkerStopError("the worker did not stop within its grace period and 30 s")
        if errors:
            raise errors[0]

    def stop(self) -> None:
        """Stop claiming; `run` then drains within the grace period and returns."""
        self._stopping.set()
        self._wake.set()

    def _install_signals(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            # Runs in the main thread between any two bytecodes, possibly while that thread
            # holds a plain Lock (the executor's, an Event's): taking one here would deadlock.
            # So it only records the signal; the claim loop (awake at least every 0.25 s) acts.
            self._signals += 1
            if self._signals > 1:
                log_event(WARNING, "second signal: exiting at once; the reaper will requeue "
                          "what was running")
                os._exit(1)
            self._signalled = signum

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _shutdown(self) -> None:
        c = self.config
        self._stopping.set()  # also when run(until_idle=True) returns on its own
        deadline = time.monotonic() + c.shutdown_grace
        ahead = self.executor.take_ready()  # claimed ahead, never started: hand them back
        if ahead:
            self.producer.release(ahead, "released jobs claimed ahead, not started (attempt "
                                         "not counted)", INFO)
        while self.executor.in_flight and time.monotonic() < deadline:
            self._wake.wait(0.05)
            self._wake.clear()
        self.completer.flush(max(1.0, deadline - time.monotonic()))
        unfinished = self.executor.running_claims()
        if unfinished:
            self.producer.release(unfinished)
        self.completer.stop(timeout=5.0)
        self.claimer.release_permits()  # after the outcomes and the release: none runs now
        self.executor.stop()
        self.registry.stop()  # no beat after the entry is gone: it would enter it again
        self.registry.leave()
        self.heartbeat.stop()
        if self._hint is not None:
            self._hint.join(timeout=5.0)
        for service in self.services:
            service.stop()
        if self.listener is not None:
            self.listener.stop()
        log_event(INFO, "worker stopped", worker=c.name, claimed=self.claimed,
                  released=len(unfinished) + len(ahead))
        if self.metrics is not None:
            self.metrics.close()
        self.connections.close()
