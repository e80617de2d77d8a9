"""A worker on a multi-host URL (issue 20, item 6): its own psycopg connections (claim,
completion, heartbeat, LISTEN) get a libpq host list, so with `target_session_attrs` it skips a
host that is down and drains on the next one, in SQLAlchemy's URL form and in libpq's."""

from __future__ import annotations

import socket
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import make_url

import flowq
from flowq.cli import main
from flowq.testing import job_rows
from flowq.worker import Worker, WorkerConfig


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server(db_url: str) -> tuple[str, int]:
    u = make_url(db_url)
    host = u.host or u.query.get("host")
    assert isinstance(host, str), db_url
    return host, u.port or 5432


def sqlalchemy_form(db_url: str, closed_port: int) -> str:
    """`?host=127.0.0.1:CLOSED&host=SERVER:PORT&target_session_attrs=read-write`."""
    u = make_url(db_url)
    host, port = _server(db_url)
    shown = f"[{host}]" if ":" in host else host
    return (f"postgresql+psycopg://{_userinfo(db_url)}@/{u.database}?host=127.0.0.1:"
            f"{closed_port}&host={shown}:{port}&target_session_attrs=read-write")


def _userinfo(db_url: str) -> str:
    u = make_url(db_url)
    return (u.username or "") + (f":{u.password}" if u.password else "")


def libpq_form(db_url: str, closed_port: int) -> str:
    """`postgresql://user:pw@127.0.0.1:CLOSED,SERVER:PORT/db?target_session_attrs=...`."""
    u = make_url(db_url)
    host, port = _server(db_url)
    return (f"postgresql://{_userinfo(db_url)}@127.0.0.1:{closed_port},{host}:{port}/{u.database}"
            "?target_session_attrs=read-write")


FORMS: dict[str, Callable[[str, int], str]] = {"sqlalchemy": sqlalchemy_form,
                                               "libpq": libpq_form}


@pytest.mark.parametrize("form", list(FORMS))
def test_a_worker_drains_through_a_multi_host_url(form: str, app: flowq.FlowQ,
                                                  engine: sa.Engine, db_url: str,
                                                  closed_port: int) -> None:
    url = FORMS[form](db_url, closed_port)

    @app.task()
    def hello(ctx: flowq.Context) -> None:
        pass

    with engine.begin() as conn:
        for _ in range(3):
            flowq.enqueue(conn, hello)
    w = Worker(app, url, WorkerConfig(poll_interval=0.1, shutdown_grace=5.0))
    # Every psycopg connection of its own is given the host list, split.
    assert "host=127.0.0.1," in w.connections.claim.conninfo
    w.run(install_signals=False, until_idle=True)
    assert [r.status for r in job_rows(engine)] == ["succeeded"] * 3


def test_flowq_worker_on_a_multi_host_url_runs_without_a_traceback(
        db_url: str, engine: sa.Engine, closed_port: int, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"multihost_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        import flowq

        app = flowq.FlowQ()

        @app.task(queue="q1")
        def hello(ctx) -> None:
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    original = Worker.run

    def run_until_idle(self: Worker, **kwargs: Any) -> None:
        original(self, install_signals=False, until_idle=True)

    monkeypatch.setattr(Worker, "run", run_until_idle)
    with engine.begin() as conn:
        flowq.enqueue(conn, "hello", queue="q1")
    result = CliRunner().invoke(
        main, ["worker", f"{name}:app", "--database-url", sqlalchemy_form(db_url, closed_port),
               "--poll-interval", "0.1", "--shutdown-grace", "5"],
        env={"FLOWQ_DATABASE_URL": None, "DATABASE_URL": None})
    assert result.exit_code == 0, (result.output, result.exception)
    assert "Traceback" not in result.output
    assert [r.status for r in job_rows(engine)] == ["succeeded"]
