"""flowq behind a real PgBouncer in transaction pooling mode (issue 13, part 6).

A PgBouncer (the operating system's package; `.ci/run` installs it when it is missing and it
can) is started in front of the test database with `pool_mode = transaction`, and nothing
lenient: no `ignore_startup_parameters`, so a startup `options` is refused as in production,
and no prepared-statement support (PgBouncer 1.18 has none), so a server-side prepared
statement left on a server session breaks whichever client gets that session next.

Through it: enqueue (one transaction per job, so psycopg would prepare the INSERT after a few
executions on a pooled connection), then two `flowq worker --pgbouncer` processes drain a
ledger of plain tasks, tasks on a limited queue (the claim's explicit transaction) and
two-step pipelines, every job writing one ledger row through `ctx.session`: exactly once,
nothing left pending or running, and not one database error in the workers' logs. One worker
polls only; the other LISTENs on a direct connection (`--listen-url`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from support import APPS_DIR, free_port

import flowq
import flowq.db
from flowq.testing import wait_until

SKIP_REASON = ("pgbouncer is not installed: install the operating system's package "
               "(`apt-get install pgbouncer`; .ci/run does it when run as root with apt-get)")

APP_SOURCE = '''
"""A test app for tests/acceptance/test_pgbouncer.py: every step writes one ledger row via ctx.session."""

import os

import sqlalchemy as sa

import flowq
from flowq.durable.context import Context

app = flowq.FlowQ()
app.queue("limited", concurrency=3)

LEDGER_DDL = ("CREATE TABLE IF NOT EXISTS pgb_ledger (job_id bigint NOT NULL, run_id bigint "
              "NOT NULL, step text NOT NULL, pid int NOT NULL)")


def write_ledger_row(ctx: Context) -> None:
    ctx.session.execute(sa.text(
        "INSERT INTO pgb_ledger (job_id, run_id, step, pid) VALUES (:j, :r, :s, :p)"),
        {"j": ctx.job_id, "r": ctx.run_id, "s": ctx.step, "p": os.getpid()})


@app.task()
def record(ctx: Context, n: int) -> None:
    write_ledger_row(ctx)


@app.task(queue="limited")
def limited(ctx: Context, n: int) -> None:
    write_ledger_row(ctx)


pair = app.pipeline("pair")


@pair.step()
def first(ctx: Context, n: int) -> dict:
    write_ledger_row(ctx)
    return {"n": n, "doubled": 2 * n}


@pair.step()
def second(ctx: Context, n: int, doubled: int) -> None:
    assert doubled == 2 * n
    write_ledger_row(ctx)
'''

RECORDS, LIMITED, PAIRS = 300, 60, 70  # 300 + 60 + 2 * 70 = 500 jobs
JOBS = RECORDS + LIMITED + 2 * PAIRS
POOL_SIZE = 30  # the fixture's default_pool_size


def pgbouncer_binary() -> str | None:
    found = shutil.which("pgbouncer")
    if found is None and os.access("/usr/sbin/pgbouncer", os.X_OK):
        found = "/usr/sbin/pgbouncer"
    return found


@pytest.fixture
def pgbouncer(db_url: str) -> Iterator[str]:
    """A PgBouncer in transaction mode in front of the test server; the test database's URL
    through it."""
    exe = pgbouncer_binary()
    if exe is None:
        pytest.skip(SKIP_REASON)
    server = make_url(db_url)
    user = server.username or "postgres"
    # PgBouncer refuses to run as root: then it runs as `nobody` (like the embedded server),
    # from a directory that user can read.
    run_as = pwd.getpwnam("nobody") if os.geteuid() == 0 else None
    workdir = Path(tempfile.mkdtemp(prefix="flowq-pgbouncer-"))
    workdir.chmod(0o755)
    port = free_port()
    target = f"host={server.host or '127.0.0.1'} port={server.port or 5432} user={user}"
    if server.password:
        target += f" password={server.password}"
    (workdir / "userlist.txt").write_text(f'"{user}" ""\n')
    (workdir / "pgbouncer.ini").write_text(textwrap.dedent(f"""\
        [databases]
        * = {target}

        [pgbouncer]
        listen_addr = 127.0.0.1
        listen_port = {port}
        unix_socket_dir =
        auth_type = trust
        auth_file = {workdir / "userlist.txt"}
        pool_mode = transaction
        max_client_conn = 500
        default_pool_size = {POOL_SIZE}
        reserve_pool_size = 0
        """))
    for f in workdir.iterdir():
        f.chmod(0o644)
    log_path = workdir / "pgbouncer.log"
    ids: dict[str, Any] = {}
    if run_as is not None:
        ids = {"user": run_as.pw_uid, "group": run_as.pw_gid, "extra_groups": []}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([exe, str(workdir / "pgbouncer.ini")], stdout=log,
                                stderr=subprocess.STDOUT, cwd="/", **ids)
    url = server.set(port=port).render_as_string(hide_password=False)
    conninfo = server.set(drivername="postgresql", port=port).render_as_string(
        hide_password=False)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"pgbouncer exited ({proc.returncode}):\n"
                                 f"{log_path.read_text(errors='replace')[-3000:]}")
        try:
            with psycopg.connect(conninfo, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            return False

    try:
        wait_until(ready, timeout=30, interval=0.1, message="pgbouncer to accept connections")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        print(f"--- pgbouncer.log ---\n{log_path.read_text(errors='replace')[-3000:]}")
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def pgb_app(tmp_path: Path) -> Iterator[ModuleType]:
    """The test app, written where this process and the workers import it from."""
    (tmp_path / "pgb_app.py").write_text(APP_SOURCE)
    spec = importlib.util.spec_from_file_location("pgb_app", tmp_path / "pgb_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pgb_app"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("pgb_app", None)


def test_the_pooler_refuses_startup_options(pgbouncer: str) -> None:
    """The fixture is as strict as production: what the issue saw without --pgbouncer."""
    conninfo = make_url(pgbouncer).set(drivername="postgresql").render_as_string(
        hide_password=False)
    with pytest.raises(psycopg.OperationalError, match="unsupported startup parameter"):
        psycopg.connect(conninfo, options="-c enable_seqscan=off", connect_timeout=5)


def test_workers_drain_a_ledger_through_pgbouncer(pgbouncer: str, db_url: str,
                                                 engine: sa.Engine, pgb_app: ModuleType,
                                                 tmp_path: Path, spawn_worker: Any) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(pgb_app.LEDGER_DDL))

    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(APPS_DIR),
                                          os.environ.get("PYTHONPATH", "")])}
    common = ["--pgbouncer", "--concurrency", "6", "--heartbeat-interval", "0.5",
              "--stale-after", "5", "--reap-interval", "0.5", "--shutdown-grace", "10"]
    polling = spawn_worker("pgb_app:app", pgbouncer, *common, "--poll-interval", "0.3",
                           env=env)
    listening = spawn_worker("pgb_app:app", pgbouncer, *common, "--listen-url", db_url,
                             env=env)

    # Both workers are up before the jobs exist, so both get work to do.
    wait_until(lambda: _registered(engine) == 2, timeout=60, message="both workers to start")

    # Enqueue through the pooler: one transaction per job on a small pool, so each pooled
    # client connection runs the same INSERT many times (psycopg's default would prepare it
    # on the 5th), on whichever server session PgBouncer hands out.
    pooled = flowq.db.create_engine(pgbouncer, pgbouncer=True, pool_size=2, max_overflow=0)
    try:
        for i in range(RECORDS // 2):
            with pooled.begin() as conn:
                flowq.enqueue(conn, pgb_app.record, n=i)
        for i in range(PAIRS):
            with pooled.begin() as conn:
                flowq.enqueue(conn, pgb_app.pair, n=i)
        with pooled.begin() as conn:
            flowq.enqueue_many(conn, pgb_app.record,
                               [{"n": i} for i in range(RECORDS // 2, RECORDS)])
            flowq.enqueue_many(conn, pgb_app.limited, [{"n": i} for i in range(LIMITED)])
    finally:
        pooled.dispose()

    def settled() -> bool:
        with engine.connect() as conn:
            counts = {r[0]: r[1] for r in conn.execute(sa.text(
                "SELECT status, count(*) FROM flowq.steps GROUP BY status"))}
        for w in (polling, listening):
            assert w.proc.poll() is None, f"a worker exited:\n{w.log()[-3000:]}"
        return counts == {"succeeded": JOBS}

    wait_until(settled, timeout=180, interval=0.3, message=f"{JOBS} jobs to succeed")

    with engine.connect() as conn:
        # Exactly once: one ledger row per succeeded job, none for anything else.
        wrong = conn.execute(sa.text("""
            SELECT j.id, count(l.job_id) FROM flowq.steps j
            LEFT JOIN pgb_ledger l ON l.job_id = j.id
            GROUP BY j.id HAVING count(l.job_id) <> 1""")).all()
        assert not wrong, f"jobs without exactly one ledger row: {wrong[:20]}"
        assert conn.execute(sa.text("SELECT count(*) FROM pgb_ledger")).scalar() == JOBS
        steps = {r[0]: r[1] for r in conn.execute(sa.text(
            "SELECT step, count(*) FROM pgb_ledger GROUP BY step"))}
        assert steps == {"record": RECORDS, "limited": LIMITED, "first": PAIRS,
                         "second": PAIRS}
        runs = conn.execute(sa.text("SELECT count(DISTINCT run_id) FROM pgb_ledger")).scalar()
        assert runs == RECORDS + LIMITED + PAIRS
        # Both workers did work; only the --listen-url one LISTENs, directly on the server.
        pids = {r[0] for r in conn.execute(sa.text("SELECT DISTINCT pid FROM pgb_ledger"))}
        assert pids == {polling.pid, listening.pid}
        listeners = conn.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE "
            "'flowq listen %' AND datname = current_database()")).scalar()
        assert listeners == 1

    # A job enqueued once both are idle still runs (woken by NOTIFY or the poll).
    with engine.begin() as conn:
        flowq.enqueue(conn, pgb_app.record, n=-1)

    def extra_done() -> bool:
        with engine.connect() as conn:
            return conn.execute(sa.text(
                "SELECT count(*) FILTER (WHERE status = 'succeeded') FROM flowq.steps")
                ).scalar() == JOBS + 1

    wait_until(extra_done, timeout=30, interval=0.1, message="the job enqueued last")

    for w in (polling, listening):
        w.signal(15)
    for w in (polling, listening):
        assert w.wait(timeout=60) == 0, w.log()[-3000:]
        log = w.log()
        for symptom in ("unsupported startup parameter", "prepared statement", "crashed",
                        "Traceback", "bind message"):
            assert symptom not in log, f"{symptom!r} in a worker's log:\n{log[-5000:]}"

    with engine.connect() as conn:
        assert conn.execute(sa.text(
            "SELECT count(*) FROM flowq.steps WHERE status <> 'succeeded'")).scalar() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM flowq.workers")).scalar() == 0
    assert prepared_statements_left(pgbouncer) == []


def _registered(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM flowq.workers")).scalar_one())


def prepared_statements_left(url: str) -> list[str]:
    """The prepared statements left on the pooler's server sessions: POOL_SIZE clients, each
    holding a transaction open at once, are given every server session of the pool."""
    conninfo = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    found: list[str] = []
    with contextlib.ExitStack() as stack:
        for _ in range(POOL_SIZE):
            conn = stack.enter_context(psycopg.connect(conninfo, prepare_threshold=None))
            found += [r[0] for r in conn.execute("SELECT name FROM pg_prepared_statements")]
    return found


def test_enqueue_through_pgbouncer_needs_no_prepared_statements(pgbouncer: str,
                                                                pgb_app: ModuleType) -> None:
    """`flowq.db.create_engine(url, pgbouncer=True)`: the same enqueue many times on one
    pooled connection, each in its own transaction, never prepares a statement."""
    pooled = flowq.db.create_engine(pgbouncer, pgbouncer=True, pool_size=1, max_overflow=0)
    try:
        for i in range(20):
            with pooled.begin() as conn:
                flowq.enqueue(conn, pgb_app.record, n=i)
                prepared = conn.execute(sa.text(
                    "SELECT count(*) FROM pg_prepared_statements")).scalar()
                assert prepared == 0
        with pooled.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM flowq.steps")).scalar() == 20
    finally:
        pooled.dispose()


# -- the parts, without workers ---------------------------------------------------------------

def test_settings_become_set_local_and_plan_cache_mode_is_dropped() -> None:
    from flowq.worker.connection import (
        HOT_PATH_OPTIONS,
        MAINTENANCE_OPTIONS,
        heartbeat_options,
        local_settings_sql,
    )

    assert local_settings_sql(HOT_PATH_OPTIONS) == (
        "SELECT set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true), "
        "set_config('statement_timeout', '5min', true)")
    assert local_settings_sql(MAINTENANCE_OPTIONS) == (
        "SELECT set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true), "
        "set_config('statement_timeout', '30s', true)")
    assert "statement_timeout', '2000'" in str(local_settings_sql(heartbeat_options(2.0)))
    assert local_settings_sql("") is None
    with pytest.raises(ValueError):
        local_settings_sql("-x enable_seqscan=off")


SETTINGS = sa.text("SELECT current_setting('enable_seqscan'), current_setting('statement_timeout')"
                   ", current_setting('plan_cache_mode')")


def test_dedicated_connection_applies_its_settings_per_transaction(pgbouncer: str) -> None:
    from flowq.db import normalize_url
    from flowq.worker.connection import MAINTENANCE_OPTIONS, DedicatedConnection

    conn = DedicatedConnection(normalize_url(pgbouncer), "test pgbouncer", pgbouncer=True,
                               options=MAINTENANCE_OPTIONS)
    try:
        for _ in range(10):  # psycopg would have prepared it by now: it must not
            assert conn.execute(SETTINGS, {}) == [("off", "30s", "auto")]
        assert conn.transaction([(SETTINGS, {}), (SETTINGS, {})]) == [("off", "30s", "auto")]
        # A failed statement leaves no failed transaction behind on the pooled session.
        with pytest.raises(psycopg.Error):
            conn.execute(sa.text("SELECT 1 / 0"), {})
        assert conn.execute(SETTINGS, {}) == [("off", "30s", "auto")]
    finally:
        conn.close()
    # Nothing leaked into the server sessions that other clients get.
    conninfo = make_url(pgbouncer).set(drivername="postgresql").render_as_string(
        hide_password=False)
    with psycopg.connect(conninfo, autocommit=True, prepare_threshold=None) as plain:
        row = plain.execute("SELECT current_setting('enable_seqscan'), "
                            "count(*) FROM pg_prepared_statements").fetchone()
        assert row == ("on", 0)


def test_worker_engines_and_listener_behind_pgbouncer(pgbouncer: str, db_url: str,
                                                      pgb_app: ModuleType) -> None:
    from flowq.worker import Worker, WorkerConfig

    w = Worker(pgb_app.app, pgbouncer, WorkerConfig(pgbouncer=True))
    try:
        assert w.listener is None  # poll only: no LISTEN through the pooler
        assert w.executor.end_backend is None
        with w.engines["maintain"].connect() as conn:
            assert conn.execute(SETTINGS).one() == ("off", "30s", "auto")
            conn.commit()
            assert conn.execute(SETTINGS).one() == ("off", "30s", "auto")  # each transaction
        with w.engines["session"].connect() as conn:
            assert conn.execute(SETTINGS).one()[0] == "on"
        w.check_database()
    finally:
        for engine in w.engines.values():
            engine.dispose()
    direct = Worker(pgb_app.app, pgbouncer, WorkerConfig(pgbouncer=True, listen_url=db_url))
    try:
        assert direct.listener is not None
        assert make_url(db_url).port is not None
        # The server's own port (flowq.db.to_conninfo's key=value form), not PgBouncer's.
        assert f"port={make_url(db_url).port}" in direct.listener.conninfo.split()
    finally:
        for engine in direct.engines.values():
            engine.dispose()


def test_listen_url_and_no_listen_contradict(db_url: str) -> None:
    from click.testing import CliRunner

    from flowq.cli import main

    result = CliRunner().invoke(main, ["worker", "ledger_app:app", "--database-url", db_url,
                                       "--pgbouncer", "--listen-url", db_url, "--no-listen"])
    assert result.exit_code == 2
    assert "--listen-url and --no-listen" in result.output


def test_wait_run_through_pgbouncer_returns_by_the_poll(pgbouncer: str, db_url: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Transaction pooling takes a LISTEN and never delivers its notifications: `wait_run`
    through the pooler still returns the run, by its fallback poll (shortened here)."""
    import threading

    from flowq.ops import results
    from flowq.ops.results import RunEndListener
    from flowq.testing import drain

    app = flowq.FlowQ()

    @app.task(name="pgb_wait_noop")
    def noop(ctx: flowq.Context) -> dict[str, bool]:
        return {"ok": True}

    reads: list[int] = []
    real = results.read_run
    monkeypatch.setattr(results, "read_run", lambda *a, **k: reads.append(1) or real(*a, **k))
    monkeypatch.setattr(results, "FALLBACK_POLL", 0.3)
    pooled = flowq.db.create_engine(pgbouncer, pgbouncer=True)
    direct = sa.create_engine(db_url)
    try:
        with direct.begin() as conn:
            run_id = flowq.enqueue(conn, noop).id
        out: dict[str, Any] = {}
        waiter = threading.Thread(target=lambda: out.setdefault(
            "run", flowq.wait_run(pooled, run_id, timeout=60)), daemon=True)
        waiter.start()
        wait_until(lambda: reads, message="the waiter's first read")
        with direct.begin() as conn:
            drain(conn, app)
        waiter.join(timeout=60)
        assert out["run"].status == "succeeded" and out["run"].result == {"ok": True}
        assert RunEndListener.shared(pooled).notified == 0  # the poll found it
        assert len(reads) >= 2
    finally:
        RunEndListener.shared(pooled).close()
        pooled.dispose()
        direct.dispose()
