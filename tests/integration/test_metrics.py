"""Prometheus metrics (`flowq worker --metrics-port`, flowq.worker.metrics) against a real
PostgreSQL: real workers serve /metrics on a real port, and the tests scrape it over HTTP."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from support import enqueue_id as enqueue
from support import free_port
from tenacity import stop_after_attempt, wait_fixed

import flowq
from flowq.durable.context import Context
from flowq.testing import job_rows, wait_until
from flowq.worker import Worker, WorkerConfig

ONE_TRY = flowq.Retry(stop=stop_after_attempt(1))
TWO_TRIES = flowq.Retry(stop=stop_after_attempt(2), wait=wait_fixed(0))


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of http://127.0.0.1:PORT/metrics: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def names(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> set[str]:
    return {name for name, _ in samples}


@contextlib.contextmanager
def running_worker(app: flowq.FlowQ, url: str, **config: Any) -> Iterator[Worker]:
    """`flowq.testing.running_worker`, serving metrics on a free port."""
    config.setdefault("metrics_port", 0)
    with flowq.testing.running_worker(app, url, **config) as w:
        wait_until(lambda: w.metrics is not None and w.metrics.port, message="metrics served")
        yield w


def port_of(w: Worker) -> int:
    assert w.metrics is not None and w.metrics.port is not None
    return w.metrics.port


def test_outcomes_durations_pickup_delay_in_flight_and_queue_gauges(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    release = threading.Event()

    @app.task()
    def ok(ctx: Context) -> None:
        import time
        time.sleep(0.05)

    @app.task(retry=TWO_TRIES)
    def flaky(ctx: Context) -> None:
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")

    @app.task(retry=ONE_TRY)
    def doomed(ctx: Context) -> None:
        raise ValueError("always")

    @app.task()
    def cancelled(ctx: Context) -> None:
        raise flowq.CancelRun("not wanted")

    @app.task(queue="blocking")
    def hold(ctx: Context) -> None:
        assert release.wait(30)

    @app.task(queue="elsewhere")
    def unserved(ctx: Context) -> None:
        pass

    late = datetime.now(timezone.utc) - timedelta(seconds=20)
    for _ in range(3):
        enqueue(engine, ok)
    enqueue(engine, ok, run_at=late)  # due 20 s ago: picked up at least 20 s late
    enqueue(engine, flaky)
    enqueue(engine, doomed)
    enqueue(engine, cancelled)
    enqueue(engine, unserved, run_at=late - timedelta(seconds=40))  # due 60 s ago, unserved
    enqueue(engine, unserved, delay=3600)  # scheduled

    served = ["default", "blocking"]
    with running_worker(app, db_url, queues=served, concurrency=4) as w:
        port = port_of(w)
        wait_until(lambda: all(r.status in ("succeeded", "dead", "cancelled")
                               for r in job_rows(engine) if r.queue == "default")
                   and w.completer.queued == 0 and w.executor.in_flight == 0,
                   message="the default queue drained")
        # A row is committed before the completer counts its outcome: wait for the counts.
        assert w.completer.flush(10)
        wait_until(lambda: value(scrape(port), "flowq_jobs_total", task="flaky", queue="default",
                                 outcome="succeeded") == 1, message="flaky succeeded")
        enqueue(engine, hold)
        wait_until(lambda: w.executor.in_flight == 1, message="hold running")
        s = scrape(port)
        release.set()

        def jobs(task: str, outcome: str) -> float | None:
            return value(s, "flowq_jobs_total", task=task, queue="default", outcome=outcome)

        assert jobs("ok", "succeeded") == 4
        assert jobs("flaky", "retried") == 1 and jobs("flaky", "succeeded") == 1
        assert jobs("doomed", "dead") == 1
        assert jobs("cancelled", "cancelled") == 1
        assert jobs("ok", "dead") is None and jobs("ok", "lost") is None

        # Handler durations: one observation per attempt, in seconds.
        assert value(s, "flowq_job_duration_seconds_count", task="ok", queue="default") == 4
        ok_sum = value(s, "flowq_job_duration_seconds_sum", task="ok", queue="default")
        assert ok_sum is not None and 0.2 <= ok_sum < 10
        assert value(s, "flowq_job_duration_seconds_count", task="flaky", queue="default") == 2
        assert value(s, "flowq_job_duration_seconds_bucket", task="ok", queue="default",
                     le="0.025") == 0  # each slept 50 ms
        assert value(s, "flowq_job_duration_seconds_bucket", task="ok", queue="default",
                     le="+Inf") == 4

        # Pickup delay: one observation per claim; the late job waited 20 s at least.
        assert value(s, "flowq_job_pickup_delay_seconds_count", task="ok", queue="default") == 4
        pickup = value(s, "flowq_job_pickup_delay_seconds_sum", task="ok", queue="default")
        assert pickup is not None and 20 <= pickup < 60
        assert value(s, "flowq_job_pickup_delay_seconds_bucket", task="ok", queue="default",
                     le="10.0") == 3
        assert value(s, "flowq_job_pickup_delay_seconds_count", task="flaky",
                     queue="default") == 2
        assert value(s, "flowq_job_pickup_delay_seconds_count", task="hold",
                     queue="blocking") == 1

        # In flight: the held job; the worker's concurrency.
        assert value(s, "flowq_jobs_in_flight") == 1
        assert value(s, "flowq_worker_concurrency") == 4

        # The queue gauges: this worker is the only one, so it collects them, for every
        # queue with jobs (the unserved one too) and for the queues it serves.
        assert value(s, "flowq_queue_metrics_collector") == 1
        assert value(s, "flowq_queue_jobs", queue="elsewhere", state="due") == 1
        assert value(s, "flowq_queue_jobs", queue="elsewhere", state="scheduled") == 1
        assert value(s, "flowq_queue_jobs", queue="blocking", state="running") == 1
        assert value(s, "flowq_queue_jobs", queue="default", state="due") == 0
        oldest = value(s, "flowq_queue_oldest_due_seconds", queue="elsewhere")
        assert oldest is not None and 60 <= oldest < 120
        assert value(s, "flowq_queue_oldest_due_seconds", queue="default") == 0

        wait_until(lambda: value(scrape(port), "flowq_jobs_in_flight") == 0,
                   message="nothing in flight")
        # The slot frees before the outcome is written and counted.
        wait_until(lambda: value(scrape(port), "flowq_jobs_total", task="hold",
                                 queue="blocking", outcome="succeeded") == 1,
                   message="hold counted")
    # Stopped: the port is closed.
    with pytest.raises(OSError):
        scrape(port)


def test_a_durable_sleep_counts_as_suspended_not_retried(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    @app.task()
    def napping(ctx: Context) -> None:
        ctx.sleep(0.01)

    enqueue(engine, napping)
    with running_worker(app, db_url) as w:
        port = port_of(w)
        wait_until(lambda: value(scrape(port), "flowq_jobs_total", task="napping",
                                 queue="default", outcome="succeeded") == 1,
                   message="the sleeper woke and succeeded")
        s = scrape(port)
    assert value(s, "flowq_jobs_total", task="napping", queue="default",
                 outcome="suspended") == 1
    assert value(s, "flowq_jobs_total", task="napping", queue="default",
                 outcome="retried") is None


def test_one_worker_at_a_time_collects_the_queue_gauges(app: flowq.FlowQ, engine: sa.Engine,
                                                        db_url: str) -> None:
    @app.task(queue="elsewhere")
    def unserved(ctx: Context) -> None:
        pass

    @app.task()
    def ok(ctx: Context) -> None:
        pass

    enqueue(engine, unserved)
    with running_worker(app, db_url, queues=["default"]) as a, \
            running_worker(app, db_url, queues=["default"]) as b:
        first, second = scrape(port_of(a)), scrape(port_of(b))
        assert value(first, "flowq_queue_metrics_collector") == 1
        assert value(second, "flowq_queue_metrics_collector") == 0
        assert value(first, "flowq_queue_jobs", queue="elsewhere", state="due") == 1
        assert "flowq_queue_jobs" not in names(second)
        assert "flowq_queue_oldest_due_seconds" not in names(second)
        # Still the same collector on the next scrapes, whichever is scraped first.
        second, first = scrape(port_of(b)), scrape(port_of(a))
        assert value(first, "flowq_queue_metrics_collector") == 1
        assert value(second, "flowq_queue_metrics_collector") == 0
        # Both count their own outcomes and in-flight jobs.
        assert "flowq_jobs_in_flight" in names(second)
        # `a` stops: its lock goes with its connection, and `b` takes over.
        a.stop()
        wait_until(lambda: value(scrape(port_of(b)), "flowq_queue_metrics_collector") == 1,
                   message="b collects")
        assert value(scrape(port_of(b)), "flowq_queue_jobs", queue="elsewhere",
                     state="due") == 1


def test_an_outcome_the_worker_could_not_record_counts_as_lost(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    @app.task()
    def stolen(ctx: Context) -> None:
        # Another claim took the row meanwhile (as after a reap): the success is not ours.
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE flowq.jobs SET lease = lease + 1000 WHERE id = :id"),
                         {"id": ctx.job_id})

    enqueue(engine, stolen)
    with running_worker(app, db_url) as w:
        port = port_of(w)
        s = wait_until(lambda: (x := scrape(port)) and value(
            x, "flowq_jobs_total", task="stolen", queue="default", outcome="lost") and x,
            message="lost counted")
        assert value(s, "flowq_jobs_total", task="stolen", queue="default",
                     outcome="succeeded") is None
        # A lost outcome's attempt is not timed: its duration says nothing of the handler.
        assert value(s, "flowq_job_duration_seconds_count", task="stolen",
                     queue="default") is None


def test_a_metrics_port_in_use_stops_the_worker_before_it_starts(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    @app.task()
    def ok(ctx: Context) -> None:
        pass

    enqueue(engine, ok)
    # Threads of workers that earlier tests stopped may still be winding down: only new
    # ones count.
    before = set(threading.enumerate())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = int(busy.getsockname()[1])
        w = Worker(app, db_url, WorkerConfig(metrics_port=port, poll_interval=0.1))
        with pytest.raises(flowq.ConfigurationError) as info:
            w.run(install_signals=False)
        assert str(info.value) == (f"cannot serve metrics on 127.0.0.1:{port}: the port is in "
                                   "use; pick another --metrics-port")
        # Nothing started: no worker registered, no job claimed, no thread left behind.
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM flowq.workers")).scalar() == 0
        assert [r.status for r in job_rows(engine)] == ["pending"]
        assert not [t for t in set(threading.enumerate()) - before
                    if t.name.startswith("flowq-")]


def test_the_cli_refuses_a_metrics_port_in_use_in_one_sentence(db_url: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = int(busy.getsockname()[1])
        for extra in ([], ["--processes", "2"]):
            proc = subprocess.run(
                [sys.executable, "-m", "flowq", "worker", "ledger_app:app", "--database-url",
                 db_url, "--metrics-port", str(port), *extra],
                capture_output=True, text=True, timeout=60,
                env={**_env(), "PYTHONPATH": _apps_path()})
            assert proc.returncode == 2, proc.stderr
            assert f"cannot serve metrics on 127.0.0.1:{port}: the port is in use" in proc.stderr
            assert "Traceback" not in proc.stderr


def test_processes_need_ports_that_exist(db_url: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flowq", "worker", "ledger_app:app", "--database-url", db_url,
         "--metrics-port", "65535", "--processes", "2"],
        capture_output=True, text=True, timeout=60, env={**_env(), "PYTHONPATH": _apps_path()})
    assert proc.returncode == 2, proc.stderr
    assert ("cannot serve metrics on 127.0.0.1:65535-65536: the ports end past 65535; pick a "
            "lower --metrics-port") in proc.stderr


def test_processes_serve_one_port_each(db_url: str, spawn_worker: Any) -> None:
    port = free_port(span=2)
    wp = spawn_worker("ledger_app:app", db_url, "--processes", "2", "--metrics-port", str(port),
                      "--poll-interval", "0.2")
    try:
        for p in (port, port + 1):
            samples = wait_until(lambda p=p: _try_scrape(p), timeout=60,
                                 message=f"metrics on port {p}")
            assert value(samples, "flowq_worker_concurrency") == 10
        collectors = [value(scrape(p), "flowq_queue_metrics_collector") for p in (port, port + 1)]
        assert sorted(collectors) == [0, 1]
    finally:
        import signal
        wp.signal(signal.SIGTERM)
        assert wp.wait(60) == 0


def test_without_the_extra_metrics_ask_for_it(app: flowq.FlowQ, db_url: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    @app.task()
    def ok(ctx: Context) -> None:
        pass

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    with pytest.raises(flowq.ConfigurationError) as info:
        Worker(app, db_url, WorkerConfig(metrics_port=9999))
    assert str(info.value) == ("metrics need the prometheus_client package, which is not "
                               "installed: pip install 'flowq[metrics]'")
    # Without a metrics port nothing asks for prometheus_client.
    Worker(app, db_url, WorkerConfig()).engines["maintain"].dispose()


def test_flowq_and_its_worker_import_no_prometheus_client() -> None:
    code = ("import sys, flowq, flowq.worker, flowq.cli.worker; "
            "assert 'prometheus_client' not in sys.modules; "
            "assert 'flowq.worker.metrics' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_cli_without_the_extra_says_what_to_install(db_url: str, tmp_path: Any) -> None:
    # A stand-in package that fails to import, ahead of the real one on the path.
    fake = tmp_path / "prometheus_client"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('not installed')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "flowq", "worker", "ledger_app:app", "--database-url", db_url,
         "--metrics-port", str(free_port())],
        capture_output=True, text=True, timeout=60,
        env={**_env(), "PYTHONPATH": f"{tmp_path}:{_apps_path()}"})
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'flowq[metrics]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def _try_scrape(port: int) -> Any:
    try:
        return scrape(port)
    except OSError:
        return None


def _env() -> dict[str, str]:
    import os
    return {k: v for k, v in os.environ.items()
            if k not in ("FLOWQ_DATABASE_URL", "DATABASE_URL")}


def _apps_path() -> str:
    from pathlib import Path
    return str(Path(__file__).parents[1] / "apps")
