"""`flowq doctor` / `flowq.ops.doctor.doctor` against a real PostgreSQL: every check's OK, and the
findings it must report: a schema behind or missing, a long transaction on another connection,
dead tuples with autovacuum off, the queue-table settings missing, a proxy in between."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from support import cli

import flowq
from flowq.db.migrations import HEAD_REVISION, downgrade
from flowq.db.schema import JOBS_STORAGE_PARAMETERS
from flowq.ops.doctor import Check, doctor
from flowq.testing import wait_until

NAMES = ["schema", "table", "xmin", "autovacuum", "pooler", "clock", "primary", "listen",
         "deploy"]


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_a_fresh_database_is_all_ok(engine: sa.Engine, db_url: str) -> None:
    checks = doctor(engine)
    assert [c.name for c in checks] == NAMES
    assert {c.name: c.level for c in checks} == dict.fromkeys(NAMES, "OK")
    assert all(c.action == "" for c in checks)
    found = by_name(checks)
    assert found["schema"].details == {"revision": HEAD_REVISION, "head": HEAD_REVISION}
    assert found["autovacuum"].details["reloptions"] == JOBS_STORAGE_PARAMETERS
    assert found["listen"].details["round_trip_s"] < 5
    assert abs(found["clock"].details["skew_s"]) < 1
    result = cli("doctor", "--database-url", db_url)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split()[:2] for line in lines] == [["OK", n] for n in NAMES]


def test_json_keys_are_stable(db_url: str) -> None:
    result = cli("doctor", "--database-url", db_url, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert list(data) == ["checks"]
    assert [c["name"] for c in data["checks"]] == NAMES
    for c in data["checks"]:
        assert set(c) == {"name", "level", "found", "action", "details"}
    details = {c["name"]: set(c["details"]) for c in data["checks"]}
    assert details == {
        "schema": {"revision", "head"},
        "table": {"live_tuples", "dead_tuples", "table_bytes", "table_bloat_bytes",
                  "vacuum_age_s",
                  "analyze_age_s", "pending", "pending_index_bytes",
                  "pending_index_bloat_bytes"},
        "xmin": {"sessions"},
        "autovacuum": {"autovacuum", "reloptions", "expected"},
        "pooler": {"signs", "server_port", "url_port"},
        "clock": {"skew_s", "uncertainty_s"},
        "primary": {"in_recovery"},
        "listen": {"round_trip_s"},
        "deploy": {"stranded"},
    }


@contextlib.contextmanager
def held_transaction(db_url: str, name: str, sql: str,
                     isolation_level: str = "READ COMMITTED") -> Iterator[int]:
    """A transaction left open on another connection (application_name `name`); its pid."""
    eng = sa.create_engine(db_url, connect_args={"application_name": name},
                           isolation_level=isolation_level, poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as conn:
            pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
            conn.execute(sa.text(sql))
            yield pid
            conn.rollback()
    finally:
        eng.dispose()


def test_a_long_transaction_on_another_connection_is_reported(engine: sa.Engine,
                                                              db_url: str) -> None:
    with held_transaction(db_url, "report-builder", "SELECT count(*) FROM flowq.steps",
                          "REPEATABLE READ") as snapshot_pid, \
            held_transaction(db_url, "batch-writer", "SELECT txid_current()") as xid_pid:
        time.sleep(0.2)
        xmin = by_name(doctor(engine, long_transaction_s=0.1))["xmin"]
        assert xmin.level == "WARN"
        sessions = {s["pid"]: s for s in xmin.details["sessions"]}
        assert set(sessions) == {snapshot_pid, xid_pid}
        assert sessions[snapshot_pid]["application_name"] == "report-builder"
        assert sessions[snapshot_pid]["state"] == "idle in transaction"
        assert f"pid {snapshot_pid} (report-builder, idle in transaction)" in xmin.found
        assert "pg_terminate_backend" in xmin.action
        # Under the default threshold (60 s) they are too young to matter.
        assert by_name(doctor(engine))["xmin"].level == "OK"
        result = cli("doctor", "--database-url", db_url, "--long-transaction", "0.1")
        assert result.exit_code == 0, result.output  # a WARN is not a failure
        assert "WARN  xmin" in result.output and "report-builder" in result.output
    assert by_name(doctor(engine, long_transaction_s=0))["xmin"].level == "OK"


def test_a_schema_behind_is_reported(engine: sa.Engine, db_url: str) -> None:
    downgrade(engine, revision="0005")
    found = by_name(doctor(engine))
    schema = found["schema"]
    assert schema.level == "FAIL"
    assert "revision 0005, behind this flowq's" in schema.found
    assert schema.action == "run `flowq migrate`"
    # 0005 has no queue-table autovacuum settings.
    assert found["autovacuum"].level == "WARN"
    assert "flowq migrate" in found["autovacuum"].action
    assert "ALTER TABLE flowq.jobs SET (autovacuum_vacuum_scale_factor = 0.01" in \
        found["autovacuum"].action
    result = cli("doctor", "--database-url", db_url)
    assert result.exit_code == 1, result.output
    assert "FAIL  schema" in result.output and "-> run `flowq migrate`" in result.output
    flowq.migrate(engine)
    assert {c.level for c in doctor(engine)} == {"OK"}


def test_a_schema_newer_than_this_flowq_is_a_warning(engine: sa.Engine) -> None:
    """A revision this flowq does not ship is a newer flowq's, whatever it sorts like."""
    for newer in ("9998", "00010", "abc123"):
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE flowq.alembic_version SET version_num = :r"),
                         {"r": newer})
        schema = by_name(doctor(engine))["schema"]
        assert schema.level == "WARN", newer
        assert schema.found.startswith(f"revision {newer!r}, newer than this flowq's")


