"""What flowq's own tests share besides fixtures: reading the test database, and real
`flowq worker` processes (starting them, watching their connections, stopping them).

The fixtures live in tests/conftest.py (`db_url`, `engine`, `ledger`, `Session`,
`spawn_worker`, ...), built on the shipped pytest plugin's server (`flowq_server_url`,
`flowq_postgres`); this module holds the plain functions tests import:

- `rows(engine, sql, **params)` and `scalar(engine, sql, **params)` (exactly one row, one
  column) read through a short connection of their own, so they see only committed data.
- `enqueue(engine, target, **args)` (what `flowq.enqueue` returned) and `enqueue_id` (the
  run id) enqueue in a transaction of their own, committed on return; `run_async(db_url,
  fn)` runs `fn` on an AsyncEngine; `max_overlap(rows)`: how many ran at once.
- `cli(*args, env=)`: `flowq ARGS` in-process, no database URL taken from the environment
  (`NO_ENV`), and `assert_user_error(result, *fragments)`: it failed with one sentence;
  `dashboard_client(engine)`: the dashboard app in a TestClient; `free_port()`.
- `WorkerProcess` (what `spawn_worker` returns), `spawn_ready` (start workers and wait until
  each listens), `stop_workers` (SIGTERM, exit 0, no crash line in the log), `end_workers`
  (a fixture's teardown: kill what still runs, print the logs).
- `backends(engine, role, pid=, state=)`, `terminate(engine, pids)`: a worker's server
  connections, by the role in their `application_name` ("flowq claim <host>:<pid>:..."), as
  fault tests find and cut them; `held_by(engine, pid)`: the running jobs a worker claimed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import sqlalchemy as sa

import flowq
from flowq.testing import job_rows, wait_until

if TYPE_CHECKING:
    from click.testing import Result
    from sqlalchemy.ext.asyncio import AsyncEngine
    from starlette.testclient import TestClient

__all__ = ["APPS_DIR", "CRASH_LINES", "NO_ENV", "Row", "Spawn", "WorkerProcess",
           "assert_no_crash_lines", "assert_user_error", "backends", "cli", "dashboard_client",
           "end_workers",
           "enqueue", "enqueue_id", "free_port", "held_by", "max_overlap", "rows", "run_async",
           "scalar", "spawn_ready",
           "stop_workers", "terminate"]

# The test apps (tests/apps/*.py) import as top-level modules, in the tests and in worker
# processes (conftest puts this directory on sys.path, `spawn_worker` on the child's
# PYTHONPATH).
APPS_DIR: Final = Path(__file__).parent / "apps"
# Log lines that only a flowq bug writes (a part of the worker crashed and carried on).
CRASH_LINES: Final = ("crashed", "could not start a claimed job")
# The environment of an in-process `flowq` command: no database URL nor app but the ones it
# is given.
NO_ENV: Final[dict[str, str | None]] = {"FLOWQ_DATABASE_URL": None, "DATABASE_URL": None,
                                        "FLOWQ_APP": None}

Row = sa.Row[Any]
T = TypeVar("T")


# -- reading the database -----------------------------------------------------------------


def rows(engine: sa.Engine, sql: str, **params: Any) -> list[Row]:
    """The rows of `sql`, read through a connection of its own (committed data only)."""
    with engine.connect() as conn:
        return list(conn.execute(sa.text(sql), params))


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    """The one value of `sql`: an error unless it returns exactly one row."""
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar_one()


# -- enqueueing ----------------------------------------------------------------------------


def enqueue(engine: sa.Engine, target: Any, **args: Any) -> flowq.Enqueued:
    """`flowq.enqueue(target, **args)` in a transaction of its own, committed on return."""
    with engine.begin() as conn:
        return flowq.enqueue(conn, target, **args)


def enqueue_id(engine: sa.Engine, target: Any, **args: Any) -> int:
    """The run id of `enqueue`."""
    return enqueue(engine, target, **args).id


def run_async(db_url: str, fn: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    """`asyncio.run` of `fn` on an AsyncEngine of `db_url` made for it (disposed after)."""
    from sqlalchemy.ext.asyncio import create_async_engine

    async def main() -> T:
        engine = create_async_engine(db_url)
        try:
            return await fn(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def max_overlap(rows: Iterable[Any]) -> int:
    """The most of these rows (`started`, `ended`) that were running at once."""
    rows = list(rows)
    events = sorted([(r.started, 1) for r in rows] + [(r.ended, -1) for r in rows],
                    key=lambda e: (e[0], e[1]))
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


# -- commands, servers, ports ---------------------------------------------------------------


def cli(*args: str, env: dict[str, str | None] | None = None) -> Result:
    """`flowq ARGS`, in-process; a database URL only from ARGS (or `env`)."""
    from click.testing import CliRunner

    from flowq.cli import main

    return CliRunner().invoke(main, list(args), env={**NO_ENV, **(env or {})})


def assert_user_error(result: Result, *fragments: str) -> str:
    """A `cli` result that is a user error: exit code 2, no traceback, one line of
    `Error: <sentence>` on stderr holding each of `fragments`; that line."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception,
                                                                     SystemExit)
    text = result.stderr.strip()
    assert "Traceback" not in result.output
    assert text.startswith("Error: ") and "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, text
    return text


