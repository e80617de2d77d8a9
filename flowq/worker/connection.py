"""A worker's connections: `WorkerConnections` (one per role, each named in pg_stat_activity),
the dedicated autocommit psycopg connection of a hot-path thread (`DedicatedConnection`:
claims, completions, heartbeats), the SQLAlchemy pools of the other roles (`role_engine`),
and the settings each role's connections carry.

The claim loop and the completer each own one connection and send their named statements
through psycopg directly, server-side prepared: no pool checkout, no BEGIN/COMMIT (each
statement is atomic on its own), no SQLAlchemy row objects. Profiling showed SQLAlchemy's
execute and row layers as a third of the worker's CPU per job on this path.

Seq scans are disabled on these connections (`PLANNER_OPTIONS`): every hot statement is
index-driven by design (the partial pending index, the primary key), but a queue that drained
to empty gets analyzed empty, and until autoanalyze catches up with the next burst the
planner would price a seq scan of the whole (bloated) table as cheap, turning a 1 ms claim
into hundreds of ms and stalling the worker (seen in `flowq bench`). The fenced writes are
written so that they can only go through the primary key (see `flowq.db.sql`).

The statements are prepared, but planned for every execution (`plan_cache_mode =
force_custom_plan`): a generic plan, chosen once after a few executions and reused, is made
without the parameter values (the queue, the LIMIT) and under whatever the statistics said
then; after a drain analyzed the table empty it kept claims at 0.1-0.8 s each for the whole
next burst (reproduced with repeated 50,000-job drains; gone with custom plans). Planning
costs a fraction of a millisecond, per statement that each handles a batch.

A failed connection (server restart, `pg_terminate_backend`) is dropped and reopened on the
next call; the caller sees the error once and retries its operation, which is safe because
every write is fenced.

Behind PgBouncer in transaction pooling mode (`pgbouncer=True`, `flowq worker --pgbouncer`)
a connection is a different server session at every transaction, so nothing may live in the
session: the connection sends no startup `options` (PgBouncer refuses them) and prepares
nothing (`prepare_threshold=None`; `fetch_rows` then never prepares either). The settings
are applied per transaction instead: every statement runs in an explicit transaction that
begins with `set_config(..., is_local => true)` (`SET LOCAL`), all in one pipelined round
trip. `enable_seqscan` and `statement_timeout` are kept that way; `plan_cache_mode` is
dropped, since an unprepared (unnamed) statement is planned with its parameter values at
every execution anyway, which is what `force_custom_plan` asks of a prepared one.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import psycopg
import sqlalchemy as sa
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from sqlalchemy import event
from sqlalchemy.engine import URL

from flowq.db.runner import Rows, fetch_rows, raw_sql, result_rows
from flowq.db.transient import is_read_only, is_transient, leave_read_only_servers
from flowq.db.urls import to_conninfo
from flowq.storable import first_line
from flowq.worker.logs import DEBUG, INFO, WARNING, log_event

__all__ = [
    "DB_BACKOFF_MAX",
    "DB_ERRORS",
    "HOT_PATH_OPTIONS",
    "HOT_PATH_TIMEOUT",
    "MAINTENANCE_OPTIONS",
    "PLANNER_OPTIONS",
    "DedicatedConnection",
    "Outage",
    "WorkerConnections",
    "heartbeat_options",
    "local_settings_sql",
    "role_engine",
    "set_local_on_begin",
]

# What a database failure looks like on either path (SQLAlchemy's or psycopg's own).
DB_ERRORS: Final = (sa.exc.DBAPIError, psycopg.Error)
# The longest a loop waits before it tries the database again after errors in a row.
DB_BACKOFF_MAX: Final = 5.0
# After an outage ends, failures for this long are its tail (a part meeting its broken
# connection only now), told at DEBUG rather than as a new outage.
AFTERSHOCK: Final = 2 * DB_BACKOFF_MAX
# Server settings for connections that only run flowq's index-driven statements. JIT off:
# `enable_seqscan=off` prices any seq scan left in a plan (a small table no index serves,
# such as `flowq.workers`) at 10^10, past `jit_above_cost`, and a server built with LLVM
# then compiled the statement at every execution (seen on PostgreSQL 15: 1.8 s per
# completion batch of a map's instances, against 1 ms run without JIT).
PLANNER_OPTIONS: Final = "-c enable_seqscan=off -c jit=off"
# The claim and completion connections also plan every execution (see the module docstring).
_CUSTOM_PLANS: Final = " -c plan_cache_mode=force_custom_plan"
# A claim or a completion takes milliseconds (a map's 100,000 successors: seconds). One that
# runs for minutes has a plan gone wrong or waits on a lock someone forgot; cancelled, it is
# sent again, planned afresh (the completer keeps its outcomes), and the error is logged,
# where without a bound the worker stopped completing for good (seen once in `flowq bench`:
# a completion CPU-bound for more than 12 minutes, docs/benchmarks.md).
HOT_PATH_TIMEOUT: Final = "5min"
HOT_PATH_OPTIONS: Final = PLANNER_OPTIONS + _CUSTOM_PLANS + f" -c statement_timeout={HOT_PATH_TIMEOUT}"
# Heartbeats, reaper and pruner: a pass that runs away (a bad plan on a table whose statistics
# lie) is cancelled and retried on the next interval instead of holding its locks for minutes
# (seen once in `flowq bench`: a prune busy for 7 minutes blocked a TRUNCATE, and the claims
# queued behind it).
MAINTENANCE_OPTIONS: Final = PLANNER_OPTIONS + " -c statement_timeout=30s"


class Outage:
    """A worker's view of database outages, told once: when the database goes away (a
    restart, a failover, a network cut) every part (claims, completions, LISTEN, heartbeat,
    registry, reaper, scheduler) meets the failure on its own connection. The first transient
    failure (`flowq.db.is_transient`) logs one WARNING, `database connection lost;
    reconnecting`; the others, at DEBUG; the first success after it, one INFO, `database
    connection back`, with how long it took. A failure that is not transient is logged at
    WARNING as it happens (`<part> failed; retrying`).

    Meeting a read-only server (a standby, or a primary demoted in place) bumps `read_only`:
    connections that never write (the LISTEN) reconnect when it changes, so that
    `target_session_attrs=read-write` takes them to the new primary too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.since: float | None = None  # when the outage in progress began (monotonic)
        self.told = False  # whether the outage in progress was announced
        self.ended_at = -math.inf
        self.failures = 0
        self.read_only = 0

    def failed(self, part: str, exc: BaseException, **fields: Any) -> None:
        """Report a failed database operation of `part` (fields: `retry_in_s`, ...)."""
        error = first_line(exc)
        if not is_transient(exc):
            log_event(WARNING, f"{part} failed; retrying", error=error, **fields)
            return
        now = time.monotonic()
        with self._lock:
            self.failures += 1
            if is_read_only(exc):
                self.read_only += 1
            first = self.since is None
            if first:
                self.since = now
                self.told = now - self.ended_at > AFTERSHOCK
            told = first and self.told
        if told:
            log_event(WARNING, "database connection lost; reconnecting", part=part, error=error,
                      **fields)
        else:
            log_event(DEBUG, f"{part} failed; retrying", error=error, **fields)

    def ok(self) -> None:
        """Report a database operation that succeeded: ends the outage in progress, if any.
        Costs one attribute read when there is none (it is called on the hot path)."""
        if self.since is None:
            return
        now = time.monotonic()
        with self._lock:
            since, self.since = self.since, None
            failures, self.failures = self.failures, 0
            if since is None:
                return
            self.ended_at = now
            told = self.told
        if told:
            log_event(INFO, "database connection back", after_s=round(now - since, 2),
                      failed_operations=failures)


