"""The worker: claims jobs for its free slots, runs them, records outcomes, and keeps house.

`Worker` wires named parts, each small (see the modules beside this one), and runs the claim
loop: a `Listener` (LISTEN, wakes the loop), a `Claimer` (claims only for free slots, in
batches, one queue at a time in rotation), an `Executor` (threads and an event loop, a
timeout watchdog; decides each outcome), a `Completer` (fenced, batched writes), a
`Heartbeat` (its own thread and connection), and maintenance (`Reaper`, `Pruner`) on one
background thread. The loop wakes on NOTIFY, on a free batch of slots, when a retry this
worker scheduled falls due, and at the poll interval.

Options and defaults (`WorkerConfig`): concurrency 10, poll every 5 s (so a due job starts
within 5 s even without NOTIFY), listen on, heartbeat 5 s, reap jobs whose heartbeat is 30 s
stale every 10 s, prune every 60 s (retention 3 days, dead 14 days), shutdown grace 25 s.

Each role has its own connection (or small pool) named in `application_name` (`flowq
claim`, `flowq complete`, `flowq heartbeat`, `flowq maintain`, `flowq session`, `flowq
listen`), so operators can see them in pg_stat_activity, and a dropped connection in one
role never stalls another.

Behind PgBouncer in transaction pooling mode (`pgbouncer=True`, `flowq worker --pgbouncer`)
every connection is made safe for it: no startup `options` (the planner and timeout settings
are applied per transaction with `SET LOCAL`, see `flowq.worker.connection`), no prepared
statements (`prepare_threshold=None`), no LISTEN through the pooler (poll only, or LISTEN on
the direct `listen_url`), no session-level advisory lock (the metrics' queue gauges are
collected only through `listen_url`), and no `pg_terminate_backend` of an abandoned attempt's
backend (the pid a pooled connection reports is PgBouncer's, not the server's).
"""

from __future__ import annotations

import contextlib
import heapq
import importlib.metadata
import math
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Final

import sqlalchemy as sa
from sqlalchemy.engine import URL

from flowq.app import FlowQ
from flowq.context import StepSession
from flowq.db import describe_url, ensure_schema, normalize_url
from flowq.errors import ConfigurationError, FlowqError
from flowq.queries import Queries
from flowq.schema import notify_channel, schema_map
from flowq.storable import first_line
from flowq.worker import maintenance as m
from flowq.worker.claimer import Claimer
from flowq.worker.completer import Completer
from flowq.worker.connection import (
    DB_ERRORS,
    MAINTENANCE_OPTIONS,
    DedicatedConnection,
    heartbeat_options,
    set_local_on_begin,
)
from flowq.worker.executor import Executor
from flowq.worker.listener import Listener
from flowq.worker.logs import ERROR, INFO, WARNING, log_event
from flowq.worker.model import Claim, ClaimedJob
from flowq.worker.scheduler import Scheduler
from flowq.worker.supervisor import SUPERVISOR_ENV

if TYPE_CHECKING:
    from flowq.metrics import WorkerMetrics

__all__ = ["Worker", "WorkerConfig"]

DEFAULT_CONCURRENCY: Final = 10
DEFAULT_POLL_INTERVAL: Final = 5.0
DEFAULT_SHUTDOWN_GRACE: Final = 25.0
DB_BACKOFF_MAX: Final = 5.0
# How soon a worker looks again at a queue whose limits held due jobs back (jittered, so
# workers do not take the queue's lock in lockstep): capacity frees as jobs end anywhere.
LIMITED_RETRY: Final = 0.05
# Retry wake-ups remembered at once; beyond that the poll picks retries up.
MAX_WAKE_TIMES: Final = 10_000
# Claim-ahead: a worker claims, beyond its free handlers, what it would start within this
# many seconds at the rate its handlers have been finishing (measured every RATE_WINDOW,
# smoothed), at most CLAIM_AHEAD_MAX_FACTOR x concurrency. Handlers of 1 s at -c 10 finish
# 10 per second: nothing is claimed ahead, so an idle worker gets its share; no-op handlers
# finishing 10,000 per second keep a buffer that makes claims large at any concurrency.
CLAIM_AHEAD_HORIZON: Final = 0.02
CLAIM_AHEAD_MAX_FACTOR: Final = 4
RATE_WINDOW: Final = 0.2
# A job claimed ahead that has not started after this long is handed back (the handlers
# turned slow: the rate measured no longer holds), so that an idle worker can start it.
CLAIM_AHEAD_MAX_WAIT: Final = 0.25