def dashboard_client(engine: sa.Engine, **kwargs: Any) -> TestClient:
    """The dashboard on `engine` (`create_app(engine, **kwargs)`) in a TestClient."""
    from starlette.testclient import TestClient

    from flowq.dashboard import create_app

    return TestClient(create_app(engine, **kwargs), base_url="http://127.0.0.1:8080")


def free_port(span: int = 1) -> int:
    """A port P with P .. P+span-1 free on 127.0.0.1 now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + span > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for p in range(port, port + span):
                    t = stack.enter_context(socket.socket())
                    t.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise AssertionError("no free port")


# -- worker processes ---------------------------------------------------------------------


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


# What the `spawn_worker` fixture is: (app_spec, url, *args, env=None) -> WorkerProcess.
Spawn = Callable[..., WorkerProcess]


def backends(engine: sa.Engine, role: str, *, pid: int | None = None,
             state: str | None = None) -> list[int]:
    """Server pids of this database's connections of one worker role ('claim', 'listen',
    ...), optionally of the worker process `pid` only, or in one `state` only."""
    return [r[0] for r in rows(
        engine, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND application_name LIKE :name AND (CAST(:state AS text) IS NULL OR state = :state)",
        name=f"flowq {role} %" + (f":{pid}:%" if pid else ""), state=state)]


def terminate(engine: sa.Engine, pids: Iterable[int]) -> None:
    """pg_terminate_backend each of these server pids."""
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM unnest(:p) AS pid"),
                     {"p": list(pids)})


def held_by(engine: sa.Engine, pid: int) -> list[Row]:
    """The running jobs claimed by the worker process `pid`."""
    return job_rows(engine, where="status = 'running' AND split_part(locked_by, ':', 2) = :p",
                    p=str(pid))


def held_when_killed(engine: sa.Engine, pid: int) -> list[Row]:
    """`held_by` of a worker process just SIGKILLed, once the server has ended every backend
    it had: a statement it sent before dying (a completion batch, a commit) still runs to its
    end, so rows read earlier may be finished a moment later by the dead worker itself."""
    wait_until(lambda: not backends(engine, "%", pid=pid), timeout=30,
               message=f"the backends of killed worker {pid} gone")
    return held_by(engine, pid)


def spawn_ready(spawn_worker: Spawn, engine: sa.Engine, app_spec: str, url: str, n: int,
                *args: str) -> list[WorkerProcess]:
    """Start `n` workers of `app_spec` and wait until each is up (listening), so that work
    enqueued next is not all overdue at once when they claim."""
    workers = [spawn_worker(app_spec, url, *args) for _ in range(n)]
    for w in workers:
        wait_until(partial(backends, engine, "listen", pid=w.pid), timeout=60,
                   message=f"worker {w.pid} listening")
    return workers


def end_workers(workers: Iterable[WorkerProcess], tail: int = 5000) -> None:
    """At a fixture's teardown: kill each worker still running, then print the end of each
    log (pytest shows it for a failed test)."""
    workers = list(workers)
    for wp in workers:
        if wp.proc.poll() is None:
            wp.proc.kill()
            wp.proc.wait(timeout=10)
    for wp in workers:
        with contextlib.suppress(Exception):
            print(f"--- {wp.log_path.name} (exit {wp.proc.returncode}) ---\n{wp.log()[-tail:]}")


def assert_no_crash_lines(*workers: WorkerProcess) -> None:
    for w in workers:
        bad = [line for line in w.log().splitlines() if any(s in line for s in CRASH_LINES)]
        assert not bad, f"worker {w.pid} logged a crash: {bad[:5]}"


def stop_workers(*workers: WorkerProcess) -> None:
    """SIGTERM each worker; each must drain and exit 0, having logged no crash."""
    for w in workers:
        w.signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(timeout=60) == 0, w.log()[-3000:]
    assert_no_crash_lines(*workers)
