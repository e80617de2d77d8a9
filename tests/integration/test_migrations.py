"""flowq's schema as alembic migrations: idempotent, own version table, equal to schema.py, shipped."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

import flowq
from flowq.db.checks import ensure_schema
from flowq.db.migrations import (
    HEAD_REVISION,
    VERSION_TABLE,
    Migrated,
    compared,
    current_revision,
    downgrade,
    migrate,
    sql_script,
)
from flowq.db.schema import metadata
from flowq.errors import ConfigurationError, MigrationBlockedError, SchemaMissingError
from flowq.names import DEFAULT_SCHEMA
from flowq.testing import wait_until

HEAD = HEAD_REVISION


@pytest.fixture
def empty_engine(empty_db_url: str) -> Iterator[sa.Engine]:
    eng = sa.create_engine(empty_db_url)
    yield eng
    eng.dispose()


def _scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as c:
        return c.execute(sa.text(sql), params).scalar()


def _has_jobs(engine: sa.Engine, schema: str = DEFAULT_SCHEMA) -> bool:
    return _scalar(engine, "SELECT to_regclass(:n)", n=f"{schema}.jobs") is not None


def _flowq_version(engine: sa.Engine, schema: str = DEFAULT_SCHEMA) -> list[str]:
    with engine.connect() as c:
        return list(c.execute(sa.text(f"SELECT version_num FROM {schema}.{VERSION_TABLE}"))
                    .scalars())


def _schema_exists(engine: sa.Engine, schema: str = DEFAULT_SCHEMA) -> bool:
    return _scalar(engine, "SELECT 1 FROM pg_namespace WHERE nspname = :s", s=schema) == 1


def test_migrate_is_idempotent(empty_engine: sa.Engine) -> None:
    migrate(empty_engine)
    migrate(empty_engine)
    assert _has_jobs(empty_engine)
    assert _flowq_version(empty_engine) == [HEAD]


def test_own_version_table_leaves_the_apps_alembic_version_alone(
        empty_engine: sa.Engine) -> None:
    with empty_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE public.alembic_version (version_num varchar(32) "
                          "PRIMARY KEY)"))
        c.execute(sa.text("INSERT INTO public.alembic_version VALUES ('app_rev_42')"))
    flowq.migrate(empty_engine)
    assert _flowq_version(empty_engine) == [HEAD]
    with empty_engine.connect() as c:
        assert list(c.execute(sa.text("SELECT version_num FROM public.alembic_version"))
                    .scalars()) == ["app_rev_42"]


def test_migrated_schema_equals_schema_py(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={
            "include_schemas": True,
            "include_name": compared(DEFAULT_SCHEMA),
            "target_metadata": metadata,
            "compare_type": True,
            "compare_server_default": True,
        })
        diff = compare_metadata(ctx, metadata)
        run_id_default = conn.execute(sa.text(
            "SELECT column_default FROM information_schema.columns WHERE table_schema = "
            "'flowq' AND table_name = 'jobs' AND column_name = 'run_id'")).scalar()
    # alembic cannot compare a Sequence.next_value() default with its rendering in the
    # database; check that one by hand.
    assert run_id_default == "nextval('flowq.run_id_seq'::regclass)"
    diff = [d for d in diff if not (isinstance(d, list) and d[0][0] == "modify_default"
                                    and d[0][3] == "run_id")]
    assert diff == []


def test_migrate_through_a_connection_commits_only_what_it_began(
        empty_engine: sa.Engine) -> None:
    with empty_engine.connect() as conn:
        migrate(conn)  # no transaction was open: migrating commits its own
    assert _has_jobs(empty_engine)
    downgrade(empty_engine)
    with empty_engine.connect() as conn:
        conn.execute(sa.text("CREATE TABLE app_table (id int)"))
        migrate(conn)  # joins the caller's transaction ...
        conn.rollback()  # ... so the caller decides
    assert not _has_jobs(empty_engine)
    assert _scalar(empty_engine, "SELECT to_regclass('app_table')") is None


def test_downgrade_to_base_and_upgrade_again(engine: sa.Engine) -> None:
    downgrade(engine)
    assert not _has_jobs(engine)
    assert _scalar(engine, "SELECT to_regclass('flowq.run_id_seq')") is None
    assert not _schema_exists(engine)  # the version table and the schema went too
    migrate(engine)
    assert _has_jobs(engine)
    assert _flowq_version(engine) == [HEAD]
    with engine.begin() as conn:
        assert flowq.enqueue(conn, "after_reupgrade", queue="default").created


def test_indexes_exist(engine: sa.Engine) -> None:
    with engine.connect() as c:
        defs = dict(c.execute(sa.text(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'flowq' "
            "AND tablename = 'jobs'")).all())
    pending = defs["jobs_pending_idx"]
    assert "(queue, priority, run_at, id)" in pending
    assert "WHERE (status = 'pending'::text)" in pending
    key = defs["jobs_idempotency_key_idx"]
    assert key.startswith("CREATE UNIQUE INDEX")
    assert "WHERE (idempotency_key IS NOT NULL)" in key


def test_sql_script_prints_the_ddl() -> None:
    ddl = sql_script()
    # Applied by hand, the script's lock waits are bounded like `migrate`'s.
    assert ddl.index("SET LOCAL lock_timeout = '500ms';") < ddl.index("CREATE SCHEMA")
    assert "CREATE SCHEMA IF NOT EXISTS \"flowq\"" in ddl
    assert "CREATE TABLE flowq.jobs" in ddl
    assert "CREATE INDEX jobs_pending_idx ON flowq.jobs" in ddl
    assert "WHERE status = 'pending'" in ddl
    assert "CREATE UNIQUE INDEX jobs_idempotency_key_idx" in ddl
    assert f"CREATE TABLE flowq.{VERSION_TABLE}" in ddl
    alt = sql_script(schema="flowq_alt")
    assert "CREATE TABLE flowq_alt.jobs" in alt
    assert "flowq.jobs" not in alt


def test_non_default_schema(empty_engine: sa.Engine) -> None:
    migrate(empty_engine, schema="flowq_alt")
    migrate(empty_engine, schema="flowq_alt")
    assert _has_jobs(empty_engine, "flowq_alt")
    assert not _has_jobs(empty_engine)
    assert _flowq_version(empty_engine, "flowq_alt") == [HEAD]

    with empty_engine.begin() as conn:
        by_name = flowq.enqueue(conn, "alt_task", queue="default", schema="flowq_alt", n=1)
    alt_app = flowq.FlowQ(schema="flowq_alt")

    @alt_app.task()
    def alt_defined(ctx: object, n: int) -> None: ...

    with empty_engine.begin() as conn:
        by_task = flowq.enqueue(conn, alt_defined, n=2)  # the app's schema
        ids = flowq.enqueue_many(conn, "alt_bulk", [{}, {}], queue="default", schema="flowq_alt")
    with empty_engine.connect() as c:
        rows = c.execute(sa.text("SELECT run_id, task FROM flowq_alt.jobs ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [(by_name.id, "alt_task"), (by_task.id, "alt_defined"),
                                        (ids[0], "alt_bulk"), (ids[1], "alt_bulk")]
    # Without schema=, enqueue looks for the default schema, which is not there.
    with empty_engine.connect() as conn, pytest.raises(flowq.SchemaMissingError, match="'flowq'"):
        flowq.enqueue(conn, "alt_task", queue="default")
    # The two schemas can live side by side, each with its own history.
    migrate(empty_engine)
    assert _flowq_version(empty_engine) == [HEAD]
    downgrade(empty_engine, schema="flowq_alt")
    assert not _has_jobs(empty_engine, "flowq_alt")
    assert _has_jobs(empty_engine)


def test_invalid_schema_name_is_refused(engine: sa.Engine) -> None:
    with pytest.raises(flowq.ConfigurationError):
        migrate(engine, schema="Robert'); DROP TABLE students;--")


@pytest.mark.slow
def test_wheel_ships_the_migrations(tmp_path: Path, empty_db_url: str,
                                    flowq_wheel: Path) -> None:
    """Install the wheel (built once per session, conftest's `flowq_wheel`) into a fresh
    venv, migrate from outside the repository.

    The venv gets flowq from the wheel only; its dependencies are borrowed from the current
    environment through a path entry (no network, seconds instead of minutes). A path entry
    does not run that environment's .pth files, so the repository's editable flowq stays out.
    """
    wheel = flowq_wheel
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--disable-pip-version-check", str(wheel)], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "_borrowed_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    check = (
        "import flowq, flowq.db.migrations as m, sqlalchemy as sa, sys; "
        f"assert flowq.__file__.startswith({str(venv)!r}), flowq.__file__; "
        f"assert str(m.migrations_dir()).startswith({str(venv)!r}), m.migrations_dir(); "
        "assert m.migrations_dir().name == '_migrations'; "
        "assert (m.migrations_dir() / 'versions' / '0001_jobs.py').is_file(); "
        # the dashboard's templates are package data too
        "import importlib.resources as r; "
        "assert (r.files('flowq.dashboard') / 'templates' / 'run.html').is_file(); "
        "flowq.migrate(sa.create_engine(sys.argv[1]))"
    )
    subprocess.run([str(python), "-c", check, empty_db_url], check=True, cwd=elsewhere, env=env)
    engine = sa.create_engine(empty_db_url)
    try:
        assert _flowq_version(engine) == [HEAD]
        console = shutil.which("flowq", path=str(bindir))
        if console is not None:  # the CLI form, once the console script exists
            downgrade(engine)
            out = subprocess.run([console, "migrate", "--database-url", empty_db_url],
                                 check=True, cwd=elsewhere, env=env, capture_output=True,
                                 text=True)
            assert _flowq_version(engine) == [HEAD], out
            ddl = subprocess.run([console, "migrate", "--sql"], check=True, cwd=elsewhere,
                                 env=env, capture_output=True, text=True).stdout
            assert "CREATE TABLE flowq.jobs" in ddl
    finally:
        engine.dispose()


def test_migrate_says_what_it_did(empty_engine: sa.Engine) -> None:
    assert migrate(empty_engine) == Migrated(None, HEAD, created_schema=True)
    assert migrate(empty_engine) == Migrated(HEAD, HEAD, created_schema=False)
    downgrade(empty_engine, revision="0001")
    done = migrate(empty_engine)
    assert (done.before, done.after, done.changed) == ("0001", HEAD, True)
    with empty_engine.connect() as conn:
        assert current_revision(conn) == HEAD
        assert current_revision(conn, "flowq_nowhere") is None


def test_downgrade_to_base_removes_the_schema_migrate_created(empty_engine: sa.Engine) -> None:
    migrate(empty_engine)
    downgrade(empty_engine)
    assert not _schema_exists(empty_engine)
    migrate(empty_engine)  # and from nothing again
    assert _flowq_version(empty_engine) == [HEAD]


def test_downgrade_partway_keeps_the_version_table(empty_engine: sa.Engine) -> None:
    migrate(empty_engine)
    downgrade(empty_engine, revision="0001")
    assert _flowq_version(empty_engine) == ["0001"]
    assert _has_jobs(empty_engine)


@pytest.mark.parametrize("other_object", [
    "CREATE TABLE flowq.mine (id int)",
    "CREATE TYPE flowq.mood AS ENUM ('ok')",
    "CREATE FUNCTION flowq.one() RETURNS int LANGUAGE sql AS 'SELECT 1'",
])
def test_downgrade_keeps_a_schema_holding_objects_flowq_did_not_create(
        empty_engine: sa.Engine, other_object: str) -> None:
    migrate(empty_engine)
    with empty_engine.begin() as c:
        c.execute(sa.text(other_object))
    downgrade(empty_engine)
    assert _schema_exists(empty_engine)
    assert not _has_jobs(empty_engine)
    assert _scalar(empty_engine, f"SELECT to_regclass('flowq.{VERSION_TABLE}')") is None
    with empty_engine.connect() as c:  # the other object is untouched
        assert c.execute(sa.text(
            "SELECT count(*) FROM pg_depend WHERE refobjid = 'flowq'::regnamespace")
        ).scalar()


def test_downgrade_keeps_a_schema_flowq_did_not_create(empty_engine: sa.Engine) -> None:
    with empty_engine.begin() as c:
        c.execute(sa.text("CREATE SCHEMA flowq"))
    assert migrate(empty_engine).created_schema is False
    downgrade(empty_engine)
    assert _schema_exists(empty_engine)
    assert _scalar(empty_engine, f"SELECT to_regclass('flowq.{VERSION_TABLE}')") is None


def test_the_revision_a_worker_needs_is_the_migrations_head() -> None:
    from alembic.script import ScriptDirectory

    from flowq.db.migrations import HEAD_REVISION, alembic_config

    assert ScriptDirectory.from_config(alembic_config()).get_current_head() == HEAD_REVISION


# -- migrating under running workers: bounded lock waits, retries, one sentence -------------

# The shape of a claim (flowq's claim statement names jobs.trace_context, which 0006 lacks):
# what matters here is its lock, ROW EXCLUSIVE on flowq.jobs, which conflicts with the ACCESS
# EXCLUSIVE that 0007's ALTER TABLE queues for.
CLAIM = """UPDATE flowq.jobs SET status = 'running', attempts = attempts + 1, locked_at = now(),
                               heartbeat_at = now(), locked_by = 'probe'
           WHERE id IN (SELECT id FROM flowq.jobs WHERE status = 'pending' AND run_at <= now()
                        AND queue = 'default' ORDER BY priority, run_at, id LIMIT 1
                        FOR UPDATE SKIP LOCKED)
           RETURNING id"""
HOLDS = {
    "a read (ACCESS SHARE)": "SELECT count(*) FROM flowq.jobs",
    "a row lock": "SELECT id FROM flowq.jobs ORDER BY id LIMIT 1 FOR UPDATE",
}


def _named_engine(url: str, name: str) -> sa.Engine:
    return sa.create_engine(url, poolclass=sa.pool.NullPool,
                            connect_args={"application_name": name})


def _waiting_on_a_lock(engine: sa.Engine, name: str) -> bool:
    return bool(_scalar(engine, "SELECT count(*) FROM pg_stat_activity WHERE application_name"
                                " = :n AND wait_event_type = 'Lock'", n=name))


@pytest.fixture
def at_0006(engine: sa.Engine) -> sa.Engine:
    """`engine`'s database with three pending jobs, downgraded to 0006: upgrading it again runs
    0007's ALTER TABLE flowq.jobs, which needs that table's ACCESS EXCLUSIVE lock."""
    with engine.begin() as conn:
        for n in range(3):
            flowq.enqueue(conn, "held", queue="default", n=n)
    downgrade(engine, revision="0006")
    return engine


@pytest.fixture
def holder(db_url: str, at_0006: sa.Engine, request: pytest.FixtureRequest
           ) -> Iterator[tuple[sa.Connection, int]]:
    """An open transaction holding a lock on flowq.jobs (a read by default), and its pid."""
    eng = _named_engine(db_url, "flowq-test-holder")
    conn = eng.connect()
    conn.execute(sa.text(HOLDS[getattr(request, "param", "a read (ACCESS SHARE)")]))
    pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    yield conn, pid
    conn.close()
    eng.dispose()


@pytest.mark.parametrize("holder", list(HOLDS), indirect=True)
def test_migrate_under_a_held_lock_never_stalls_claims_and_lands_once_it_is_released(
        db_url: str, at_0006: sa.Engine, holder: tuple[sa.Connection, int]) -> None:
    held, holder_pid = holder
    migrator = _named_engine(db_url, "flowq-test-migrate")
    claimer = _named_engine(db_url, "flowq-test-claim")
    lines: list[str] = []
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(migrate(migrator, attempts=200, on_retry=lines.append))
        except BaseException as exc:  # reported by the assertion below
            outcome.append(exc)

    seen_waiting: set[bool] = set()
    stop = threading.Event()

    def observe() -> None:  # did a claim really queue behind the DDL?
        while not stop.is_set():
            if _waiting_on_a_lock(at_0006, "flowq-test-claim"):
                seen_waiting.add(True)
            stop.wait(0.005)

    thread = threading.Thread(target=run)
    observer = threading.Thread(target=observe)
    thread.start()
    observer.start()
    try:
        claimed: list[int] = []
        for _ in range(3):
            # Sent while the ALTER waits for its lock: the claim queues behind it, and would
            # wait for as long as the holder holds on without a lock_timeout.
            wait_until(lambda: _waiting_on_a_lock(at_0006, "flowq-test-migrate"), timeout=30,
                       interval=0.005, message="the migration waiting for its lock")
            with claimer.connect() as conn:
                conn.execute(sa.text("SET statement_timeout = '2s'"))
                claimed += conn.execute(sa.text(CLAIM)).scalars().all()
                conn.rollback()
        assert len(claimed) == 3 and outcome == []
    finally:
        stop.set()
        observer.join()
        held.rollback()  # the holder lets go
        thread.join(timeout=60)
        migrator.dispose()
        claimer.dispose()
    assert outcome == [Migrated("0006", HEAD, created_schema=False)]
    assert seen_waiting == {True}
    assert lines, "the migration never had to try again"
    # (the last line may come after the holder let go, naming nobody)
    assert f"pid {holder_pid} (application_name 'flowq-test-holder'" in lines[0], lines[0]
    assert "on flowq.jobs)" in lines[0] and len(lines) < 20, lines


def test_migrate_gives_up_with_one_sentence_naming_the_blocker(
        at_0006: sa.Engine, holder: tuple[sa.Connection, int]) -> None:
    _, holder_pid = holder
    lines: list[str] = []
    with pytest.raises(MigrationBlockedError) as info:
        migrate(at_0006, lock_timeout=0.2, attempts=2, on_retry=lines.append)
    message = str(info.value)
    assert message.startswith("the flowq migration gave up after 2 tries: each time a "
                              "statement waited more than 0.2 s for a lock on the 'flowq' "
                              "schema's tables, "), message
    assert (f"held by pid {holder_pid} (application_name 'flowq-test-holder', state idle in "
            "transaction, in a transaction for ") in message
    assert "AccessShareLock on flowq.jobs); end that transaction" in message
    assert message.endswith("then run `flowq migrate` again.")
    assert "\n" not in message
    assert len(lines) == 1 and "(try 2 of 2)" in lines[0]
    with at_0006.connect() as conn:
        assert current_revision(conn) == "0006"  # rolled back whole


def test_migrate_inside_the_callers_transaction_waits_once_and_keeps_their_settings(
        at_0006: sa.Engine, holder: tuple[sa.Connection, int], db_url: str) -> None:
    with at_0006.connect() as conn:
        conn.execute(sa.text("SET LOCAL lock_timeout = '7s'"))
        with pytest.raises(MigrationBlockedError, match="after one try"):
            migrate(conn, lock_timeout=0.2, on_retry=pytest.fail)
        conn.rollback()
    holder[0].rollback()
    with at_0006.connect() as conn:
        conn.execute(sa.text("SET LOCAL lock_timeout = '7s'"))
        assert migrate(conn).after == HEAD
        assert conn.execute(sa.text("SHOW lock_timeout")).scalar() == "7s"
        conn.commit()


def test_flowq_migrate_prints_one_line_per_retry_then_one_sentence(
        at_0006: sa.Engine, holder: tuple[sa.Connection, int], db_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from functools import partial

    from click.testing import CliRunner

    import flowq.db.migrations as migrations
    from flowq.cli import main

    # The command's budget, made small (the default is about a minute of tries).
    monkeypatch.setattr(migrations, "migrate", partial(migrate, attempts=3, lock_timeout=0.2))
    result = CliRunner().invoke(main, ["migrate", "--database-url", db_url],
                                env={"FLOWQ_DATABASE_URL": None, "DATABASE_URL": None})
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3 and result.stdout == "", result.output
    assert [("(try 2 of 3)" in lines[0]), ("(try 3 of 3)" in lines[1])] == [True, True]
    assert "gave up after 3 tries" in lines[2] and f"pid {holder[1]}" in lines[2]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("budget", [{"lock_timeout": 0}, {"lock_timeout": float("nan")},
                                    {"lock_timeout": float("inf")}, {"lock_timeout": 61},
                                    {"attempts": 0}, {"attempts": 10**6}, {"attempts": 2.5},
                                    {"attempts": True}, {"lock_timeout": True}])
def test_an_unbounded_retry_budget_is_refused(engine: sa.Engine, budget: dict[str, Any]
                                              ) -> None:
    with pytest.raises(ConfigurationError):
        migrate(engine, **budget)


# -- a worker's revision check: older refused, newer (unknown) accepted with a warning ------


def _set_revision(engine: sa.Engine, revision: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE flowq.{VERSION_TABLE} SET version_num = :r"),
                     {"r": revision})


def test_a_schema_behind_this_flowq_is_refused_with_the_migrate_advice(
        engine: sa.Engine) -> None:
    downgrade(engine, revision="0006")
    with pytest.raises(SchemaMissingError, match=r"is at revision 0006, and this flowq needs "
                       + HEAD_REVISION + r": run `flowq migrate` first"):
        ensure_schema(engine, current=True)
    ensure_schema(engine)  # a command that only reads does not ask for the head


@pytest.mark.parametrize("newer", ["9998", "9999_future", "head"])
def test_a_schema_newer_than_this_flowq_is_accepted_with_one_warning(
        engine: sa.Engine, newer: str, caplog: pytest.LogCaptureFixture) -> None:
    _set_revision(engine, newer)
    with caplog.at_level(logging.WARNING, logger="flowq"):
        ensure_schema(engine, current=True)
    [record] = [r for r in caplog.records if r.name.startswith("flowq")]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"the flowq schema 'flowq' is at revision {newer!r}, newer than this flowq's "
        f"{HEAD_REVISION}: fine while a release rolls out, since migrations only expand; "
        "upgrade this worker")


def test_a_schema_at_this_flowqs_head_passes_quietly(engine: sa.Engine,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="flowq"):
        ensure_schema(engine, current=True)
    assert [r for r in caplog.records if r.name.startswith("flowq")] == []