def heartbeat_options(interval: float) -> str:
    """The heartbeat's connection: a beat that waits on a lock (someone holding one of our
    rows) is cancelled after one interval and sent again, rather than silencing every
    other claim's heartbeat until the reaper takes them all."""
    return (PLANNER_OPTIONS + _CUSTOM_PLANS
            + f" -c statement_timeout={max(1000, int(interval * 1000))}")


# Settings that only shape the plans of server-side prepared statements: without those
# (behind PgBouncer) they have nothing to do, and are not sent.
PREPARED_ONLY_SETTINGS: Final = frozenset({"plan_cache_mode"})
_PIPELINE: Final = psycopg.Pipeline.is_supported()
IDLE: Final = TransactionStatus.IDLE


def local_settings_sql(options: str) -> str | None:
    """The statement applying the `-c name=value` settings of a libpq `options` string to
    the current transaction only (`SET LOCAL`), for connections that may not carry session
    settings (PgBouncer in transaction mode); None when none is left to apply."""
    words = options.split()
    calls = []
    for flag, setting in zip(words[::2], words[1::2], strict=True):
        name, sep, value = setting.partition("=")
        if flag != "-c" or not sep:
            raise ValueError(f"not a -c name=value setting: {flag} {setting}")
        if name in PREPARED_ONLY_SETTINGS:
            continue
        calls.append("set_config('{}', '{}', true)".format(
            name.replace("'", "''"), value.replace("'", "''")))
    return "SELECT " + ", ".join(calls) if calls else None


