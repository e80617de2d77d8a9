"""`doctor(engine)`: checks a flowq database and says, for each finding, what to do.

Each `Check` is OK, WARN or FAIL, with what it found and, unless OK, what to do:

- `schema`: the flowq schema's revision against the one this flowq needs.
- `table`: dead tuples on `flowq.jobs` (`pg_stat_user_tables`) and the last vacuum and
  analyze; the pending index's size against what its entries need (an estimate from the
  catalogue, no pgstattuple).
- `xmin`: transactions open longer than `long_transaction_s` that hold back the xmin horizon
  (`pg_stat_activity.backend_xmin`): while they last, vacuum cannot remove the versions jobs
  leave behind, and every claim steps over them. Other roles' sessions are visible only with
  pg_read_all_stats (pg_monitor) or as a superuser.
- `autovacuum`: autovacuum on, and the per-table settings of migration 0006 in place.
- `primary`: whether the server takes writes, or is a standby in recovery (fine for the
  dashboard and `flowq runs`; workers, enqueues and migrations need the primary).
- `listen`: a LISTEN/NOTIFY round trip on a fresh connection (not on a standby, which
  refuses LISTEN).
- `pooler`: PgBouncer (or another pooler) between here and PostgreSQL, detected by: the
  server's port (`inet_server_port()`) differing from the URL's, the URL's port being 6432
  (PgBouncer's default), or the backend pid changing between two transactions on one
  client connection (transaction pooling).
- `clock`: this machine's clock against the database's (`clock_timestamp()`).
- `deploy`: the deploy check (`flowq.ops.deploy`) of the runs in flight against the
  definitions the live workers registered: runs none of them can continue (a step removed,
  arguments that no longer bind, a join that gained a parent) WARN, with the command that
  names them (`flowq deploy-check MODULE:APP`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal

import psycopg
import sqlalchemy as sa

from flowq.db.checks import schema_exists
from flowq.db.migrations import HEAD_REVISION, current_revision, is_known_revision
from flowq.db.schema import JOBS_STORAGE_PARAMETERS, notify_channel
from flowq.db.store import Store
from flowq.db.store.admin import Backend, TableHealth
from flowq.names import DEFAULT_SCHEMA, validate_schema_name

__all__ = ["Check", "Level", "doctor"]

Level = Literal["OK", "WARN", "FAIL"]

LONG_TRANSACTION_S: Final = 60.0
_FAIL_TRANSACTION_S: Final = 600.0
_SKEW_WARN_S: Final = 1.0
_SKEW_FAIL_S: Final = 60.0
_LISTEN_TIMEOUT_S: Final = 5.0
# An entry of the pending index (queue, priority, run_at, id) takes about this many bytes.
_INDEX_ENTRY_BYTES: Final = 48
_PAGE: Final = 8192
_TUPLE_OVERHEAD: Final = 28  # a heap tuple's header (24, aligned) and its line pointer (4)
_BIG: Final = 64 * 1_048_576  # below this, bloat is not worth a finding
_PGBOUNCER_PORT: Final = 6432


@dataclass(frozen=True)
class Check:
    """One finding: its level, what was found, and what to do (empty when OK)."""

    name: str
    level: Level
    found: str
    action: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def doctor(engine: sa.Engine, *, schema: str = DEFAULT_SCHEMA,
           long_transaction_s: float = LONG_TRANSACTION_S) -> list[Check]:
    """Run every check against `engine`'s database (see the module's docstring). Connection
    failures raise; everything else is a Check."""
    validate_schema_name(schema)
    checks: list[Check] = []
    with engine.connect() as conn:
        store = Store.of(conn, schema)
        present = schema_exists(conn, schema)
        revision = current_revision(conn, schema) if present else None
        checks.append(_schema(schema, present, revision))
        health = store.table_health() if present else None
        if health is not None:
            checks.append(_table(health))
        checks.append(_xmin(store, long_transaction_s))
        backend = store.backend()
        if health is not None:
            checks.append(_autovacuum(schema, backend.autovacuum, health.reloptions))
        checks.append(_pooler(conn, store, backend, engine.url))
        checks.append(_clock(store))
        checks.append(_primary(bool(backend.in_recovery)))
        conn.rollback()
    if backend.in_recovery:
        checks.append(Check("listen", "WARN", "not checked: a standby refuses LISTEN",
                            "check the primary", {"round_trip_s": None}))
    else:
        checks.append(_listen(engine, schema))
    if revision == HEAD_REVISION:
        checks.append(_deploy(engine, schema))
    return checks


def _deploy(engine: sa.Engine, schema: str) -> Check:
    # Imported here: the deploy check is the one part of the doctor above the data layer.
    from flowq.ops.deploy import check_shapes, served_shapes

    code = served_shapes(engine, schema=schema)
    if not code:
        return Check("deploy", "OK", "no live worker registered its definitions: nothing "
                     "to compare the runs in flight with", "", {"stranded": []})
    report = check_shapes(engine, code, schema=schema)
    stranded = [{"pipeline": s.pipeline, "reason": s.reason, "runs": s.runs,
                 "example_run_id": s.example_run_id} for s in report.stranded]
    if report.ok:
        return Check("deploy", "OK", "the live workers' definitions can continue every run "
                     f"in flight ({len(code)} pipeline(s))", "", {"stranded": []})
    first = report.stranded[0]
    return Check("deploy", "WARN",
                 f"{sum(s.runs for s in report.stranded):,} run(s) in flight that no live "
                 f"worker's definition can continue, e.g. {first.pipeline}: {first.reason}",
                 "keep (or start) workers of the code those runs started on until they "
                 "finish, or add it back as a version; `flowq deploy-check MODULE:APP` "
                 "names them all", {"stranded": stranded})


def _primary(in_recovery: bool) -> Check:
    if not in_recovery:
        return Check("primary", "OK", "the server takes writes (not a standby)", "",
                     {"in_recovery": False})
    return Check("primary", "WARN", "this server is a standby in recovery (read-only): fine "
                 "for the dashboard and `flowq runs`, but workers, enqueues and "
                 "`flowq migrate` need the primary",
                 "point workers at the primary: list every host in the URL with "
                 "target_session_attrs=read-write (docs/operations.md, High availability)",
                 {"in_recovery": True})


def _migrate(schema: str) -> str:
    return "flowq migrate" + (f" --schema {schema}" if schema != DEFAULT_SCHEMA else "")


def _schema(schema: str, present: bool, revision: str | None) -> Check:
    details = {"revision": revision, "head": HEAD_REVISION}
    if not present:
        return Check("schema", "FAIL", f"no flowq schema {schema!r} in this database",
                     f"run `{_migrate(schema)}`", details)
    if revision == HEAD_REVISION:
        return Check("schema", "OK", f"revision {revision} (this flowq's head)", "", details)
    if revision is not None and not is_known_revision(revision):
        return Check("schema", "WARN", f"revision {revision[:64]!r}, newer than this flowq's "
                     f"{HEAD_REVISION} (workers of this version start, with a warning)",
                     "upgrade flowq here to the version that migrated it",
                     details)
    return Check("schema", "FAIL", f"revision {revision}, behind this flowq's {HEAD_REVISION}: "
                 "workers of this version refuse to start",
                 f"run `{_migrate(schema)}`", details)


def _mb(n: float) -> str:
    return f"{n / 1_048_576:,.1f} MB"


def _ago(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:,.0f}s ago"


def _table(r: TableHealth) -> Check:
    live, dead = int(r.n_live_tup or 0), int(r.n_dead_tup or 0)
    index_bytes = int(r.pending_index_bytes or 0)
    pending = int(r.pending or 0)
    needed = max(_PAGE * 2, pending * _INDEX_ENTRY_BYTES * 10 // 9)
    table_bytes = int(r.table_bytes or 0)
    # What the live rows need: their average width (as of the last analyze) plus a tuple
    # header and line pointer each, pages a tenth free; unknown before the first analyze.
    table_needed = (None if r.row_width is None
                    else max(_PAGE, int(live * (r.row_width + _TUPLE_OVERHEAD) * 10 / 9)))
    # Compared with the heap only: TOAST holds what does not fit in a row, outside avg_width.
    heap_bytes = int(r.heap_bytes or 0)
    table_bloat = None if table_needed is None else max(0, heap_bytes - table_needed)
    details = {"live_tuples": live, "dead_tuples": dead, "table_bytes": table_bytes,
               "table_bloat_bytes": table_bloat,
               "vacuum_age_s": r.vacuum_age_s, "analyze_age_s": r.analyze_age_s,
               "pending": pending, "pending_index_bytes": index_bytes,
               "pending_index_bloat_bytes": max(0, index_bytes - needed)}
    found = (f"{live:,} live and {dead:,} dead tuples ({_mb(table_bytes)}"
             + ("" if table_bloat is None else f", about {_mb(table_bloat)} of it free or dead")
             + f"), vacuumed "
             f"{_ago(r.vacuum_age_s)}, analyzed {_ago(r.analyze_age_s)}; pending index "
             f"{_mb(index_bytes)} for {pending:,} pending jobs")
    problems = []
    if dead > 1000 + live // 5:
        problems.append("dead tuples pile up: autovacuum is not keeping up, or something "
                        "holds the xmin horizon (see `xmin`); run `VACUUM (VERBOSE) "
                        "flowq.jobs` and check the autovacuum settings")
    if table_needed is not None and heap_bytes > _BIG and heap_bytes > 4 * table_needed:
        problems.append(f"the table is about {_mb(heap_bytes - table_needed)} larger than its "
                        "live rows need (left by a past backlog; new jobs reuse the space): "
                        "`VACUUM (FULL) flowq.jobs` or pg_repack shrinks it, under a lock")
    if index_bytes > _BIG and index_bytes > 10 * needed:
        problems.append(f"the pending index is about {_mb(index_bytes - needed)} larger than "
                        "its entries need (bloat from a past backlog or a held horizon): "
                        "`REINDEX INDEX CONCURRENTLY flowq.jobs_pending_idx` shrinks it")
    if problems:
        return Check("table", "WARN", found, "; ".join(problems), details)
    return Check("table", "OK", found, "", details)


def _xmin(store: Store, min_age: float) -> Check:
    rows = store.long_transactions(min_age)
    sessions = [{"pid": r.pid, "application_name": r.application_name, "user": r.usename,
                 "state": r.state, "age_s": r.age_s, "xmin_age": r.xmin_age,
                 "query": r.query} for r in rows]
    if not rows:
        return Check("xmin", "OK", f"no transaction open longer than {min_age:g}s holds the "
                     "xmin horizon", "", {"sessions": []})
    oldest = rows[0]
    found = (f"{len(rows)} transaction(s) open longer than {min_age:g}s hold the xmin "
             "horizon: " + "; ".join(
                 f"pid {r.pid} ({r.application_name or 'no application_name'}, {r.state}) "
                 f"open {r.age_s:,.0f}s" for r in rows))
    action = ("end them (commit in the application, or `SELECT pg_terminate_backend(pid)`): "
              "while they last, vacuum cannot remove the row versions jobs leave, and each "
              "claim steps over them; set idle_in_transaction_session_timeout to prevent it")
    level: Level = "FAIL" if oldest.age_s > _FAIL_TRANSACTION_S else "WARN"
    return Check("xmin", level, found, action, {"sessions": sessions})


def _autovacuum(schema: str, on: str, options: list[str] | None) -> Check:
    have = dict(o.split("=", 1) for o in options or [])
    details = {"autovacuum": on, "reloptions": have, "expected": dict(JOBS_STORAGE_PARAMETERS)}
    if on != "on" or have.get("autovacuum_enabled") == "false":
        return Check("autovacuum", "FAIL", "autovacuum is off for flowq.jobs",
                     "turn it on (autovacuum = on; ALTER TABLE ... RESET (autovacuum_enabled)): "
                     "without it the queue table bloats without bound", details)
    missing = {k: v for k, v in JOBS_STORAGE_PARAMETERS.items() if have.get(k) != v}
    if missing:
        settings = ", ".join(f"{k} = {v}" for k, v in missing.items())
        return Check("autovacuum", "WARN", "flowq.jobs lacks the per-table autovacuum settings "
                     "of a queue table: " + settings,
                     f"run `{_migrate(schema)}` (revision 0006 sets them), or "
                     f"`ALTER TABLE {schema}.jobs SET ({settings})`", details)
    return Check("autovacuum", "OK", "autovacuum on; flowq.jobs has the queue-table settings ("
                 + ", ".join(f"{k}={v}" for k, v in JOBS_STORAGE_PARAMETERS.items()) + ")",
                 "", details)


def _pooler(conn: sa.Connection, store: Store, backend: Backend, url: sa.URL) -> Check:
    signs = []
    server_port = backend.port
    url_port = url.port or 5432
    if server_port is not None and url.host and server_port != url_port:
        signs.append(f"the URL's port is {url_port} but the server's is {server_port}")
    if url.port == _PGBOUNCER_PORT:
        signs.append(f"the URL's port is {_PGBOUNCER_PORT}, PgBouncer's default")
    pids = {backend.pid}
    for _ in range(2):
        conn.commit()
        pids.add(store.backend().pid)
    if len(pids) > 1:
        signs.append("the backend changed between two transactions on one connection "
                     "(transaction pooling)")
    details = {"signs": signs, "server_port": server_port, "url_port": url_port}
    if not signs:
        return Check("pooler", "OK", "no pooler detected between here and PostgreSQL", "",
                     details)
    return Check("pooler", "WARN", "a pooler (PgBouncer?) is in between: " + "; ".join(signs),
                 "in transaction mode, run workers with --no-listen (LISTEN needs a direct "
                 "connection); see docs/operations.md", details)


def _clock(store: Store) -> Check:
    before = time.time()
    db = store.clock()
    after = time.time()
    skew = db - (before + after) / 2
    details = {"skew_s": skew, "uncertainty_s": (after - before) / 2}
    found = f"the database's clock is {abs(skew):.3f}s {'ahead of' if skew >= 0 else 'behind'} " \
            f"this machine's (±{(after - before) / 2:.3f}s)"
    if abs(skew) <= _SKEW_WARN_S:
        return Check("clock", "OK", found, "", details)
    return Check("clock", "FAIL" if abs(skew) > _SKEW_FAIL_S else "WARN", found,
                 "synchronise both clocks (NTP/chrony): flowq times jobs by the database's "
                 "clock, but a `run_at` given as a datetime is this machine's", details)


def _listen(engine: sa.Engine, schema: str) -> Check:
    channel = f"{notify_channel(schema)}_doctor_{uuid.uuid4().hex[:8]}"
    payload = uuid.uuid4().hex
    fresh = sa.create_engine(engine.url, poolclass=sa.pool.NullPool,
                             isolation_level="AUTOCOMMIT")
    try:
        with fresh.connect() as listener, fresh.connect() as sender:
            raw = listener.connection.driver_connection
            assert raw is not None
            raw.execute(f'LISTEN "{channel}"')
            started = time.monotonic()
            Store.of(sender, schema).send_probe(channel, payload)
            got = any(n.payload == payload
                      for n in raw.notifies(timeout=_LISTEN_TIMEOUT_S, stop_after=1))
            elapsed = time.monotonic() - started
    except (sa.exc.DBAPIError, psycopg.Error) as exc:
        reason = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
        return Check("listen", "FAIL", f"LISTEN failed: {str(reason).strip()}",
                     "run workers with --no-listen (they poll every --poll-interval)",
                     {"round_trip_s": None})
    finally:
        fresh.dispose()
    if not got:
        return Check("listen", "FAIL", f"a NOTIFY did not arrive within {_LISTEN_TIMEOUT_S:g}s "
                     "(a pooler in transaction mode?)",
                     "run workers with --no-listen (they poll every --poll-interval)",
                     {"round_trip_s": None})
    return Check("listen", "OK", f"LISTEN/NOTIFY round trip in {elapsed * 1000:.1f} ms", "",
                 {"round_trip_s": elapsed})
