"""The worker: claims jobs for its free slots, runs them, records outcomes, and keeps house.

Parts, each small (see the modules beside this one): a `Listener` (LISTEN, wakes the claim
loop), the claim loop in `Worker.run` (claims only for free slots, in batches, one queue at a
time in rotation), an `Executor` (threads and an event loop), a `Completer` (fenced, batched
writes), and maintenance (`Heartbeat`, `Reaper`, `Pruner`) on one background thread.

Options and defaults (`WorkerConfig`): concurrency 10, poll every 5 s (so a due job starts
within 5 s even without NOTIFY), listen on, heartbeat 5 s, reap jobs whose heartbeat is 30 s
stale every 10 s, prune every 60 s (retention 3 days, dead 14 days), shutdown grace 25 s.

Each role has its own small connection pool named in `application_name` (`flowq claim`,
`flowq complete`, `flowq maintain`, `flowq session`, `flowq listen`), so operators can see
them in pg_stat_activity, and a dropped connection in one role never stalls another.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.engine import URL

from flowq.app import FlowQ
from flowq.context import StepSession
from flowq.db import describe_url, ensure_schema, normalize_url
from flowq.errors import ConfigurationError
from flowq.queries import Queries
from flowq.schema import notify_channel, schema_map
from flowq.worker import maintenance as m
from flowq.worker.completer import Completer
from flowq.worker.connection import DB_ERRORS, MAINTENANCE_OPTIONS, DedicatedConnection
from flowq.worker.executor import Executor
from flowq.worker.listener import Listener
from flowq.worker.logs import log_event
from flowq.worker.model import ClaimedJob
from flowq.worker.supervisor import SUPERVISOR_ENV

__all__ = ["Worker", "WorkerConfig"]

DEFAULT_CONCURRENCY: Final = 10
DEFAULT_POLL_INTERVAL: Final = 5.0
DEFAULT_SHUTDOWN_GRACE: Final = 25.0
DB_BACKOFF_MAX: Final = 5.0
INFO, WARNING, ERROR = 20, 30, 40


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
    name: str = field(default_factory=lambda: (
        f"{socket.gethostname()[:24]}:{os.getpid()}:{uuid.uuid4().hex[:4]}"))

    def validate(self) -> None:
        if self.concurrency < 1:
            raise ConfigurationError("concurrency must be at least 1")
        for knob in ("poll_interval", "heartbeat_interval", "stale_after", "reap_interval",
                     "prune_interval"):
            if getattr(self, knob) <= 0:
                raise ConfigurationError(f"{knob} must be positive")
        if self.stale_after <= 2 * self.heartbeat_interval:
            raise ConfigurationError(
                "stale_after must exceed twice heartbeat_interval, or live jobs get reaped")


class Worker:
    """Runs the jobs of `app` from the database at `url` until `stop()` or a signal."""

    def __init__(self, app: FlowQ, url: str | URL, config: WorkerConfig | None = None) -> None:
        self.app = app
        self.config = config or WorkerConfig()
        self.config.validate()
        app.check()
        self.url = normalize_url(url)
        self.queues = list(self.config.queues or app.queues)
        if not self.queues:
            raise ConfigurationError("the app defines no tasks, so there is no queue to serve: "
                                     "register tasks or pass --queues")
        self.q = Queries(app.schema)
        self.channel = notify_channel(app.schema)
        c = self.config
        self.engines = {
            "claim": self._engine("claim", 1, autocommit=True),
            "complete": self._engine("complete", 2, autocommit=True),
            "maintain": self._engine("maintain", 2, planner_options=MAINTENANCE_OPTIONS),
            "session": self._engine("session", c.concurrency + 2),
        }
        smap = schema_map(app.schema)
        session_bind = self.engines["session"]
        if smap:
            session_bind = session_bind.execution_options(schema_translate_map=smap)
        # The hot path (claims, completions) runs on dedicated psycopg connections.
        self.claim_conn = DedicatedConnection(self.url, f"flowq claim {c.name}")
        self.complete_conn = DedicatedConnection(self.url, f"flowq complete {c.name}")
        self.completer = Completer(self.complete_conn, self.q, job_log=c.job_log)
        self._wake = threading.Event()
        self.completer.on_written = self._wake.set
        self._notified = False
        self._stopping = threading.Event()
        self._signals = 0
        self._signalled: int | None = None  # set by the signal handler, acted on by the loop
        self.executor = Executor(
            app, self.completer, concurrency=c.concurrency,
            session_factory=lambda: StepSession(bind=session_bind),
            on_slot_free=self._on_slot_free)
        self.heartbeat = m.Heartbeat(self.engines["maintain"], self.q, self._held_claims,
                                     unsettled=self.executor.unsettled_claims)
        self.reaper = m.Reaper(self.engines["maintain"], self.q, stale_after=c.stale_after)
        self.pruner = m.Pruner(self.engines["maintain"], self.q, retention=c.retention,
                               dead_retention=c.dead_retention)
        self.listener: Listener | None = None
        if c.listen:
            conninfo = self.url.set(drivername="postgresql").render_as_string(
                hide_password=False)
            self.listener = Listener(conninfo, self.channel, self.queues, self._on_notify,
                                     application_name=f"flowq listen {c.name}"[:63])
        self._rotation = 0
        self._orphaned = False
        self._batch_threshold = max(1, self.config.concurrency // 2)
        self._idle_horizon = 0.0
        self._housekeeper: threading.Thread | None = None
        self.claimed = 0

    def _engine(self, role: str, size: int, autocommit: bool = False,
                planner_options: str | None = None) -> sa.Engine:
        # No pre-ping: it would cost a round trip per checkout. A dropped connection raises,
        # is invalidated by SQLAlchemy, and the operation is retried by its caller.
        # Autocommit where every write is one self-contained statement (claims, completions):
        # it saves the BEGIN and COMMIT round trips, two of every three.
        return sa.create_engine(
            self.url, pool_size=size, max_overflow=2, pool_pre_ping=False,
            isolation_level="AUTOCOMMIT" if autocommit else "READ COMMITTED",
            connect_args={"application_name": f"flowq {role} {self.config.name}"[:63],
                          "connect_timeout": 10,
                          **({"options": planner_options} if planner_options else {})})

    # -- signals from the parts ---------------------------------------------------------------

    def _on_notify(self) -> None:
        self._notified = True
        self._wake.set()

    def _on_slot_free(self, in_flight: int) -> None:
        # Wake the claim loop only when it would claim: a batch's worth of free slots, or
        # none busy. Waking it per finished job would cost a wake-up per job for nothing.
        if in_flight == 0 or self.config.concurrency - in_flight >= self._batch_threshold:
            self._wake.set()

    def _free_slots(self) -> int:
        """Slots a claim may fill. Outcomes the completer has not written yet are claims still
        held: past a concurrency's worth of them they take slots too, so a slow database
        throttles claiming instead of piling up `running` rows that all need heartbeats."""
        c = self.config.concurrency
        return c - self.executor.in_flight - max(0, self.completer.queued - c)

    def _held_claims(self) -> list[tuple[int, int]]:
        return self.executor.running_claims() + self.completer.pending_claims()

    # -- claiming -----------------------------------------------------------------------------

    def claim(self, limit: int) -> list[ClaimedJob]:
        """Claim up to `limit` due jobs, visiting the queues in rotation."""
        out: list[ClaimedJob] = []
        n = len(self.queues)
        start, self._rotation = self._rotation, (self._rotation + 1) % n
        for i in range(n):  # autocommit: each claim is one atomic statement
            want = limit - len(out)
            if want <= 0:
                break
            rows = self.claim_conn.execute(self.q.claim_jobs, {
                "queue": self.queues[(start + i) % n], "limit": want,
                "worker": self.config.name})
            out.extend(ClaimedJob(*r) for r in rows)
        self.claimed += len(out)
        return out

    # -- the loop -----------------------------------------------------------------------------

    def start_parts(self) -> None:
        ensure_schema(self.engines["claim"], self.app.schema)
        self.completer.start()
        self.executor.start()
        if self.listener is not None:
            self.listener.start()
        self._housekeeper = threading.Thread(target=self._housekeeping,
                                             name="flowq-maintenance", daemon=True)
        self._housekeeper.start()
        log_event(INFO, "worker started", database=describe_url(self.url),
                  queues=",".join(self.queues), concurrency=self.config.concurrency,
                  worker=self.config.name, listen=self.config.listen,
                  poll_s=self.config.poll_interval)

    def run(self, *, install_signals: bool = True, until_idle: bool = False,
            idle_horizon: float = 0.0) -> None:
        """Run until stopped, or with `until_idle` until no job is due within `idle_horizon`
        seconds (so retries scheduled shortly are waited for) and nothing is running."""
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
            self.executor.check_timeouts()
            free = self._free_slots()
            now = time.monotonic()
            notified, self._notified = self._notified, False
            due_poll = now >= next_poll
            if free > 0 and (notified or due_poll or (backlog and free >= batch_threshold)):
                try:
                    jobs = self.claim(free)
                    backoff = 0.1
                except DB_ERRORS as exc:
                    log_event(WARNING, "claim failed; retrying", error=_first_line(exc),
                              retry_in_s=round(backoff, 2))
                    self._stopping.wait(backoff)
                    backoff = min(backoff * 2, DB_BACKOFF_MAX)
                    continue
                if due_poll:
                    next_poll = now + c.poll_interval
                backlog = len(jobs) == free
                for job in jobs:
                    self.executor.submit(job)
                if until_idle and not jobs and self.executor.in_flight == 0:
                    if self.completer.flush(30.0) and not self._has_due_jobs():
                        return
                    continue
                if backlog and self._free_slots() >= batch_threshold:
                    continue
            timeout = max(0.0, next_poll - time.monotonic())
            if until_idle:
                timeout = min(timeout, 0.05)
            self._wake.wait(min(timeout, 0.25))
            self._wake.clear()

    def _has_due_jobs(self) -> bool:
        with self.engines["claim"].connect() as conn:
            return bool(conn.execute(self.q.exists_due_jobs, {
                "queues": self.queues, "horizon": self._idle_horizon}).scalar())

    def _housekeeping(self) -> None:
        c = self.config
        now = time.monotonic()
        next_beat, next_reap, next_prune = now + c.heartbeat_interval, now + 1.0, now + 5.0
        supervisor = os.environ.get(SUPERVISOR_ENV)
        while not self._stopping.is_set():
            now = time.monotonic()
            if supervisor and str(os.getppid()) != supervisor and not self._orphaned:
                self._orphaned = True
                log_event(WARNING, "the --processes supervisor is gone; shutting down",
                          supervisor_pid=supervisor)
                self._signalled = signal.SIGTERM  # the claim loop starts a clean shutdown
            for due, action, interval in (("beat", self.heartbeat.run_once, c.heartbeat_interval),
                                          ("reap", self.reaper.run_once, c.reap_interval),
                                          ("prune", self.pruner.run_once, c.prune_interval)):
                when = {"beat": next_beat, "reap": next_reap, "prune": next_prune}[due]
                if now < when or (due != "beat" and not c.maintenance):
                    continue
                try:
                    action()
                except sa.exc.DBAPIError as exc:
                    log_event(WARNING, f"{due} failed; will retry", error=_first_line(exc))
                except Exception as exc:  # never let housekeeping die silently
                    log_event(ERROR, f"{due} crashed; will retry", error=repr(exc))
                nxt = time.monotonic() + interval
                if due == "beat":
                    next_beat = nxt
                elif due == "reap":
                    next_reap = nxt
                else:
                    next_prune = nxt
            self._stopping.wait(max(0.05, min(next_beat, next_reap, next_prune)
                                    - time.monotonic()))

    # -- stopping -----------------------------------------------------------------------------

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
        while self.executor.in_flight and time.monotonic() < deadline:
            self.executor.check_timeouts()
            self._wake.wait(0.05)
            self._wake.clear()
        self.completer.flush(max(1.0, deadline - time.monotonic()))
        unfinished = self.executor.running_claims()
        if unfinished:
            self._release(unfinished)
        self.completer.stop(timeout=5.0)
        self.executor.stop()
        if self._housekeeper is not None:
            self._housekeeper.join(timeout=5.0)
        if self.listener is not None:
            self.listener.stop()
        log_event(INFO, "worker stopped", worker=c.name, claimed=self.claimed,
                  released=len(unfinished))
        for engine in self.engines.values():
            engine.dispose()
        self.claim_conn.close()
        self.complete_conn.close()

    def _release(self, claims: list[tuple[int, int]]) -> None:
        try:
            with self.engines["complete"].begin() as conn:
                rows = conn.execute(self.q.release_jobs, {"ids": [i for i, _ in claims],
                                                          "attempts": [a for _, a in claims]})
                released = [r.id for r in rows]
            log_event(WARNING, "released unfinished jobs at shutdown (attempt not counted)",
                      job_ids=",".join(map(str, released)))
        except sa.exc.DBAPIError as exc:
            log_event(ERROR, "could not release unfinished jobs; the reaper will requeue them",
                      error=_first_line(exc))


def _first_line(exc: BaseException) -> str:
    orig: Any = getattr(exc, "orig", None) or exc
    text = str(orig).strip()
    return text.splitlines()[0] if text else type(orig).__name__