def set_local_on_begin(engine: sa.Engine, options: str) -> None:
    """Apply `options` with `SET LOCAL` at the start of every transaction of `engine` (its
    connections carry no startup `options`: PgBouncer in transaction mode)."""
    statement = local_settings_sql(options)
    if statement is None:
        return

    @event.listens_for(engine, "begin")
    def _set_local(conn: sa.Connection) -> None:
        # SQLAlchemy's own recipe for statements at BEGIN: the DBAPI opens the transaction.
        conn.exec_driver_sql(statement)


def role_engine(url: URL, application_name: str, size: int, *,
                planner_options: str | None = None, pgbouncer: bool = False) -> sa.Engine:
    """A SQLAlchemy pool of `size` (plus 2 overflow) for one role of a worker, named
    `application_name` in pg_stat_activity, with `planner_options` as startup options (or,
    with `pgbouncer`, applied with `SET LOCAL` at every BEGIN; nothing prepared)."""
    # No pre-ping: it would cost a round trip per checkout. A dropped connection raises, is
    # invalidated by SQLAlchemy, and the operation is retried by its caller.
    connect_args: dict[str, object] = {"application_name": application_name[:63],
                                       "connect_timeout": 10}
    if pgbouncer:
        connect_args["prepare_threshold"] = None  # nothing prepared outlives a transaction
    elif planner_options:
        connect_args["options"] = planner_options
    engine = sa.create_engine(url, pool_size=size, max_overflow=2, pool_pre_ping=False,
                              connect_args=connect_args)
    leave_read_only_servers(engine)
    if pgbouncer and planner_options:
        set_local_on_begin(engine, planner_options)  # SET LOCAL at every BEGIN
    return engine


class DedicatedConnection:
    """One autocommit connection, used by one thread at a time, reopened after a failure.
    With `pgbouncer`, safe behind PgBouncer in transaction mode (see the module docstring)."""

    def __init__(self, url: URL, application_name: str, *, options: str = HOT_PATH_OPTIONS,
                 pgbouncer: bool = False) -> None:
        self.conninfo = to_conninfo(url)
        self.application_name = application_name[:63]
        self.options = options
        self.pgbouncer = pgbouncer
        # Behind PgBouncer: the settings, per transaction (None: nothing to set).
        self.set_local = local_settings_sql(options) if pgbouncer else None
        self._conn: psycopg.Connection[Any] | None = None
        self.statements = 0

    def _open(self) -> psycopg.Connection[Any]:
        if self.pgbouncer:
            self._conn = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=10,
                                         application_name=self.application_name,
                                         prepare_threshold=None)
        else:
            self._conn = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=10,
                                         application_name=self.application_name,
                                         options=self.options)
        return self._conn

    def execute(self, clause: sa.ClauseElement, params: Mapping[str, Any]) -> Rows:
        """Run one statement; its rows (empty when it returns none). A `flowq.db.runner.Runner`,
        so a `flowq.db.store.Store` sends through it."""
        if self.set_local is not None:
            return self.transaction([(clause, params)])
        conn = self._conn if self._conn is not None and not self._conn.closed else self._open()
        self.statements += 1
        try:
            return fetch_rows(conn, clause, params)
        except psycopg.Error as exc:
            if conn.closed or conn.broken or is_read_only(exc):
                self.close()  # a read-only server is left: reconnecting finds the primary
            raise

    def transaction(self, statements: Sequence[tuple[sa.ClauseElement, Mapping[str, Any]]]
                    ) -> Rows:
        """Run `statements` in one transaction, each in a snapshot of its own (READ
        COMMITTED); the rows of the last one."""
        conn = self._conn if self._conn is not None and not self._conn.closed else self._open()
        self.statements += len(statements)
        rows = Rows()
        try:
            if self.set_local is not None:
                return self._local_transaction(conn, self.set_local, statements)
            with conn.transaction():
                for clause, params in statements:
                    rows = fetch_rows(conn, clause, params)
            return rows
        except psycopg.Error as exc:
            # Pipelined, a failed statement makes the server skip the queued COMMIT: the
            # session is left in its failed transaction, so it goes (and PgBouncer gets its
            # server back rolled back) rather than be reused. A read-only server is left.
            if (conn.closed or conn.broken or conn.info.transaction_status != IDLE
                    or is_read_only(exc)):
                self.close()
            raise

    @staticmethod
    def _local_transaction(conn: psycopg.Connection[Any], set_local: str,
                           statements: Sequence[tuple[sa.ClauseElement, Mapping[str, Any]]]
                           ) -> Rows:
        """BEGIN, the settings, `statements`, COMMIT: pipelined, so one round trip."""
        cur = conn.cursor(row_factory=tuple_row)
        with contextlib.ExitStack() as stack:
            if _PIPELINE:
                stack.enter_context(conn.pipeline())
            stack.enter_context(conn.transaction())
            conn.execute(set_local, prepare=False)
            for clause, params in statements:
                cur = conn.cursor(row_factory=tuple_row)
                cur.execute(raw_sql(clause), params, prepare=False)
        return result_rows(cur)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()


