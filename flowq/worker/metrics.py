"""Prometheus metrics of a worker: `flowq worker --metrics-port PORT` (extra `flowq[metrics]`).

`WorkerMetrics` owns one `prometheus_client.CollectorRegistry` per worker (no global state:
two workers in one process export their own numbers) and serves it over HTTP in the
Prometheus text format. The worker's parts report to it through two tiny hooks: the
completer calls `observe_outcome` where it logs an outcome, the executor calls
`observe_pickup` as each attempt starts; the jobs in flight (handlers running, not the jobs
claimed ahead) are read from the executor at scrape time.

The queue gauges (depth, oldest due age) describe the whole database, not one worker, so one
worker at a time collects them: at a scrape, a worker queries them only while it holds a
session-level advisory lock (`pg_try_advisory_lock`), taken by the first worker scraped and
kept by its metrics connection until that worker stops (or the connection drops; the next
worker scraped then takes over). Every other worker exports no queue gauge at all, so
summing or alerting over all targets never double-counts; `flowq_queue_metrics_collector`
says which worker collects.

prometheus_client is imported only when a worker is given a metrics port: without it, flowq
imports and runs as before, and asking for metrics says which extra to install. See
docs/observability.md for every metric.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

from flowq.db.store import Store
from flowq.errors import ConfigurationError
from flowq.storable import first_line

if TYPE_CHECKING:
    from flowq.db.rows import ClaimedJob
    from flowq.db.store.queues import QueueMetrics
    from flowq.worker.connection import DedicatedConnection

__all__ = ["MISSING_EXTRA", "OUTCOMES", "OutcomeObserver", "WorkerMetrics", "check_ports_free"]

MISSING_EXTRA: Final = ("metrics need the prometheus_client package, which is not installed: "
                        "pip install 'flowq[metrics]'")
OUTCOMES: Final = ("succeeded", "retried", "suspended", "dead", "cancelled", "lost")
# A job's status after an outcome was written, as an outcome label.
_KIND: Final = {"succeeded": "succeeded", "pending": "retried", "dead": "dead",
                "cancelled": "cancelled"}
DURATION_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                           60.0, 120.0, 300.0, 600.0)
PICKUP_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                         300.0, 600.0, 1800.0, 3600.0)


class OutcomeObserver(Protocol):
    """What the completer reports to (`Completer.metrics`)."""

    def observe_outcome(self, job: ClaimedJob, outcome: str, duration: float | None) -> None:
        ...


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigurationError(MISSING_EXTRA) from None
    return prometheus_client


def _describe_ports(addr: str, ports: Sequence[int]) -> str:
    if len(ports) == 1:
        return f"{addr}:{ports[0]}"
    return f"{addr}:{ports[0]}-{ports[-1]}"


def check_ports_free(addr: str, ports: Sequence[int]) -> None:
    """Raise a one-sentence `ConfigurationError` unless every port of `ports` can be bound on
    `addr` now (`--processes N` checks its N ports before starting any child)."""
    import socket

    if ports and ports[-1] > 65535:
        raise ConfigurationError(f"cannot serve metrics on {_describe_ports(addr, ports)}: "
                                 "the ports end past 65535; pick a lower --metrics-port")
    for port in ports:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr, port))
            except OSError as exc:
                raise ConfigurationError(
                    f"cannot serve metrics on {addr}:{port}: {_why(exc)}; pick another "
                    f"--metrics-port (with --processes N, ports PORT to PORT+N-1 are used)"
                    ) from None


def _why(exc: OSError) -> str:
    import errno

    if exc.errno == errno.EADDRINUSE:
        return "the port is in use"
    return first_line(exc.strerror or exc).lower()


class WorkerMetrics:
    """The metrics of one worker, in a registry of its own; `serve` exposes them."""

    def __init__(self, *, worker: str, concurrency: int, queues: Sequence[str],
                 in_flight: Callable[[], int], schema: str,
                 conn: DedicatedConnection | None) -> None:
        pc = _prometheus()
        self.registry = pc.CollectorRegistry(auto_describe=True)
        self.worker = worker
        self.outcomes = pc.Counter(
            "flowq_jobs", "Attempts whose outcome this worker recorded, by outcome.",
            ["task", "queue", "outcome"], registry=self.registry)
        self.duration = pc.Histogram(
            "flowq_job_duration_seconds", "Seconds a handler ran, per attempt.",
            ["task", "queue"], buckets=DURATION_BUCKETS, registry=self.registry)
        self.pickup = pc.Histogram(
            "flowq_job_pickup_delay_seconds",
            "Seconds from a job's due time (run_at) to its claim by this worker.",
            ["task", "queue"], buckets=PICKUP_BUCKETS, registry=self.registry)
        in_flight_gauge = pc.Gauge("flowq_jobs_in_flight",
                                   "Attempts this worker is running now.",
                                   registry=self.registry)
        in_flight_gauge.set_function(in_flight)
        pc.Gauge("flowq_worker_concurrency", "Handlers this worker runs at once at most.",
                 registry=self.registry).set(concurrency)
        self.queues = _QueueCollector(pc, schema, conn, list(queues))
        self.registry.register(self.queues)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        self.addr: str | None = None

    # -- hooks ------------------------------------------------------------------------------

    def observe_outcome(self, job: ClaimedJob, outcome: str, duration: float | None) -> None:
        """Count one recorded outcome: `outcome` is one of `OUTCOMES`, or a job status after
        the write (`pending` is a retry). `duration` None: the attempt's time is unknown."""
        kind = _KIND.get(outcome, outcome)
        self.outcomes.labels(job.task, job.queue, kind).inc()
        if duration is not None and kind != "lost":
            self.duration.labels(job.task, job.queue).observe(max(0.0, duration))

    def observe_pickup(self, job: ClaimedJob, waited: float = 0.0) -> None:
        """Due time to start: to the claim by the database's clock, plus the seconds the job
        then waited in the worker's claim-ahead."""
        self.pickup.labels(job.task, job.queue).observe(max(0.0, job.pickup_delay + waited))

    # -- serving ----------------------------------------------------------------------------

    def serve(self, addr: str, ports: Sequence[int]) -> int:
        """Serve /metrics on the first port of `ports` free on `addr` (0: any free port);
        the port bound. Raises a one-sentence `ConfigurationError` when none is free."""
        pc = _prometheus()
        error: OSError | None = None
        for port in ports:
            try:
                server, thread = pc.start_http_server(port, addr=addr, registry=self.registry)
            except OSError as exc:
                error = exc
                continue
            self._server, self._thread = server, thread
            self.port, self.addr = int(server.server_port), addr
            return self.port
        assert error is not None
        where = _describe_ports(addr, ports)
        what = "the port is in use" if len(ports) == 1 else "every port is in use"
        if _why(error) != "the port is in use":
            what = _why(error)
        raise ConfigurationError(f"cannot serve metrics on {where}: {what}; pick another "
                                 "--metrics-port")

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.queues.close()