def test_a_database_without_the_schema(empty_db_url: str) -> None:
    result = cli("doctor", "--database-url", empty_db_url, "--json")
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.output)["checks"]}
    assert checks["schema"]["level"] == "FAIL"
    assert "no flowq schema 'flowq'" in checks["schema"]["found"]
    assert set(checks) == {"schema", "xmin", "pooler", "clock", "primary", "listen"}
    assert checks["listen"]["level"] == "OK"


def test_an_unreachable_database_is_one_sentence() -> None:
    result = cli("doctor", "--database-url", "postgresql://nobody@127.0.0.1:1/nothing")
    assert result.exit_code == 2, result.output
    text = result.stderr.strip()
    assert text.startswith("Error: ") and "\n" not in text and "Traceback" not in result.output


def test_dead_tuples_with_autovacuum_off(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE flowq.jobs SET (autovacuum_enabled = false)"))
        flowq.enqueue_many(conn, "t", [{} for _ in range(3000)], queue="q")
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM flowq.jobs"))

    def table() -> Check | None:
        check = by_name(doctor(engine))["table"]
        return check if check.level == "WARN" else None

    found = wait_until(table, timeout=20, message="the statistics show the dead tuples")
    assert found.details["dead_tuples"] >= 3000
    assert "VACUUM" in found.action
    assert by_name(doctor(engine))["autovacuum"].level == "FAIL"
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE flowq.jobs RESET (autovacuum_enabled)"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM flowq.jobs"))
    wait_until(lambda: by_name(doctor(engine))["table"].level == "OK", timeout=20)


def _forward(listener: socket.socket, target: tuple[str, int], stop: threading.Event) -> None:
    """A TCP proxy: each accepted connection is relayed to `target` until either side closes."""
    pairs: list[tuple[socket.socket, socket.socket]] = []
    listener.settimeout(0.1)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError, OSError):
            client, _ = listener.accept()
            upstream = socket.create_connection(target)
            pairs.append((client, upstream))
            threading.Thread(target=_relay, args=(client, upstream, stop), daemon=True).start()
    for a, b in pairs:
        a.close()
        b.close()


def _relay(a: socket.socket, b: socket.socket, stop: threading.Event) -> None:
    with contextlib.suppress(OSError):
        while not stop.is_set():
            ready, _, _ = select.select([a, b], [], [], 0.1)
            for s in ready:
                data = s.recv(65536)
                if not data:
                    return
                (b if s is a else a).sendall(data)


def test_a_proxy_in_between_is_detected(db_url: str) -> None:
    url = make_url(db_url)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()
    thread = threading.Thread(target=_forward, args=(listener, (url.host, url.port), stop),
                              daemon=True)
    thread.start()
    proxied = sa.create_engine(url.set(port=port))
    try:
        pooler = by_name(doctor(proxied))["pooler"]
    finally:
        proxied.dispose()
        stop.set()
        thread.join(5)
        listener.close()
    assert pooler.level == "WARN"
    assert f"the URL's port is {port} but the server's is {url.port}" in pooler.found
    assert "--no-listen" in pooler.action


def test_details_are_plain_json(engine: sa.Engine) -> None:
    data: Any = [c.to_dict() for c in doctor(engine)]
    assert json.loads(json.dumps(data)) == data
