"""A starting worker rides out a database that is briefly unreachable: it tries again with
backoff for `WorkerConfig.start_timeout` seconds (10 by default), then stops with one
sentence; a server that answered "no" (a wrong password) is not tried again. No server here:
a closed port on 127.0.0.1, and a start-up that fails a few times before it succeeds."""

from __future__ import annotations

import socket
import time
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import flowq
import flowq.worker.worker as worker_module
from flowq.cli import main
from flowq.errors import DatabaseUnavailableError
from flowq.worker import Worker, WorkerConfig
from flowq.worker.config import DEFAULT_START_TIMEOUT

PASSWORD = "S3cr3tPassw0rd"


@pytest.fixture
def closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"postgresql://bob:{PASSWORD}@127.0.0.1:{port}/db?connect_timeout=2"


@pytest.fixture
def app() -> flowq.FlowQ:
    app = flowq.FlowQ()

    @app.task()
    def hello(ctx: flowq.Context) -> None:
        pass

    return app


def test_the_default_is_documented_and_bounded() -> None:
    assert WorkerConfig().start_timeout == DEFAULT_START_TIMEOUT == 10.0


def test_an_unreachable_database_is_one_sentence_after_the_bound(app: flowq.FlowQ,
                                                                 closed_url: str) -> None:
    w = Worker(app, closed_url, WorkerConfig(start_timeout=0.5))
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailableError) as err:
        w.check_database()
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 3.0, elapsed  # tried again until the bound, not much past it
    message = str(err.value)
    assert "cannot reach the database at" in message and "within 0.5 s" in message, message
    assert "\n" not in message and PASSWORD not in message, message
    w.connections.close()


def test_a_briefly_unreachable_database_is_ridden_out(app: flowq.FlowQ, closed_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    w = Worker(app, closed_url, WorkerConfig(start_timeout=5.0))
    # Whatever flowq.db.is_transient calls transient: a pooler's killed backend, a standby
    # or a demoted primary during a failover (read-only) included.
    failures = [DatabaseUnavailableError("cannot connect"),
                psycopg.OperationalError("server closed the connection unexpectedly"),
                sa.exc.InternalError("UPDATE", {}, psycopg.errors.ReadOnlySqlTransaction(
                    "cannot execute UPDATE in a read-only transaction")),
                psycopg.errors.AdminShutdown("terminating connection due to administrator")]
    calls: list[int] = []

    def flaky(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if failures:
            raise failures.pop(0)

    monkeypatch.setattr(worker_module, "ensure_schema", flaky)
    w.check_database()  # no error: the fifth try succeeded
    assert len(calls) == 5
    w.connections.close()


def test_a_refused_statement_is_not_tried_again(app: flowq.FlowQ, closed_url: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    w = Worker(app, closed_url, WorkerConfig(start_timeout=30.0))
    refused = sa.exc.IntegrityError("INSERT", {}, psycopg.errors.UniqueViolation("duplicate"))
    monkeypatch.setattr(worker_module, "ensure_schema",
                        lambda *args, **kwargs: (_ for _ in ()).throw(refused))
    with pytest.raises(sa.exc.IntegrityError):
        w.check_database()
    w.connections.close()


def test_a_refusal_is_not_tried_again(app: flowq.FlowQ, closed_url: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    w = Worker(app, closed_url, WorkerConfig(start_timeout=30.0))
    calls: list[int] = []

    def refused(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        raise psycopg.OperationalError('connection failed: FATAL:  password authentication '
                                       'failed for user "bob"')

    monkeypatch.setattr(worker_module, "ensure_schema", refused)
    with pytest.raises(DatabaseUnavailableError, match="refused the connection"):
        w.check_database()
    assert len(calls) == 1
    w.connections.close()


def test_flowq_worker_start_timeout(closed_url: str) -> None:
    started = time.monotonic()
    result = CliRunner().invoke(
        main, ["worker", "flowq_bench.app:app", "--database-url", closed_url,
               "--start-timeout", "0.3"], env={"FLOWQ_DATABASE_URL": None, "DATABASE_URL": None})
    assert time.monotonic() - started < 5.0
    assert result.exit_code == 2, (result.output, result.exception)
    # One log line says it is waiting, then one sentence: no traceback, no line per try.
    waiting, text = result.stderr.strip().splitlines()
    assert "database unreachable at start; trying again" in waiting, waiting
    assert text.startswith("Error: cannot reach the database") and "within 0.3 s" in text, text
    assert PASSWORD not in result.output and "Traceback" not in result.output
