"""The `flowq` command: migrate, worker, reap, prune, and one-sentence user errors (exit 2)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from support import APPS_DIR, NO_ENV, assert_user_error
from support import cli as flowq

from flowq.testing import job_rows


@pytest.fixture
def app_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module in the cwd defining `app` with a task on queue `q1`, plus non-apps."""
    name = f"cliapp_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        import flowq

        app = flowq.FlowQ()
        not_an_app = 42

        @app.task(queue="q1")
        def hello(ctx) -> None:
            pass
    """))
    monkeypatch.chdir(tmp_path)
    return name


@pytest.fixture
def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"postgresql://postgres@127.0.0.1:{port}/nowhere?connect_timeout=3"


# -- migrate ---------------------------------------------------------------------------------


def test_migrate_is_idempotent(empty_db_url: str) -> None:
    for expected in ("created", "already up to date"):
        result = flowq("migrate", "--database-url", empty_db_url)
        assert result.exit_code == 0, result.output
        assert expected in result.output
    engine = sa.create_engine(empty_db_url)
    try:
        assert job_rows(engine) == []
    finally:
        engine.dispose()


def test_migrate_reads_the_url_from_the_environment(empty_db_url: str) -> None:
    result = flowq("migrate", env={"FLOWQ_DATABASE_URL": empty_db_url})
    assert result.exit_code == 0, result.output


def test_migrate_sql_prints_the_ddl_without_a_database() -> None:
    result = flowq("migrate", "--sql")
    assert result.exit_code == 0, result.output
    assert "CREATE TABLE flowq.jobs" in result.output
    assert "jobs_pending_idx" in result.output
    assert "alembic_version" in result.output


# -- user errors -------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["migrate"], ["reap"], ["prune"], ["worker", "x:app"]])
def test_no_database_url_is_one_sentence(command: list[str]) -> None:
    assert_user_error(flowq(*command), "no database given", "--database-url")


@pytest.mark.parametrize("command", [["migrate"], ["reap"], ["prune"]])
def test_non_postgresql_url_is_one_sentence(command: list[str]) -> None:
    assert_user_error(flowq(*command, "--database-url", "mysql://u:p@localhost/db"),
                      "needs PostgreSQL", "'mysql")


def test_non_postgresql_url_for_the_worker(app_module: str) -> None:
    assert_user_error(flowq("worker", f"{app_module}:app", "--database-url", "mysql://x/db"),
                      "needs PostgreSQL")


def test_garbage_url_is_one_sentence() -> None:
    assert_user_error(flowq("migrate", "--database-url", "not a url"), "not a database URL")


@pytest.mark.parametrize("command", [["migrate"], ["reap"], ["prune"]])
def test_unreachable_server_is_one_sentence(command: list[str], closed_port_url: str) -> None:
    text = assert_user_error(flowq(*command, "--database-url", closed_port_url))
    assert "127.0.0.1" in text and ("cannot reach" in text or "cannot connect" in text)


def test_unreachable_server_for_the_worker(app_module: str, closed_port_url: str) -> None:
    text = assert_user_error(flowq("worker", f"{app_module}:app", "--database-url",
                                   closed_port_url, "--start-timeout", "0"))
    assert "cannot connect" in text or "cannot reach" in text


@pytest.mark.parametrize("driver", ["postgres", "postgresql+asyncpg", "postgresql+psycopg2",
                                    "postgres+psycopg", "postgresql+pg8000"])
def test_any_postgresql_driver_in_the_url_means_psycopg(driver: str,
                                                       closed_port_url: str) -> None:
    # The user's app may use another driver; flowq's own connections use psycopg 3 anyway.
    url = closed_port_url.replace("postgresql://", f"{driver}://", 1)
    text = assert_user_error(flowq("migrate", "--database-url", url))
    assert "cannot reach" in text or "cannot connect" in text


@pytest.mark.parametrize("command", [["reap"], ["prune"]])
def test_database_without_the_schema_says_to_migrate(command: list[str],
                                                     empty_db_url: str) -> None:
    assert_user_error(flowq(*command, "--database-url", empty_db_url), "flowq migrate")


def test_worker_on_a_database_without_the_schema_says_to_migrate(app_module: str,
                                                                 empty_db_url: str) -> None:
    assert_user_error(flowq("worker", f"{app_module}:app", "--database-url", empty_db_url),
                      "no flowq schema", "flowq migrate")


@pytest.mark.parametrize(("spec", "fragment"), [
    ("no_such_module_xyz:app", "cannot import 'no_such_module_xyz'"),
    ("{mod}:missing", "is not a flowq.FlowQ app"),
    ("{mod}:not_an_app", "is not a flowq.FlowQ app"),
    (":app", "expected MODULE:APP"),
])
def test_bad_app_spec_is_one_sentence(app_module: str, db_url: str, spec: str,
                                      fragment: str) -> None:
    assert_user_error(flowq("worker", spec.format(mod=app_module), "--database-url", db_url),
                      fragment)


def test_a_misspelt_app_names_the_modules_apps(app_module: str, db_url: str) -> None:
    result = flowq("worker", f"{app_module}:ap", "--database-url", db_url)
    assert_user_error(result, "did you mean 'app'?", f"has 1 FlowQ app(s): {app_module}:app")


def test_a_module_alone_names_its_only_app(app_module: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from flowq.cli.common import load_app

    app = load_app(app_module)
    assert "hello" in app
    assert f"using {app_module}:app, the module's only FlowQ app" in capsys.readouterr().err


def test_a_module_with_several_apps_is_refused_with_their_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, db_url: str) -> None:
    name = f"twoapps_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("import flowq\nbilling = flowq.FlowQ()\n"
                                         "mail = flowq.FlowQ()\n")
    monkeypatch.chdir(tmp_path)
    assert_user_error(flowq("worker", name, "--database-url", db_url),
                      "names a module, not an app", f"{name}:billing, {name}:mail")


def test_a_queue_the_app_does_not_use_is_pointed_out(app_module: str,
                                                     empty_db_url: str) -> None:
    """Said before anything starts (here the database is not migrated: the worker stops)."""
    result = flowq("worker", f"{app_module}:app", "--database-url", empty_db_url,
                   "--queues", "q1,q11")
    assert result.exit_code == 2
    [warning] = [line for line in result.stderr.splitlines() if "warning" in line]
    assert "queue 'q11': did you mean 'q1'? (the app's queues: q1)" in warning


def test_app_module_with_a_missing_dependency_is_not_reported_as_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, db_url: str) -> None:
    # The module exists; what it imports does not. Its own name starts like the missing one.
    missing = f"zz{uuid.uuid4().hex[:8]}"
    name = f"{missing}_jobs"
    (tmp_path / f"{name}.py").write_text(f"import {missing}\n")
    monkeypatch.chdir(tmp_path)
    result = flowq("worker", f"{name}:app", "--database-url", db_url)
    assert result.exit_code != 0
    assert f"cannot import {name!r}: no such module" not in result.output
    assert isinstance(result.exception, ModuleNotFoundError)  # the real error, traceback kept
    assert result.exception.name == missing


@pytest.mark.parametrize("queues", ["bad queue!", "ok,no spaces here", ",", ""])
def test_invalid_queues_is_one_sentence(app_module: str, db_url: str, queues: str) -> None:
    assert_user_error(flowq("worker", f"{app_module}:app", "--database-url", db_url,
                            "--queues", queues), "queue")


def test_inconsistent_worker_options_are_one_sentence(app_module: str, db_url: str) -> None:
    assert_user_error(flowq("worker", f"{app_module}:app", "--database-url", db_url,
                            "--heartbeat-interval", "5", "--stale-after", "6"),
                      "stale_after must exceed twice heartbeat_interval")


def test_invalid_numbers_are_usage_errors(app_module: str, db_url: str) -> None:
    result = flowq("worker", f"{app_module}:app", "--database-url", db_url,
                   "--concurrency", "0")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--concurrency" in result.output


# -- reap, prune, worker --help ------------------------------------------------------------


def test_reap_runs_one_pass_and_reports(db_url: str) -> None:
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(
                "INSERT INTO flowq.jobs (task, step, status, attempts, locked_by, heartbeat_at)"
                " VALUES ('t', 't', 'running', 1, 'gone', now() - interval '5 minutes'),"
                "        ('t', 't', 'running', 1, 'alive', now())"))
        result = flowq("reap", "--database-url", db_url)
        assert result.exit_code == 0, result.output
        assert result.output.strip() == "reaped 1 job(s)."
        assert sorted(r.status for r in job_rows(engine)) == ["pending", "running"]
    finally:
        engine.dispose()


def test_prune_runs_one_pass_and_reports(db_url: str) -> None:
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(
                "INSERT INTO flowq.jobs (task, step, status, finished_at) VALUES "
                "('t', 't', 'succeeded', now() - interval '10 days'),"
                "('t', 't', 'succeeded', now() - interval '1 day')"))
        result = flowq("prune", "--database-url", db_url)
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == "pruned 1 row(s)."
        # what it does, said as it starts (stderr: one line off a terminal)
        assert result.stderr == ("flowq: deleting runs finished more than 259,200s ago "
                                 "(1,209,600s with a dead step), a batch per transaction …\n")
        result = flowq("prune", "--database-url", db_url, "--retention", "0")
        assert result.stdout.strip() == "pruned 1 row(s)."
        assert job_rows(engine) == []
    finally:
        engine.dispose()


def test_worker_help_lists_the_options() -> None:
    result = flowq("worker", "--help")
    assert result.exit_code == 0
    for option in ("--queues", "--concurrency", "--processes", "--database-url",
                   "--poll-interval", "--no-listen", "--shutdown-grace", "--log-format",
                   "--job-log"):
        assert option in result.output, option


# -- the real command ------------------------------------------------------------------------


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in NO_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(APPS_DIR), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "flowq", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_python_m_flowq_migrate_sql() -> None:
    proc = _run("migrate", "--sql")
    assert proc.returncode == 0, proc.stderr
    assert "CREATE TABLE flowq.jobs" in proc.stdout


@pytest.mark.parametrize(("spec", "fragment"), [
    ("ledger_app:app", "no flowq schema 'flowq': run `flowq migrate` first."),
    ("nosuchmodule_abc:app", "cannot import 'nosuchmodule_abc'"),
])
def test_python_m_flowq_worker_user_errors(empty_db_url: str, spec: str, fragment: str) -> None:
    proc = _run("worker", spec, "--database-url", empty_db_url)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    text = proc.stderr.strip()
    assert text.startswith("Error: ") and "\n" not in text, text
    assert fragment in text


@pytest.mark.parametrize("command", [["reap"], ["prune"], ["runs", "list"]])
def test_missing_non_default_schema_says_to_migrate_with_that_schema(
        command: list[str], db_url: str) -> None:
    assert_user_error(flowq(*command, "--database-url", db_url, "--schema", "nope"),
                      "no flowq schema 'nope'", "run `flowq migrate --schema nope` first.")


def test_migrate_says_whether_it_created_upgraded_or_found_the_schema_up_to_date(
        empty_db_url: str) -> None:
    from flowq.db.migrations import HEAD_REVISION, downgrade

    def migrate(*args: str) -> str:
        result = flowq("migrate", "--database-url", empty_db_url, *args)
        assert result.exit_code == 0, result.output
        return result.output.strip()

    assert migrate() == f"created flowq schema 'flowq' at revision {HEAD_REVISION}."
    assert migrate() == f"flowq schema 'flowq' is already up to date (revision {HEAD_REVISION})."
    engine = sa.create_engine(empty_db_url)
    try:
        downgrade(engine, revision="0001")
        assert migrate() == f"upgraded flowq schema 'flowq' from revision 0001 to {HEAD_REVISION}."
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE SCHEMA mine"))
    finally:
        engine.dispose()
    assert migrate("--schema", "mine") == (
        f"created flowq's tables in the existing schema 'mine' at revision {HEAD_REVISION}.")


# -- naming the app: one way for every command -----------------------------------------------

# Each command that uses an app: the app named after the command (where it takes no other
# argument), with --app, or in FLOWQ_APP, is found the same way.
APP_COMMANDS = {"worker": True, "deploy-check": True, "schedules": True, "dashboard": True,
                "runs show 1": False, "signal 1 approved": False}
APP_CASES = [(command, way) for command, positional in APP_COMMANDS.items()
             for way in ("positional", "--app", "FLOWQ_APP") if positional or way != "positional"]


@pytest.mark.parametrize(("command", "way"), APP_CASES, ids=[" ".join(c) for c in APP_CASES])
def test_every_command_names_the_app_the_same_ways(app_module: str, db_url: str, command: str,
                                                   way: str) -> None:
    spec = f"{app_module}:ap"  # misspelt: the command says so once it has loaded the app
    args = {"positional": [spec], "--app": ["--app", spec], "FLOWQ_APP": []}[way]
    result = flowq(*command.split(), *args, "--database-url", db_url,
                   env={"FLOWQ_APP": spec} if way == "FLOWQ_APP" else None)
    assert_user_error(result, f"'{spec}' is not a flowq.FlowQ app", "did you mean 'app'?")


def test_the_app_named_each_way_is_used(app_module: str, db_url: str) -> None:
    for args, env in [([f"{app_module}:app"], None), (["--app", f"{app_module}:app"], None),
                      ([], {"FLOWQ_APP": f"{app_module}:app"})]:
        listed = flowq("schedules", *args, "--database-url", db_url, env=env)
        assert (listed.exit_code, listed.output) == (0, "no schedules.\n"), (args, env)
        checked = flowq("deploy-check", *args, "--database-url", db_url, env=env)
        assert checked.exit_code == 0 and "ok: the code can continue" in checked.output


def test_a_command_that_needs_an_app_names_each_way_to_give_it(db_url: str) -> None:
    for command in ("worker", "deploy-check"):
        assert_user_error(flowq(command, "--database-url", db_url),
                          f"no app given: name it as `flowq {command} MODULE:APP`",
                          "--app MODULE:APP", "FLOWQ_APP")


def test_an_app_named_twice_differently_is_refused(app_module: str, db_url: str) -> None:
    assert_user_error(flowq("schedules", f"{app_module}:app", "--app", "other:app",
                            "--database-url", db_url), "the app is named twice")
    same = flowq("schedules", f"{app_module}:app", "--app", f"{app_module}:app",
                 "--database-url", db_url)
    assert same.exit_code == 0, same.output