class _QueueCollector:
    """Queue depth and oldest due age, from whichever worker holds the collector lock."""

    def __init__(self, pc: Any, schema: str, conn: DedicatedConnection | None,
                 own_queues: list[str]) -> None:
        from prometheus_client.core import GaugeMetricFamily

        self._metric = GaugeMetricFamily
        self.conn = conn
        # Sends on the dedicated connection (which reopens itself after a failure).
        self.store = Store(conn.execute, schema) if conn is not None else None
        self.own_queues = own_queues
        self.lock_name = f"flowq metrics {schema}"
        self._pid = 0  # the backend that took the lock, while this worker collects
        self._lock = threading.Lock()  # scrapes may overlap: one query at a time

    def describe(self) -> Iterable[Any]:
        return ()  # collected at scrape time only (and only by one worker)

    def collect(self) -> Iterator[Any]:
        with self._lock:
            rows = self._query()
        collector = self._metric("flowq_queue_metrics_collector",
                                 "1 if this worker collects the queue gauges now, else 0 "
                                 "(one worker at a time does).")
        collector.add_metric([], 1.0 if rows is not None else 0.0)
        yield collector
        if rows is None:
            return
        depth = self._metric("flowq_queue_jobs", "Jobs of a queue by state: due (pending, "
                             "run_at reached), scheduled (pending, run_at ahead), running.",
                             labels=["queue", "state"])
        oldest = self._metric("flowq_queue_oldest_due_seconds",
                              "Age of the oldest due job of a queue (0 when none is due).",
                              labels=["queue"])
        seen = {r.queue: r for r in rows}
        for name in sorted({*seen, *self.own_queues}):
            r = seen.get(name)
            due, scheduled, running, oldest_s = ((r.due, r.scheduled, r.running, r.oldest_s)
                                                 if r is not None else (0, 0, 0, 0.0))
            depth.add_metric([name, "due"], float(due))
            depth.add_metric([name, "scheduled"], float(scheduled))
            depth.add_metric([name, "running"], float(running))
            oldest.add_metric([name], float(oldest_s or 0.0))
        yield depth
        yield oldest

    def _query(self) -> list[QueueMetrics] | None:
        """The queue rows if this worker collects (taking the lock if free), else None."""
        from flowq.worker.connection import DB_ERRORS
        from flowq.worker.logs import WARNING, log_event

        if self.conn is None or self.store is None:
            return None
        try:
            leads, pid = self.store.lead_metrics(self.lock_name, self._pid)
            self._pid = pid if leads else 0
            if not leads:
                return None
            return self.store.queue_metrics()
        except DB_ERRORS as exc:
            self._pid = 0
            self.conn.close()  # the lock goes with the session; taken again next scrape
            log_event(WARNING, "could not collect queue metrics", error=first_line(exc))
            return None

    def close(self) -> None:
        if self.conn is not None:
            with self._lock, contextlib.suppress(Exception):
                self.conn.close()