@dataclass
class WorkerConfig:
    """Every knob of a worker, with its default."""

    queues: list[str] | None = None  # None: every queue the app's tasks and steps use
    concurrency: int = DEFAULT_CONCURRENCY
    poll_interval: float = DEFAULT_POLL_INTERVAL
    listen: bool = True
    heartbeat_interval: float = m.DEFAULT_HEARTBEAT_INTERVAL
    stale_after: float = m.DEFAULT_STALE_AFTER
    reap_interval: float = m.DEFAULT_REAP_INTERVAL
    prune_interval: float = m.DEFAULT_PRUNE_INTERVAL
    retention: float = m.DEFAULT_RETENTION
    dead_retention: float = m.DEFAULT_DEAD_RETENTION
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    job_log: bool = True
    maintenance: bool = True
    schedules: bool = True  # run the app's periodic schedules (every worker may: no leader)
    # Prometheus metrics (flowq.metrics, extra flowq[metrics]): served on the first free port
    # of metrics_port .. metrics_port + metrics_ports - 1 (0: any free port); None: off.
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    metrics_ports: int = 1
    # PgBouncer in transaction pooling mode between the worker and PostgreSQL (see the module
    # docstring); listen_url: a direct (or session-pooled) URL to LISTEN on, since LISTEN
    # cannot go through such a pooler (None: with pgbouncer, poll only).
    pgbouncer: bool = False
    listen_url: str | None = None
    # Jobs claimed beyond the free handlers: None sizes it from the measured rate (see
    # CLAIM_AHEAD_HORIZON), 0 turns it off, N caps it at N.
    claim_ahead: int | None = None
    name: str = field(default_factory=lambda: (
        f"{socket.gethostname()[:24]}:{os.getpid()}:{uuid.uuid4().hex[:4]}"))

    def validate(self) -> None:
        if self.concurrency < 1:
            raise ConfigurationError("concurrency must be at least 1")
        if self.claim_ahead is not None and (
                isinstance(self.claim_ahead, bool) or not isinstance(self.claim_ahead, int)
                or self.claim_ahead < 0):
            raise ConfigurationError(f"claim_ahead must be None (automatic) or an integer of "
                                     f"at least 0, got {self.claim_ahead!r}")
        for knob in ("poll_interval", "heartbeat_interval", "stale_after", "reap_interval",
                     "prune_interval"):
            value = getattr(self, knob)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigurationError(f"{knob} must be a positive number of seconds, got "
                                         f"{value!r}")
        for knob in ("shutdown_grace", "retention", "dead_retention"):
            value = getattr(self, knob)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigurationError(f"{knob} must be a number of seconds, got {value!r}")
        if self.stale_after <= 2 * self.heartbeat_interval:
            raise ConfigurationError(
                "stale_after must exceed twice heartbeat_interval, or live jobs get reaped")
        if self.metrics_port is not None and not (
                self.metrics_port >= 0 and self.metrics_ports >= 1
                and self.metrics_port + self.metrics_ports - 1 <= 65535):
            raise ConfigurationError(f"metrics_port must be a TCP port (0 to 65535), got "
                                     f"{self.metrics_port!r}")


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
        self.q = Queries(app.schema)
        self.channel = notify_channel(app.schema)
        c = self.config
        # Pools only where SQLAlchemy is needed: handlers' ctx.session, and maintenance
        # (reaper, pruner, schema checks). The hot path has dedicated psycopg connections.
        self.engines = {
            "maintain": self._engine("maintain", 2, planner_options=MAINTENANCE_OPTIONS),
            "session": self._engine("session", c.concurrency + 2),
        }
        smap = schema_map(app.schema)
        session_bind = self.engines["session"]
        if smap:
            session_bind = session_bind.execution_options(schema_translate_map=smap)
        pgb = c.pgbouncer
        self.claim_conn = DedicatedConnection(self.url, f"flowq claim {c.name}", pgbouncer=pgb)
        self.complete_conn = DedicatedConnection(self.url, f"flowq complete {c.name}",
                                                 pgbouncer=pgb)
        self._wake = threading.Event()
        self.metrics: WorkerMetrics | None = None
        if c.metrics_port is not None:
            from flowq.metrics import WorkerMetrics  # prometheus_client only when asked for

            self.metrics = WorkerMetrics(
                worker=c.name, concurrency=c.concurrency, queues=self.queues,
                in_flight=lambda: self.executor.active, queries=self.q,
                conn=self._metrics_conn())
        self.completer = Completer(self.complete_conn, self.q, job_log=c.job_log,
                                   on_written=self._wake.set, on_scheduled=self._wake_at,
                                   metrics=self.metrics)
        self._notified = False
        self._due: list[float] = []  # monotonic times of retries this worker scheduled (heap)
        self._due_lock = threading.Lock()
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
            end_backend=None if pgb else self._end_backend)
        self.claimer = Claimer(self.claim_conn, self.q, self.queues, c.name,
                               self.executor.submit)
        self.heartbeat = m.Heartbeat(
            DedicatedConnection(self.url, f"flowq heartbeat {c.name}",
                                options=heartbeat_options(c.heartbeat_interval),
                                pgbouncer=pgb),
            self.q, self._held_claims, unsettled=self.executor.unsettled_claims,
            interval=c.heartbeat_interval)
        self.reaper = m.Reaper(self.engines["maintain"], self.q, stale_after=c.stale_after)
        self.pruner = m.Pruner(self.engines["maintain"], self.q, retention=c.retention,
                               dead_retention=c.dead_retention)
        self.listener: Listener | None = None
        listen_on = self.listen_url or (None if pgb else self.url)
        if c.listen and listen_on is not None:
            conninfo = listen_on.set(drivername="postgresql").render_as_string(
                hide_password=False)
            self.listener = Listener(conninfo, self.channel, self.queues, self._on_notify,
                                     application_name=f"flowq listen {c.name}"[:63],
                                     wake_in=self._wake_at)
        self._orphaned = False
        self._batch_threshold = max(1, self.config.concurrency // 2)
        # Claim-ahead (see CLAIM_AHEAD_HORIZON): the jobs held beyond the handlers, resized
        # from the finishing rate every RATE_WINDOW.
        self._ahead = 0
        self._rate = 0.0
        self._rate_at = time.monotonic()
        self._rate_finished = 0
        self._idle_horizon = 0.0
        self._housekeeper: threading.Thread | None = None
        # Periodic schedules: a thread and a connection of their own (see its module).
        self.scheduler: Scheduler | None = None
        if c.schedules and app.schedules:
            self.engines["schedule"] = self._engine("schedule", 1,
                                                    planner_options=MAINTENANCE_OPTIONS)
            self.scheduler = Scheduler(self.engines["schedule"], app, stopping=self._stopping)

    def _engine(self, role: str, size: int, planner_options: str | None = None) -> sa.Engine:
        # No pre-ping: it would cost a round trip per checkout. A dropped connection raises,
        # is invalidated by SQLAlchemy, and the operation is retried by its caller.
        pgb = self.config.pgbouncer
        connect_args: dict[str, object] = {
            "application_name": f"flowq {role} {self.config.name}"[:63], "connect_timeout": 10}
        if pgb:
            connect_args["prepare_threshold"] = None  # nothing prepared outlives a transaction
        elif planner_options:
            connect_args["options"] = planner_options
        engine = sa.create_engine(self.url, pool_size=size, max_overflow=2,
                                  pool_pre_ping=False, connect_args=connect_args)
        if pgb and planner_options:
            set_local_on_begin(engine, planner_options)  # SET LOCAL at every BEGIN
        return engine

    def _metrics_conn(self) -> DedicatedConnection | None:
        """The queue gauges' connection, which holds a session-level advisory lock: never
        through PgBouncer in transaction mode (the lock would stay with a server session
        other clients get); there, only on `listen_url`, else no queue gauges at all."""
        name = f"flowq metrics {self.config.name}"
        if not self.config.pgbouncer:
            return DedicatedConnection(self.url, name, options=MAINTENANCE_OPTIONS)
        if self.listen_url is not None:
            return DedicatedConnection(self.listen_url, name, options=MAINTENANCE_OPTIONS)
        return None

    @property
    def claimed(self) -> int:
        return self.claimer.claimed

    def check_database(self) -> None:
        """Raise a one-sentence flowq error if the database is unreachable, not migrated, or
        migrated to an older revision than this flowq needs."""
        ensure_schema(self.engines["maintain"], self.app.schema, current=True)

    def _register(self) -> None:
        """Enter this worker in `flowq.workers` (what it serves), so operators and `flowq runs
        list` can tell which due jobs no live worker serves."""
        c = self.config
        with self.engines["maintain"].begin() as conn:
            conn.execute(self.q.register_worker, {
                "name": c.name, "host": socket.gethostname(), "pid": os.getpid(),
                "queues": self.queues, "tasks": [p.name for p in self.app],
                "concurrency": c.concurrency, "version": _version()})

    def _declare_queues(self) -> None:
        """Write this app's queue declarations (limits) and which of its queues key their
        jobs, so that every worker enforces them; then read which queues are controlled."""
        declared = self.app.declared_queues
        keyed = self.app.keyed_queues
        with self.engines["maintain"].begin() as conn:
            if declared:
                conn.execute(self.q.declare_queues, {
                    "names": [d.name for d in declared],
                    "concurrencies": [d.concurrency for d in declared],
                    "rate_limits": [d.rate_limit.limit if d.rate_limit else None
                                    for d in declared],
                    "rate_periods": [d.rate_limit.seconds if d.rate_limit else None
                                     for d in declared],
                    "worker": self.config.name})
            if keyed:
                conn.execute(self.q.mark_keyed_queues, {"names": keyed})
        self.claimer.refresh()

    def _beat_registry(self) -> None:
        if not self.heartbeat.conn.execute(self.q.beat_worker, {"name": self.config.name}):
            self._register()  # expired while this worker was stalled: enter it again

    # -- signals from the parts ---------------------------------------------------------------

    def _on_notify(self) -> None:
        self._notified = True
        self._wake.set()

    def _wake_at(self, delay: float) -> None:
        """A job is due in `delay` seconds (a retry this worker wrote, or a delayed job whose
        NOTIFY it saw): claim then, not at the next poll, so a 0.2 s retry runs 0.2 s later
        whatever the poll interval."""
        if not math.isfinite(delay) or delay <= 0:
            self._wake.set()  # now (NaN or infinity name no time: a hostile NOTIFY)
            return
        if delay >= self.config.poll_interval:
            return  # the poll comes first anyway
        with self._due_lock:
            if len(self._due) < MAX_WAKE_TIMES:
                heapq.heappush(self._due, time.monotonic() + delay)
        self._wake.set()

    def _take_due(self, now: float) -> tuple[bool, float]:
        """(whether a scheduled retry is due now, when the next one is)."""
        due = False
        with self._due_lock:
            while self._due and self._due[0] <= now:
                heapq.heappop(self._due)
                due = True
            return due, self._due[0] if self._due else math.inf

    def _end_backend(self, pid: int) -> None:
        with self.engines["maintain"].connect() as conn:
            conn.execute(self.q.end_backend, {"pid": pid})

    def _on_slot_free(self, in_flight: int) -> None:
        # Wake the claim loop only when it would claim: a batch's worth of free slots, or
        # none busy. Waking it per finished job would cost a wake-up per job for nothing.
        if in_flight == 0 or (self.config.concurrency + self._ahead - in_flight
                              >= self._batch_threshold):
            self._wake.set()

    def _free_slots(self) -> int:
        """Slots a claim may fill: the handlers, plus the claim-ahead, less the claims held.
        Outcomes the completer has not written yet are claims still held: past a
        concurrency's worth of them they take slots too, so a slow database throttles
        claiming instead of piling up `running` rows that all need heartbeats."""
        c = self.config.concurrency
        return c + self._ahead - self.executor.in_flight - max(0, self.completer.queued - c)

    def _size_claim_ahead(self, now: float) -> None:
        """Resize the claim-ahead from the rate handlers finished at since the last window;
        hand back what waited in it too long (and start measuring afresh)."""
        if self.executor.oldest_ready_age() > CLAIM_AHEAD_MAX_WAIT:
            stale = self.executor.take_ready(older_than=CLAIM_AHEAD_MAX_WAIT)
            if stale:
                self._release(stale, "handed back jobs claimed ahead that did not start in "
                              f"{CLAIM_AHEAD_MAX_WAIT}s (handlers slowed down)", INFO)
            self._rate, self._ahead = 0.0, 0
            self._batch_threshold = max(1, self.config.concurrency // 2)
        if now - self._rate_at < RATE_WINDOW:
            return
        finished = self.executor.finished
        rate = (finished - self._rate_finished) / (now - self._rate_at)
        self._rate = rate if rate > self._rate else 0.5 * (self._rate + rate)
        self._rate_at, self._rate_finished = now, finished
        c = self.config
        cap = (c.concurrency * CLAIM_AHEAD_MAX_FACTOR if c.claim_ahead is None
               else c.claim_ahead)
        self._ahead = min(cap, int(self._rate * CLAIM_AHEAD_HORIZON))
        self._batch_threshold = max(1, (c.concurrency + self._ahead) // 2)

    def _held_claims(self) -> list[Claim]:
        return self.executor.running_claims() + self.completer.pending_claims()

    # -- claiming -----------------------------------------------------------------------------

    def claim(self, limit: int) -> list[ClaimedJob]:
        """Claim up to `limit` due jobs without running them (the bench measures claims)."""
        got: list[ClaimedJob] = []
        self.claimer.run_once(limit, submit=got.append)
        return got

    # -- the loop -----------------------------------------------------------------------------

    def start_parts(self) -> None:
        c = self.config
        if self.metrics is not None and c.metrics_port is not None:
            # First: a port in use stops the worker before anything started.
            self.metrics.serve(c.metrics_addr, range(c.metrics_port,
                                                     c.metrics_port + c.metrics_ports))
            log_event(INFO, "serving metrics", url=f"http://{c.metrics_addr}:"
                      f"{self.metrics.port}/metrics")
        try:
            self.check_database()
            self._declare_queues()
            self._register()
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            raise
        self.heartbeat.also = self._beat_registry
        self.heartbeat.on_cancelled = self.executor.cancel
        self.completer.start()
        self.executor.start()
        self.heartbeat.start()
        if self.listener is not None:
            self.listener.start()
        self._housekeeper = threading.Thread(target=self._housekeeping,
                                             name="flowq-maintenance", daemon=True)
        self._housekeeper.start()
        if self.scheduler is not None:
            self.scheduler.start()
        log_event(INFO, "worker started", database=describe_url(self.url),
                  queues=",".join(self.queues), concurrency=self.config.concurrency,
                  worker=self.config.name, listen=self.listener is not None,
                  **({"pgbouncer": True} if self.config.pgbouncer else {}),
                  poll_s=self.config.poll_interval)

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
        self._idle_horizon = idle_horizon
        self.start_parts()
        try:
            self._loop(until_idle)
        finally:
            self._shutdown()

    def _loop(self, until_idle: bool) -> None:
        c = self.config
        batch_threshold = self._batch_threshold
        next_poll = 0.0
        backlog = True
        backoff = 0.1
        while not self._stopping.is_set():
            if self._signalled is not None:
                self._begin_shutdown(self._signalled)
                break
            now = time.monotonic()
            self._size_claim_ahead(now)
            batch_threshold = self._batch_threshold
            free = self._free_slots()
            notified, self._notified = self._notified, False
            retry_due, next_due = self._take_due(now)
            due_poll = now >= next_poll
            # `held_back`: the last claim found due jobs a queue's limits held back; capacity
            # frees as jobs end (ours wake this loop; others' are seen at the quick re-poll).
            if free > 0 and (notified or due_poll or retry_due or self.claimer.held_back
                             or (backlog and free >= batch_threshold)):
                try:
                    if due_poll:  # pauses and limits others set: seen within a poll
                        self.claimer.refresh()
                    got = self.claimer.run_once(free)
                    backoff = 0.1
                except DB_ERRORS as exc:
                    log_event(WARNING, "claim failed; retrying", error=first_line(exc),
                              retry_in_s=round(backoff, 2))
                    self._stopping.wait(backoff)
                    backoff = min(backoff * 2, DB_BACKOFF_MAX)
                    continue
                if due_poll:
                    next_poll = now + c.poll_interval
                if self.claimer.held_back:  # a limit, not an empty queue, stopped the claim
                    next_poll = min(next_poll, now + LIMITED_RETRY * (0.5 + random.random()))
                backlog = got == free
                if until_idle and not got and self.executor.in_flight == 0:
                    if self.completer.flush(30.0) and not self._has_due_jobs():
                        return
                    continue
                if backlog and self._free_slots() >= batch_threshold:
                    continue
            timeout = max(0.0, min(next_poll, next_due) - time.monotonic())
            if until_idle:
                timeout = min(timeout, 0.05)
            self._wake.wait(min(timeout, 0.25))
            self._wake.clear()

    def _has_due_jobs(self) -> bool:
        rows = self.claim_conn.execute(self.q.exists_due_jobs, {
            "queues": self.queues, "horizon": self._idle_horizon})
        return bool(rows[0][0])

    def warn_stranded(self) -> int:
        """Log due jobs of this app's tasks waiting on queues no step of the app uses (a
        producer's `queue=` that no worker serves by default); returns how many groups."""
        with self.engines["maintain"].connect() as conn:
            rows = conn.execute(self.q.find_stranded_jobs, {
                "tasks": [p.name for p in self.app], "queues": self.app.queues}).all()
        for r in rows:
            log_event(WARNING, "due jobs wait on a queue no worker of this app serves by "
                      "default: start one with --queues including it, or enqueue with the "
                      "task's own queue", queue=r.queue, task=r.task, jobs=r.n,
                      oldest_due_s=round(r.oldest_s, 1))
        return len(rows)

    def _housekeeping(self) -> None:
        """Reaper and pruner (heartbeats have their own thread), and the supervisor check."""
        c = self.config
        try:
            self.warn_stranded()
        except Exception as exc:  # a hint only: never stop the worker for it
            log_event(WARNING, "could not look for stranded jobs", error=first_line(exc))
        now = time.monotonic()
        due = {"reap": now + 1.0, "prune": now + 5.0}
        services = {"reap": (self.reaper.run_once, c.reap_interval),
                    "prune": (self.pruner.run_once, c.prune_interval)}
        supervisor = os.environ.get(SUPERVISOR_ENV)
        while not self._stopping.is_set():
            if supervisor and str(os.getppid()) != supervisor and not self._orphaned:
                self._orphaned = True
                log_event(WARNING, "the --processes supervisor is gone; shutting down",
                          supervisor_pid=supervisor)
                self._signalled = signal.SIGTERM  # the claim loop starts a clean shutdown
            for name, (action, interval) in services.items():
                if not c.maintenance or time.monotonic() < due[name]:
                    continue
                try:
                    action()
                except sa.exc.DBAPIError as exc:
                    log_event(WARNING, f"{name} failed; will retry", error=first_line(exc))
                except Exception as exc:  # never let housekeeping die silently
                    log_event(ERROR, f"{name} crashed; will retry", error=repr(exc))
                due[name] = time.monotonic() + interval
            self._stopping.wait(max(0.05, min(due.values()) - time.monotonic()))

    # -- stopping -----------------------------------------------------------------------------

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
            thread.join(self.config.shutdown_grace + 30.0)
        if thread.is_alive():
            raise FlowqError("the worker did not stop within its grace period and 30 s")
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

    def _begin_shutdown(self, signum: int) -> None:
        log_event(INFO, "shutting down: no new claims; waiting for running jobs",
                  signal=signal.Signals(signum).name, grace_s=self.config.shutdown_grace,
                  running=self.executor.in_flight)
        self.stop()

    def _shutdown(self) -> None:
        c = self.config
        self._stopping.set()  # also when run(until_idle=True) returns on its own
        deadline = time.monotonic() + c.shutdown_grace
        ahead = self.executor.take_ready()  # claimed ahead, never started: hand them back
        if ahead:
            self._release(ahead, "released jobs claimed ahead, not started (attempt not "
                                 "counted)", INFO)
        while self.executor.in_flight and time.monotonic() < deadline:
            self._wake.wait(0.05)
            self._wake.clear()
        self.completer.flush(max(1.0, deadline - time.monotonic()))
        unfinished = self.executor.running_claims()
        if unfinished:
            self._release(unfinished)
        self.completer.stop(timeout=5.0)
        self.executor.stop()
        try:
            with self.engines["maintain"].begin() as conn:
                conn.execute(self.q.unregister_worker, {"name": c.name})
        except DB_ERRORS as exc:  # the entry expires on its own
            log_event(WARNING, "could not leave the workers registry", error=first_line(exc))
        self.heartbeat.stop()
        if self._housekeeper is not None:
            self._housekeeper.join(timeout=5.0)
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.listener is not None:
            self.listener.stop()
        log_event(INFO, "worker stopped", worker=c.name, claimed=self.claimed,
                  released=len(unfinished) + len(ahead))
        if self.metrics is not None:
            self.metrics.close()
        for engine in self.engines.values():
            engine.dispose()
        self.claim_conn.close()
        self.complete_conn.close()

    def _release(self, claims: list[Claim],
                 note: str = "released unfinished jobs at shutdown (attempt not counted)",
                 level: int = WARNING) -> None:
        claims = sorted(claims)  # the lock order of heartbeats and completions
        try:
            # The claim loop's connection: the loop (or the shutdown after it) is the caller.
            rows = self.claim_conn.execute(self.q.release_jobs, {
                "ids": [i for i, _ in claims], "leases": [lease for _, lease in claims],
                "channel": self.channel})
            log_event(level, note, job_ids=",".join(str(r[0]) for r in rows))
        except DB_ERRORS as exc:
            log_event(ERROR, "could not release unfinished jobs; the reaper will requeue them",
                      error=first_line(exc))


def _version() -> str:
    try:
        return importlib.metadata.version("flowq")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
