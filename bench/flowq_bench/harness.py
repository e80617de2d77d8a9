"""The bench's plumbing: the server, a fresh database per scenario, and `flowq worker` processes.

- `open_server(url)`: the server at `url`, or (None) a fresh embedded PostgreSQL with durable
  default settings (fsync on, synchronous_commit on), stopped on exit. Only the caller's URL
  is used, never the environment's.
- `Server.fresh_database()`: a new database cloned from a migrated template (CREATE DATABASE
  … TEMPLATE), dropped afterwards, so one scenario never sees another's rows or dead tuples.
- `reset(engine)`: TRUNCATE both job tables (`flowq.jobs`, `flowq.job_history`), the run
  keys, the workflow and bench tables between repeats of one scenario.
- `WorkerGroup`: real `python -m flowq worker flowq_bench.app:app --processes P` processes,
  started and ready (their LISTEN connections seen in pg_stat_activity) before timing starts.
  They serve `--queues bench` unless told otherwise (the bench app also declares the limited
  queues of the `limit` and `rate` scenarios, which the other scenarios must not visit).
- `WorkerThread`: the same worker embedded in the bench's own process (`Worker.running()`,
  on threads, configured as `WorkerGroup`'s command line configures `flowq worker`), for a
  worker that shares its process with a producer (`overload`).

The bench drops and truncates only what it created: the template only once its CREATE
succeeded, a scenario's database only after creating it, and `reset` refuses any database
not created by `fresh_database` in this process (the bench's table names are common words).
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import sqlalchemy as sa

import flowq
from flowq.db import normalize_url, to_conninfo

__all__ = ["BENCH_QUEUE", "Server", "WorkerGroup", "WorkerThread", "conninfo", "open_server",
           "own_database", "reset", "reset_table", "wait_for"]

BENCH_APP: Final = "flowq_bench.app:app"
BENCH_QUEUE: Final = "bench"  # the queue of every scenario's tasks but limit's and rate's
READY_TIMEOUT: Final = 60.0
STOP_TIMEOUT: Final = 40.0
# Handlers' tables; created in the template so each fresh database has them.
_BENCH_DDL: Final = (
    "CREATE TABLE bench_ledger (id bigserial PRIMARY KEY, job_id bigint NOT NULL)",
    "CREATE TABLE bench_stamps (run_id bigint NOT NULL, started float8 NOT NULL)",
    "CREATE TABLE bench_orders (id bigserial PRIMARY KEY, item text NOT NULL)",
)
# The workflow tables too: RESTART IDENTITY restarts run ids, so a join counter left from the
# previous repeat would be taken for the new run of the same id.
# Both job tables and the run keys (revision 0018): a run's finished rows are in job_history.
_TRUNCATE: Final = ("TRUNCATE flowq.jobs, flowq.job_history, flowq.run_keys, flowq.joins, "
                    "flowq.join_shards, flowq.signals, flowq.checkpoints, bench_ledger, "
                    "bench_stamps, bench_orders RESTART IDENTITY")
# The databases `fresh_database` created and has not dropped yet: all `reset` may empty.
_created_databases: set[str] = set()


def conninfo(url: str) -> str:
    """A libpq conninfo (for raw psycopg) from any URL flowq takes (`flowq.db.to_conninfo`)."""
    return to_conninfo(normalize_url(url))


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Server:
    """A PostgreSQL server the bench may create databases on."""

    url: str  # a database to connect to for CREATE DATABASE
    embedded: Any = None  # the LocalPostgres we started, if any
    template: str = field(default_factory=lambda: f"flowq_bench_tpl_{uuid.uuid4().hex[:8]}")
    template_created: bool = False  # set once our CREATE DATABASE of `template` succeeded

    def admin(self) -> sa.Engine:
        return sa.create_engine(normalize_url(self.url), isolation_level="AUTOCOMMIT",
                                poolclass=sa.pool.NullPool)

    def machine(self) -> dict[str, Any]:
        """What the numbers depend on: cores, OS, PostgreSQL version and durability settings."""
        eng = self.admin()
        try:
            with eng.connect() as c:
                version = c.execute(sa.text("SHOW server_version")).scalar()
                settings = {name: c.execute(sa.text(f"SHOW {name}")).scalar() for name in
                            ("fsync", "synchronous_commit", "full_page_writes",
                             "shared_buffers", "max_connections")}
        finally:
            eng.dispose()
        return {"cores": os.cpu_count(), "platform": platform.platform(),
                "python": platform.python_version(), "postgresql": version,
                "embedded": self.embedded is not None, **settings}

    def create_template(self) -> None:
        eng = self.admin()
        try:
            with eng.connect() as c:
                c.execute(sa.text(f'CREATE DATABASE "{self.template}"'))
            self.template_created = True
        finally:
            eng.dispose()
        db = sa.create_engine(self._url_of(self.template), poolclass=sa.pool.NullPool)
        flowq.migrate(db)
        with db.begin() as c:
            for ddl in _BENCH_DDL:
                c.execute(sa.text(ddl))
        db.dispose()

    def _url_of(self, database: str) -> str:
        return normalize_url(self.url).set(database=database).render_as_string(
            hide_password=False)

    @contextlib.contextmanager
    def fresh_database(self) -> Iterator[str]:
        """The URL of a new migrated database with the bench tables; dropped afterwards."""
        name = f"flowq_bench_{uuid.uuid4().hex[:10]}"
        eng = self.admin()
        with eng.connect() as c:
            c.execute(sa.text(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"'))
        _created_databases.add(name)
        try:
            yield self._url_of(name)
        finally:
            with eng.connect() as c:
                c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            _created_databases.discard(name)
            eng.dispose()

    def close(self) -> None:
        """Drop the template if we created it, and stop the embedded server if we started it."""
        if self.template_created:
            eng = self.admin()
            with contextlib.suppress(sa.exc.DBAPIError), eng.connect() as c:
                c.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.template}" WITH (FORCE)'))
                self.template_created = False
            eng.dispose()
        if self.embedded is not None:
            self.embedded.stop()


@contextlib.contextmanager
def open_server(url: str | None, settings: Mapping[str, str] | None = None
                ) -> Iterator[Server]:
    """The server at `url`, or a fresh embedded one with durable defaults (plus `settings`)."""
    embedded = None
    if url is None:
        from flowq.local.postgres import LocalPostgres

        embedded = LocalPostgres(settings=settings).start()
        url = embedded.url
    # normalize_url: a malformed URL is a flowq error (its password hidden), not a traceback.
    server = Server(normalize_url(url).render_as_string(hide_password=False), embedded)
    try:
        server.create_template()
        yield server
    finally:
        server.close()


def reset(engine: sa.Engine) -> None:
    """Empty the jobs and bench tables (between repeats, with workers idle) of a database
    `fresh_database` created; a RuntimeError for any other."""
    with engine.begin() as c:
        own_database(c, "empty")
        c.execute(sa.text(_TRUNCATE))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(sa.text("VACUUM ANALYZE flowq.jobs"))
        c.execute(sa.text("VACUUM ANALYZE flowq.job_history"))  # each partition, then the parent
        c.execute(sa.text("VACUUM ANALYZE flowq.joins"))


def own_database(c: sa.Connection, what: str = "change") -> None:
    """A RuntimeError unless `c` is connected to a database `fresh_database` created (and
    has not dropped yet): the only databases the bench may write its own tables to."""
    database = c.execute(sa.text("SELECT current_database()")).scalar()
    if database not in _created_databases:
        raise RuntimeError(f"flowq bench: refusing to {what} database {database!r}, "
                           "which it did not create")


def reset_table(engine: sa.Engine, table: str) -> None:
    """Empty `table` (a bench table, such as the minimal reference's) of a database
    `fresh_database` created, and VACUUM ANALYZE it, as `reset` does flowq.jobs."""
    with engine.begin() as c:
        own_database(c, "empty")
        c.execute(sa.text(f"TRUNCATE {table} RESTART IDENTITY"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(sa.text(f"VACUUM ANALYZE {table}"))


_LISTENING: Final = sa.text(
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
    "AND application_name LIKE 'flowq listen %'")


def _wait_listening(engine: sa.Engine, n: int, alive: Callable[[], None]) -> None:
    """Until `n` workers hold their LISTEN connection (each has started its claim loop);
    `alive()` raises if the workers are gone."""
    def ready() -> bool:
        alive()
        with engine.connect() as c:
            return int(c.execute(_LISTENING).scalar() or 0) >= n

    wait_for(ready, READY_TIMEOUT, "the workers to start", interval=0.05)


class WorkerGroup:
    """`flowq worker flowq_bench.app:app` with P processes of concurrency C, as a user runs it."""

    def __init__(self, url: str, *, processes: int, concurrency: int,
                 extra: tuple[str, ...] = (), module: tuple[str, ...] | None = None,
                 queues: tuple[str, ...] = (BENCH_QUEUE,),
                 env: Mapping[str, str] | None = None) -> None:
        self.url = url
        self.processes = processes
        self.concurrency = concurrency
        self.argv = [sys.executable, "-m", *(module or ("flowq", "worker", BENCH_APP)),
                     "--database-url", url, "--processes", str(processes),
                     "--concurrency", str(concurrency), "--queues", ",".join(queues),
                     "--no-job-log", "--log-level", "WARNING", *extra]
        # The bench app reads its queue limits from these (see flowq_bench.app).
        # Tracing off (FLOWQ_TRACING=0), as without the otel extra: the bench measures the
        # runtime; what OpenTelemetry costs is measured on its own (docs/benchmarks.md).
        self.env = {**os.environ, "FLOWQ_TRACING": "0", **(env or {})}
        self.log = Path(tempfile.mkstemp(prefix="flowq-bench-worker-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> WorkerGroup:
        with open(self.log, "wb") as out:
            # A session of its own, so a stuck group can be killed without touching ours.
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=self.env)
        return self

    def wait_ready(self, engine: sa.Engine) -> None:
        """Until every process holds its LISTEN connection (it has started its claim loop)."""
        def alive() -> None:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")

        _wait_listening(engine, self.processes, alive)

    def group_pids(self) -> list[int]:
        """The process started (the supervisor when P > 1): `cpu.tree_cpu` adds its
        descendants, so the group's CPU is all of it, supervisor included."""
        return [] if self.proc is None else [self.proc.pid]

    def pids(self) -> list[int]:
        """The worker processes (the supervisor's children when P > 1)."""
        if self.proc is None:
            return []
        if self.processes == 1:
            return [self.proc.pid]
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                             text=True, check=False).stdout
        return [int(p) for p in out.split()]

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        if " WARNING " in text or " ERROR " in text:
            # Kept: a reaped job or a restarted process explains an outlier in the table.
            print(f"flowq bench: worker warnings kept in {self.log}", file=sys.stderr)
            return
        with contextlib.suppress(OSError):
            self.log.unlink()