class WorkerConnections:
    """Every connection of worker `name`, one per role, each named `flowq <role> <name>` in
    `application_name` (pg_stat_activity shows who is who), so that a dropped connection in
    one role never stalls another: the dedicated `claim`, `complete` and `heartbeat`
    connections of the hot path, and SQLAlchemy pools (`engines`) only where SQLAlchemy is
    needed: `session` (the handlers' ctx.session), `maintain` (maintenance, registry, schema
    checks) and, with `schedules`, `schedule`. `listen_url`: where to LISTEN instead of `url`
    (required behind PgBouncer, which cannot hold a LISTEN)."""

    def __init__(self, url: URL, name: str, *, concurrency: int, heartbeat_interval: float,
                 pgbouncer: bool = False, listen_url: URL | None = None,
                 schedules: bool = False) -> None:
        self.url = url
        self.name = name
        self.pgbouncer = pgbouncer
        self.listen_url = listen_url
        self.outage = Outage()  # shared by every part of the worker: one line per outage
        self.engines = {"maintain": self._engine("maintain", 2, MAINTENANCE_OPTIONS),
                        # Two per slot: a handler's ctx.session, and the session of a
                        # checkpoint it records while ctx.session is open (flowq.durable).
                        "session": self._engine("session", 2 * concurrency + 2)}
        if schedules:
            self.engines["schedule"] = self._engine("schedule", 1, MAINTENANCE_OPTIONS)
        self.claim = DedicatedConnection(url, f"flowq claim {name}", pgbouncer=pgbouncer)
        self.complete = DedicatedConnection(url, f"flowq complete {name}", pgbouncer=pgbouncer)
        self.heartbeat = DedicatedConnection(url, f"flowq heartbeat {name}",
                                             options=heartbeat_options(heartbeat_interval),
                                             pgbouncer=pgbouncer)

    def _engine(self, role: str, size: int, planner_options: str | None = None) -> sa.Engine:
        return role_engine(self.url, f"flowq {role} {self.name}", size,
                           planner_options=planner_options, pgbouncer=self.pgbouncer)

    def listen_conninfo(self) -> str | None:
        """Where to LISTEN (libpq conninfo): `listen_url`, else `url` unless behind PgBouncer
        (None: poll only)."""
        target = self.listen_url or (None if self.pgbouncer else self.url)
        if target is None:
            return None
        return to_conninfo(target)

    def metrics(self) -> DedicatedConnection | None:
        """The queue gauges' connection, which holds a session-level advisory lock: never
        through PgBouncer in transaction mode (the lock would stay with a server session
        other clients get); there, only on `listen_url`, else no queue gauges at all."""
        name = f"flowq metrics {self.name}"
        if not self.pgbouncer:
            return DedicatedConnection(self.url, name, options=MAINTENANCE_OPTIONS)
        if self.listen_url is not None:
            return DedicatedConnection(self.listen_url, name, options=MAINTENANCE_OPTIONS)
        return None

    def close(self) -> None:
        """Dispose of the pools and close the claim and completion connections (the heartbeat
        closes its own when it stops: it outlives the others' last statement)."""
        for engine in self.engines.values():
            engine.dispose()
        self.claim.close()
        self.complete.close()
