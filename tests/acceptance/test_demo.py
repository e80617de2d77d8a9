"""`flowq demo` and `flowq bench` touch only what they create, and never read the environment.

Without `--database-url` both use an embedded server whatever FLOWQ_DATABASE_URL and
DATABASE_URL say; with it, the demo works in a schema of its own (`flowq_demo_<hex>`) and
drops only that, and the bench drops only the databases it created. Each test builds a
database the way a user has it (flowq's schema with a pending job, a view on flowq.jobs, a
table of their own named like the demo's) and checks it is exactly as it was afterwards.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import flowq
from flowq.cli import main
from flowq_bench.harness import Server, reset

PASSWORD = "S3cr3tPassw0rd"
ENV_VARS = ("FLOWQ_DATABASE_URL", "DATABASE_URL")

Snapshot = dict[str, Any]


@pytest.fixture
def user_db(db_url: str) -> Iterator[str]:
    """A migrated database holding a user's data: a pending job, a view, `demo_orders`."""
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    with engine.begin() as c:
        flowq.enqueue(c, "user_task", queue="default", order_id=7)
        c.execute(sa.text("CREATE VIEW public.job_view AS SELECT * FROM flowq.steps"))
        c.execute(sa.text("CREATE TABLE public.demo_orders (id int PRIMARY KEY, item text)"))
        c.execute(sa.text("INSERT INTO public.demo_orders VALUES (1, 'the user''s order')"))
    engine.dispose()
    yield db_url


def snapshot(url: str) -> Snapshot:
    """Everything a demo or bench could have touched in the database at `url`."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as c:
            def rows(sql: str) -> list[tuple[Any, ...]]:
                return [tuple(r) for r in c.execute(sa.text(sql)).all()]

            return {
                "schemas": rows("SELECT nspname FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%'"
                                " AND nspname <> 'information_schema' ORDER BY 1"),
                "relations": rows(
                    "SELECT n.nspname, c.relname, c.relkind FROM pg_class c JOIN pg_namespace n"
                    " ON n.oid = c.relnamespace WHERE n.nspname NOT LIKE 'pg\\_%'"
                    " AND n.nspname <> 'information_schema' ORDER BY 1, 2"),
                "view": rows("SELECT pg_get_viewdef('public.job_view'::regclass)"),
                "jobs": rows("SELECT * FROM flowq.steps ORDER BY id"),
                "via view": rows("SELECT * FROM public.job_view ORDER BY id"),
                "run ids": rows("SELECT last_value, is_called FROM flowq.run_id_seq"),
                "version": rows("SELECT * FROM flowq.alembic_version"),
                "orders": rows("SELECT * FROM public.demo_orders ORDER BY id"),
            }
    finally:
        engine.dispose()


def flowq_cli(*args: str, env: dict[str, str], timeout: float = 180
              ) -> subprocess.CompletedProcess[str]:
    child_env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    child_env.update(env)
    return subprocess.run([sys.executable, "-m", "flowq", *args], capture_output=True,
                          text=True, timeout=timeout, env=child_env)


def demo_schemas(url: str) -> list[str]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as c:
            return list(c.execute(sa.text(
                "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'flowq\\_demo\\_%'"
            )).scalars())
    finally:
        engine.dispose()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"postgresql://bob:{PASSWORD}@127.0.0.1:{port}/nowhere?connect_timeout=3"


# -- demo ------------------------------------------------------------------------------------


def test_demo_ignores_the_environment_and_uses_an_embedded_server(user_db: str) -> None:
    before = snapshot(user_db)
    proc = flowq_cli("demo", "--jobs", "10", env=dict.fromkeys(ENV_VARS, user_db))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Starting a temporary embedded PostgreSQL" in proc.stdout
    assert "4. Summary" in proc.stdout and "0 for rolled-back orders" in proc.stdout
    assert snapshot(user_db) == before
    # The numbers add up on screen: 1 job from part 1, 10 + 1 poisoned from part 2.
    assert "committed 10 jobs + 1 poisoned" in proc.stdout
    assert "12 jobs = 1 from part 1 + 10 + 1 poisoned from part 2" in proc.stdout
    assert "11 succeeded + 1 dead = 12 of the 12 committed jobs" in proc.stdout
    # The worker's error line comes after the progress bar, not over it.
    assert proc.stdout.index("jobs finished") < proc.stdout.index("job dead")


def test_demo_on_a_given_database_works_in_a_schema_of_its_own(user_db: str) -> None:
    before = snapshot(user_db)
    proc = flowq_cli("demo", "--jobs", "10", "--database-url", user_db, env={})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4. Summary" in proc.stdout and "0 for rolled-back orders" in proc.stdout
    assert "embedded" not in proc.stdout
    schema = next(w.strip('".,') for w in proc.stdout.split() if w.startswith('"flowq_demo_'))
    assert f'Dropped schema "{schema}"' in proc.stdout
    assert snapshot(user_db) == before
    assert demo_schemas(user_db) == []


def test_demo_and_bench_help_say_they_ignore_the_environment() -> None:
    for command in ("demo", "bench"):  # in-process: a help text needs no process of its own
        result = CliRunner().invoke(main, [command, "--help"])
        assert result.exit_code == 0, result.output
        text = " ".join(result.stdout.split())
        assert "embedded" in text and "FLOWQ_DATABASE_URL" in text and "ignored" in text, text


# -- bench -----------------------------------------------------------------------------------


def test_bench_ignores_the_environment() -> None:
    # Were the variables read, the bench would fail on the closed port instead of starting
    # its embedded server.
    proc = flowq_cli("bench", "--quick", "--scenario", "enqueue", "--json",
                     env=dict.fromkeys(ENV_VARS, closed_port_url()))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["machine"]["embedded"] is True


def test_bench_keeps_a_template_it_did_not_create(server_url: str) -> None:
    name = f"flowq_bench_tpl_{uuid.uuid4().hex[:8]}"  # someone else's, named like the bench's
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT",
                             poolclass=sa.pool.NullPool)
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        Server(server_url, template=name).close()
        with admin.connect() as c:
            assert c.execute(sa.text("SELECT count(*) FROM pg_database WHERE datname = :n"),
                             {"n": name}).scalar() == 1
    finally:
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_bench_reset_refuses_a_database_it_did_not_create(user_db: str) -> None:
    engine = sa.create_engine(user_db, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as c:  # the bench's tables, so only the guard can stop TRUNCATE
            for table in ("bench_ledger", "bench_stamps", "bench_orders"):
                c.execute(sa.text(f"CREATE TABLE {table} (id int)"))
        before = snapshot(user_db)
        with pytest.raises(RuntimeError, match="did not create"):
            reset(engine)
        assert snapshot(user_db) == before
    finally:
        engine.dispose()