class WorkerThread:
    """`flowq worker flowq_bench.app:app --concurrency C --queues bench --no-job-log` run on
    threads of this process instead (`Worker.running()`): a worker beside a producer in one
    process, as an app that embeds its worker runs it. Leaving the block stops it as
    SIGTERM stops `flowq worker` (running handlers finish within the grace period) and
    raises what the worker raised."""

    def __init__(self, url: str, *, concurrency: int,
                 queues: tuple[str, ...] = (BENCH_QUEUE,)) -> None:
        from flowq.worker import Worker, WorkerConfig
        from flowq_bench.app import app

        self.config = WorkerConfig(queues=list(queues), concurrency=concurrency,
                                   job_log=False)
        self.worker = Worker(app, url, self.config)
        self._running: contextlib.AbstractContextManager[Any] | None = None

    def __enter__(self) -> WorkerThread:
        self._running = self.worker.running()
        self._running.__enter__()
        return self

    def wait_ready(self, engine: sa.Engine) -> None:
        """Until its LISTEN connection is open (its claim loop has started)."""
        def alive() -> None:
            if self._running is None:
                raise RuntimeError("the worker thread was not started")

        _wait_listening(engine, 1, alive)

    def __exit__(self, *exc: Any) -> None:
        if self._running is not None:
            running, self._running = self._running, None
            running.__exit__(*exc)
