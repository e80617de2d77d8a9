"""Test fixtures: a real PostgreSQL for the whole session, a fresh migrated database per test.

The server is the shipped pytest plugin's (flowq.testing.pytest_plugin, loaded by its
entry point): `flowq_postgres`, the embedded server started once with durability off, or the
one at FLOWQ_TEST_DATABASE_URL (CI runs the suite again against PostgreSQL 15 that way), at
`flowq_server_url`. Each test gets its own database cloned from a migrated template (`db_url`,
`engine`), so tests never see each other's rows, never pay for migrations, and may commit
across processes (the plugin's `flowq_session` rolls back, which a worker process cannot see).

The other shared fixtures: `app` (a fresh FlowQ), `Session` (a sessionmaker of flowq.Session
on `engine`), `ledger` (`engine` with every test app's ledger tables created), `spawn_worker`
(real `flowq worker` processes). Plain helpers are in tests/support.py.
"""

from __future__ import annotations

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
from sqlalchemy.orm import sessionmaker

import flowq

# hypothesis is imported here, before any test starts a thread: its pytest plugin otherwise
# imports it at the terminal summary, through pytest's assertion rewriter, and CPython 3.11's
# ast.parse can fail with "AST constructor recursion depth mismatch" while other threads run
# (seen after the executor tests, whose abandoned handler threads outlive them).

REPO = Path(__file__).resolve().parent.parent
# tests/support.py imports as `support`, the test apps (tests/apps/*.py) as top-level modules,
# from every tier's directory; `spawn_worker` puts the apps on worker processes' PYTHONPATH.
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent / "apps")]
from support import APPS_DIR, WorkerProcess, end_workers  # noqa: E402

TEMPLATE = "flowq_test_template"
EMPTY_TEMPLATE = "flowq_test_empty"
# Files whose every test runs real processes (`flowq worker`, PgBouncer, a browser, an example
# or a docs build) or injects faults: marked `slow`, so `make test-quick` (-m "not slow")
# leaves them out. Single slow tests elsewhere carry @pytest.mark.slow themselves.
SLOW_FILES = frozenset({
    "test_deploy.py", "test_worker_acceptance.py", "test_worker_hostile.py", "test_pipeline_faults.py",
    "test_workflow_faults.py", "test_pipelines.py", "test_pgbouncer.py",
    "test_examples.py", "test_examples_workflows.py", "test_docs.py", "test_docs_build.py",
    "test_dashboard_browser.py", "test_bench.py", "test_demo.py", "test_failover.py",
    "test_rolling_release.py", "test_durable.py", "test_child_runs.py",
})


# The tiers: tests/unit (pure Python, no server), tests/integration (real PostgreSQL),
# tests/acceptance (real processes). A unit test that reaches the server, through any fixture,
# belongs in integration: collection stops and says so.
SERVER_FIXTURES = frozenset({"flowq_postgres", "flowq_server_url"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        needs = SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if item.path.parent.name == "unit" and needs:
            raise pytest.UsageError(f"{item.nodeid} is in tests/unit but uses the database "
                                    f"server ({', '.join(sorted(needs))}): move it to "
                                    "tests/integration")


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
def server_url(flowq_server_url: str) -> str:
    """URL of the maintenance database of the test server (the plugin's `flowq_server_url`)."""
    return flowq_server_url


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


@pytest.fixture
def Session(engine: sa.Engine) -> sessionmaker[flowq.Session]:
    """`sessionmaker(engine, class_=flowq.Session)`: sessions that commit, on `engine`."""
    return sessionmaker(engine, class_=flowq.Session)


@pytest.fixture
def ledger(engine: sa.Engine) -> sa.Engine:
    """`engine`, with the tables the test apps write created: `ledger` (ledger_app, and
    hostile_app's well-behaved jobs), `attempt_log` (faulty_app, hostile_app),
    `pipeline_ledger` and `switches` (pipeline_app, pipeline_fault_app), `queue_ledger`
    (queues_app), `schedule_ledger` (schedule_app), `workflow_ledger` and
    `workflow_switches` (workflow_fault_app)."""
    import faulty_app
    import ledger_app
    import pipeline_app
    import queues_app
    import schedule_app
    import workflow_fault_app

    with engine.begin() as conn:
        for ddl in (ledger_app.LEDGER_DDL, faulty_app.ATTEMPT_LOG_DDL, pipeline_app.LEDGER_DDL,
                    queues_app.LEDGER_DDL, schedule_app.LEDGER_DDL,
                    workflow_fault_app.LEDGER_DDL):
            conn.exec_driver_sql(ddl)
    return engine


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
    end_workers(procs)
