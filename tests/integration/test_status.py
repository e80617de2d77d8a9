"""`flowq status` / `flowq.ops.status.status` against a real PostgreSQL: counts per queue, limits and
pauses, throughput, live workers, dead jobs by task, unserved jobs, stable JSON keys, index
use with retained rows, and the timing at a million retained rows (printed, never asserted)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
import sqlalchemy as sa
from support import cli
from support import enqueue_id as enqueue

import flowq
from flowq.db.sql import queries
from flowq.ops.status import status
from flowq.testing import running_worker, wait_until

# `enqueue` by task names no other test defines: an enqueue by name checks the arguments
# against a live definition of that name, and another module's app may still be alive.

QUEUE_KEYS = {"name", "pending", "scheduled", "waiting", "running", "dead", "oldest_due_s",
              "succeeded_last_minute", "succeeded_last_hour", "dead_last_hour",
              "concurrency", "rate_limit", "rate_period_s", "paused"}
WORKER_KEYS = {"name", "host", "pid", "queues", "concurrency", "version", "started_at",
               "heartbeat_age_s"}


def execute(engine: sa.Engine, sql: str, **params: Any) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(sql), params)


def fill_finished(engine: sa.Engine, n: int) -> None:
    """`n` finished rows (1% dead, 1% cancelled), one every 0.6 s back from now, 5 queues."""
    execute(engine, """
        INSERT INTO flowq.jobs (task, step, queue, status, attempts, run_at, created_at,
                                finished_at, result)
        SELECT 'task_' || (g % 20), 'task_' || (g % 20), 'q' || (g % 5),
               CASE WHEN g % 100 = 0 THEN 'dead' WHEN g % 97 = 0 THEN 'cancelled'
                    ELSE 'succeeded' END,
               1, now() - make_interval(secs => g * 0.6), now() - make_interval(secs => g * 0.6),
               now() - make_interval(secs => g * 0.6 - 0.1), '{"ok": true}'
          FROM generate_series(1, :n) g""", n=n)
    execute(engine, """
        INSERT INTO flowq.jobs (task, step, queue, status, run_at)
        SELECT 'task_' || (g % 20), 'task_' || (g % 20), 'q' || (g % 5), 'pending',
               now() + make_interval(secs => (g % 3 - 1) * 60)
          FROM generate_series(1, 1000) g""")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE flowq.jobs"))


def test_status_per_queue(engine: sa.Engine) -> None:
    enqueue(engine, "st_a", queue="mail")
    enqueue(engine, "st_a", queue="mail")
    enqueue(engine, "st_a", queue="mail", delay=3600)
    running = enqueue(engine, "st_b", queue="mail")
    dead = enqueue(engine, "st_b", queue="mail")
    ok_now = enqueue(engine, "st_a", queue="mail")
    ok_earlier = enqueue(engine, "st_a", queue="mail")
    ok_long_ago = enqueue(engine, "st_a", queue="other")
    execute(engine, "UPDATE flowq.jobs SET run_at = now() - interval '90 seconds' "
            "WHERE status = 'pending' AND run_at <= now()")
    execute(engine, "UPDATE flowq.jobs SET status = 'running', heartbeat_at = now() "
            "WHERE id = :i", i=running)
    execute(engine, "UPDATE flowq.jobs SET status = 'dead', finished_at = now() WHERE id = :i",
            i=dead)
    for job, ago in ((ok_now, "1 second"), (ok_earlier, "30 minutes"), (ok_long_ago, "2 hours")):
        execute(engine, "UPDATE flowq.jobs SET status = 'succeeded', finished_at = now() - "
                "CAST(:ago AS interval) WHERE id = :i", i=job, ago=ago)
    execute(engine, "INSERT INTO flowq.queues (name, concurrency, rate_limit, rate_period, "
            "paused) VALUES ('limited', 3, 10, 60, true)")

    st = status(engine)
    by_name = {q.name: q for q in st.queues}
    assert sorted(by_name) == ["limited", "mail"]  # 'other' only has an old completion
    mail = by_name["mail"]
    assert (mail.pending, mail.scheduled, mail.waiting, mail.running, mail.dead) == (2, 1, 0, 1, 1)
    assert mail.oldest_due_s is not None and 89 < mail.oldest_due_s < 200
    assert (mail.succeeded_last_minute, mail.succeeded_last_hour, mail.dead_last_hour) == (1, 2, 1)
    assert (mail.concurrency, mail.paused) == (None, False)
    limited = by_name["limited"]
    assert (limited.pending, limited.concurrency, limited.rate_limit, limited.rate_period_s,
            limited.paused) == (0, 3, 10, 60.0, True)
    assert [(d.task, d.jobs) for d in st.dead_by_task] == [("st_b", 1)]
    # No worker runs: the due jobs are unserved.
    assert {(u.queue, u.task, u.jobs) for u in st.unserved} == {("mail", "st_a", 2)}


def test_status_through_a_connection_and_another_schema(engine: sa.Engine) -> None:
    flowq.migrate(engine, schema="flowq_other")
    with engine.begin() as conn:
        flowq.enqueue(conn, "t", queue="q", schema="flowq_other")
    with engine.connect() as conn:
        st = status(conn, schema="flowq_other")
    assert [(q.name, q.pending) for q in st.queues] == [("q", 1)]
    assert status(engine).queues == []


def test_workers_are_listed_while_a_worker_runs(engine: sa.Engine, db_url: str) -> None:
    app = flowq.FlowQ()

    @app.task(queue="reports")
    def report(ctx: object) -> None: ...

    with running_worker(app, db_url, concurrency=3, name="status-test-w1"):
        [w] = wait_until(lambda: status(engine).workers, message="the worker registered")
        assert (w.name, w.pid, w.queues, w.concurrency, w.version) == (
            "status-test-w1", os.getpid(), ["reports"], 3, flowq.__version__)
        assert 0 <= w.heartbeat_age_s < 60
        result = cli("status", "--database-url", db_url)
        assert result.exit_code == 0, result.output
        assert "workers (1 live):" in result.output and "status-test-w1" in result.output
        # A job of a task the worker does not serve is reported as unserved.
        enqueue(engine, "unknown_task", queue="reports")
        unserved = wait_until(lambda: status(engine).unserved)
        assert [(u.queue, u.task) for u in unserved] == [("reports", "unknown_task")]
    assert status(engine).workers == []  # a clean stop leaves the registry


def test_json_keys_are_stable(engine: sa.Engine, db_url: str) -> None:
    enqueue(engine, "st_a", queue="q")
    execute(engine, "INSERT INTO flowq.workers (name, host, pid, queues, tasks, concurrency, "
            "version) VALUES ('w', 'h', 1, '{q}', '{b}', 2, '0.1.0')")
    execute(engine, "UPDATE flowq.jobs SET status = 'dead', finished_at = now()")
    enqueue(engine, "st_c", queue="q")
    result = cli("status", "--database-url", db_url, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert set(data) == {"at", "queues", "workers", "dead_by_task", "unserved", "handed_over"}
    [q] = data["queues"]
    assert set(q) == QUEUE_KEYS
    assert (q["name"], q["pending"], q["dead"], q["dead_last_hour"]) == ("q", 1, 1, 1)
    [w] = data["workers"]
    assert set(w) == WORKER_KEYS
    assert (w["name"], w["queues"], w["concurrency"]) == ("w", ["q"], 2)
    assert data["dead_by_task"] == [{"task": "st_a", "jobs": 1}]
    [u] = data["unserved"]
    assert set(u) == {"queue", "task", "jobs", "oldest_due_s"}
    assert (u["queue"], u["task"], u["jobs"]) == ("q", "st_c", 1)


def test_text_output(engine: sa.Engine, db_url: str) -> None:
    result = cli("status", "--database-url", db_url)
    assert result.exit_code == 0, result.output
    assert "queues (0):" in result.output
    assert "due jobs no live worker serves: none." in result.output
    enqueue(engine, "st_a", queue="q")
    result = cli("status", "--database-url", db_url)
    assert "q " in result.output and "due jobs no live worker serves:\n" in result.output


def test_status_without_the_schema_is_one_sentence(empty_db_url: str) -> None:
    result = cli("status", "--database-url", empty_db_url)
    assert result.exit_code == 2, result.output
    text = result.stderr.strip()
    assert text.startswith("Error: ") and "\n" not in text and "Traceback" not in result.output
    assert "no flowq schema 'flowq'" in text and "flowq migrate" in text


def _plan(conn: sa.Connection, stmt: sa.TextClause, **params: Any) -> str:
    return "\n".join(r[0] for r in conn.execute(sa.text("EXPLAIN " + stmt.text), params))


def test_every_status_statement_uses_an_index(engine: sa.Engine) -> None:
    """With retained finished rows, no statement of `status` reads the whole jobs table."""
    fill_finished(engine, 100_000)
    q = queries("flowq")
    with engine.connect() as conn:
        plans = {
            "list_queues": _plan(conn, q.list_queues),
            "select_completions": _plan(conn, q.select_completions),
            "select_dead_by_task": _plan(conn, q.select_dead_by_task, limit=20),
            "select_unserved_jobs": _plan(conn, q.select_unserved_jobs, stale=60, limit=20),
        }
    for name, plan in plans.items():
        assert "Seq Scan on jobs" not in plan, (name, plan)
    assert "jobs_finished_idx" in plans["select_completions"]
    assert "jobs_dead_idx" in plans["select_dead_by_task"]
    assert "jobs_dead_idx" in plans["list_queues"] and "jobs_pending_idx" in plans["list_queues"]


@pytest.mark.slow
def test_status_time_with_a_million_retained_rows(engine: sa.Engine, db_url: str) -> None:
    """The figure in docs/operations.md: printed (run with -s), never asserted."""
    started = time.perf_counter()
    fill_finished(engine, 1_000_000)
    filled = time.perf_counter() - started
    status(engine)  # warm the connection pool and the statement cache
    times = []
    for _ in range(5):
        started = time.perf_counter()
        st = status(engine)
        times.append(time.perf_counter() - started)
    assert sum(q.dead for q in st.queues) == 10_000
    started = time.perf_counter()
    result = cli("status", "--database-url", db_url)
    command = time.perf_counter() - started
    assert result.exit_code == 0, result.output
    print(f"\n1,000,000 retained rows (filled in {filled:.1f}s): status() best "
          f"{min(times) * 1000:.1f} ms, median {sorted(times)[2] * 1000:.1f} ms; "
          f"`flowq status` in-process (engine, connect, read, print) {command * 1000:.1f} ms")
