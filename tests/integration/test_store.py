"""flowq.db.store, rows and runner against a real PostgreSQL: rows are read by column name, one
runner works on every connection kind, and each typed verb keeps the (id, lease) fence."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy import orm

from flowq.db import normalize_url
from flowq.db.rows import ClaimedJob, Completion, Spawned, Successor, read
from flowq.db.runner import Rows, runner, sqlalchemy_runner
from flowq.db.sql import queries
from flowq.db.sql.fragments import SPAWN, SUCCESSOR
from flowq.db.store import Store
from flowq.testing import job_rows

Q = queries("flowq")


def insert_jobs(engine: sa.Engine, n: int, *, queue: str = "default") -> list[int]:
    with engine.begin() as conn:
        rows = conn.execute(sa.text("""
            INSERT INTO flowq.jobs (task, step, queue) SELECT 't', 't', :queue
              FROM generate_series(1, :n) RETURNING id"""), {"n": n, "queue": queue})
        return sorted(r.id for r in rows)


@pytest.fixture
def raw(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    url = normalize_url(db_url).set(drivername="postgresql")
    with psycopg.connect(url.render_as_string(hide_password=False), autocommit=True) as conn:
        yield conn


@pytest.fixture
def store(raw: psycopg.Connection[Any]) -> Store:
    return Store(runner(raw))


# -- rows by name ---------------------------------------------------------------------------


def test_a_claimed_job_is_read_by_column_name_whatever_the_order() -> None:
    job = ClaimedJob(1, 2, 3, "t", "s", 0, "q", 5, 1, 3, "{}", False, 0.5, map_index=4,
                     trace_context='{"a": 1}')
    values = dataclasses.asdict(job)
    names = list(values)
    forward = Rows(names, [tuple(values[n] for n in names)])
    backward = Rows([*reversed(names), "pg_notify"], [(*(values[n] for n in reversed(names)),
                                                       None)])
    assert read(ClaimedJob, forward) == read(ClaimedJob, backward) == [job]


def test_a_missing_column_is_named() -> None:
    with pytest.raises(ValueError, match="lease"):
        read(ClaimedJob, Rows(["id"], [(1,)]))
    assert read(ClaimedJob, Rows(["id"])) == []  # no row: nothing to read


def test_the_row_columns_are_declared_once() -> None:
    """The successor columns a completion statement unnests are the dataclass' fields: a
    column renamed on one side only fails here, not as a shifted argument in production."""
    assert [f.name for f in dataclasses.fields(Successor)] == [n for n, _ in SUCCESSOR]
    assert [f.name for f in dataclasses.fields(Spawned)] == [n for n, _ in SPAWN]


def test_a_claim_read_in_another_column_order(engine: sa.Engine, store: Store) -> None:
    insert_jobs(engine, 1)
    (claimed,) = store.claim("default", 5, "w1")
    # The claim's columns, selected in reverse order from the claimed row.
    columns = [f.name for f in dataclasses.fields(ClaimedJob)][::-1]
    exprs = {"args": "args::text AS args", "trace_context": "trace_context::text AS trace_context",
             "age": "extract(epoch FROM now() - created_at)::float8 AS age",
             "pickup_delay": "0::float8 AS pickup_delay",
             "enqueued_at": "created_at AS enqueued_at", "claimed_at": "locked_at AS claimed_at"}
    text = sa.text(f"SELECT {', '.join(exprs.get(c, c) for c in columns)} FROM flowq.steps "
                   "WHERE id = :id")
    with engine.connect() as conn:
        (again,) = read(ClaimedJob, sqlalchemy_runner(conn)(text, {"id": claimed.id}))
    assert dataclasses.replace(again, age=claimed.age, pickup_delay=claimed.pickup_delay) == claimed


# -- one runner, every connection kind -----------------------------------------------------


def test_the_runner_works_on_every_connection_kind(engine: sa.Engine,
                                                   raw: psycopg.Connection[Any]) -> None:
    statement = sa.text("SELECT 1 AS one, 'x' AS two WHERE :go")
    with engine.connect() as conn:
        conn.begin()
        results = {
            "psycopg": runner(raw)(statement, {"go": True}),
            "sqlalchemy direct": runner(conn)(statement, {"go": True}),
            "sqlalchemy execute": runner(conn, direct=False)(statement, {"go": True}),
        }
    with orm.Session(engine) as session:
        results["session"] = runner(session)(statement, {"go": True})
    for kind, rows in results.items():
        assert (rows, rows.columns) == ([(1, "x")], ("one", "two")), kind
        assert rows.dicts() == [{"one": 1, "two": "x"}], kind
    with engine.connect() as conn:
        assert runner(conn)(sa.text("SELECT 1 AS one WHERE false"), {}).columns == ("one",)
        assert runner(conn)(sa.text("SET LOCAL work_mem = '8MB'"), {}) == []


def test_a_connection_outside_a_transaction_is_sent_to_through_sqlalchemy(
        engine: sa.Engine) -> None:
    """Sending on the DBAPI connection before SQLAlchemy began a transaction would open one
    behind its back (its commit would not end it): the runner goes through execute then."""
    insert_jobs(engine, 1)
    with engine.connect() as conn:
        assert not conn.in_transaction()
        Store(runner(conn)).claim("default", 1, "w1")
        assert conn.in_transaction()  # SQLAlchemy's autobegin: its commit ends it
        conn.commit()
    assert [r.status for r in job_rows(engine)] == ["running"]


# -- the verbs ------------------------------------------------------------------------------


def test_claim_heartbeat_and_complete_with_successors(engine: sa.Engine, store: Store) -> None:
    ids = insert_jobs(engine, 3)
    claimed = store.claim("default", 3, "w1")
    assert sorted(j.id for j in claimed) == ids
    assert all(j.lease > 0 and j.attempts == 1 for j in claimed)
    beats = store.heartbeat("w1", [j.claim for j in reversed(claimed)])
    assert sorted(b.id for b in beats) == ids and not any(b.cancel_requested for b in beats)

    first = claimed[0]
    nxt = Successor(id=first.id, lease=first.lease, task="t", step="next", step_index=1,
                    queue="default", max_attempts=3, args='{"a": 1}', map_index=None,
                    delay=0.0)
    stale = dataclasses.replace(nxt, lease=first.lease + 1000, step="never")
    done = store.complete([Completion(j.id, j.lease, '{"ok": true}') for j in claimed],
                          [nxt, stale])
    assert sorted(d.id for d in done) == ids
    rows = {r.step: r for r in job_rows(engine, where="step <> 't'")}
    assert list(rows) == ["next"]  # the successor naming a lease that did not land: none
    assert (rows["next"].run_id, rows["next"].args) == (first.run_id, {"a": 1})
    # Completing again: the claims are no longer running, nothing is written.
    assert store.complete([Completion(first.id, first.lease, "{}")]) == []


def test_a_workflow_successor_joins_and_waits(engine: sa.Engine, store: Store) -> None:
    insert_jobs(engine, 1)
    (job,) = store.claim("default", 1, "w1")
    waiting = Spawned(id=job.id, lease=job.lease, task="t", step="approve", step_index=1,
                      queue="default", max_attempts=3, args="{}", map_index=None, delay=0.0,
                      signal="approved", wait=60.0)
    (done,) = store.complete([Completion(job.id, job.lease, "{}")], [waiting])
    assert done.id == job.id
    (row,) = job_rows(engine, where="step = 'approve'")
    assert row.status == "waiting"


def test_retry_end_and_release_are_fenced(engine: sa.Engine, store: Store) -> None:
    insert_jobs(engine, 3)
    a, b, c = sorted(store.claim("default", 3, "w1"), key=lambda j: j.id)
    assert store.retry((a.id, a.lease + 1), 5.0, "late") is None  # not our lease
    retried = store.retry(a.claim, 5.0, "boom")
    assert retried is not None and retried.status == "pending"
    assert store.end((b.id, b.lease + 1), "dead", "late") is None
    assert store.end(b.claim, "dead", "gone") == "dead"
    assert store.release([c.claim, a.claim]) == [c.id]  # a is no longer running
    rows = {r.id: r for r in job_rows(engine)}
    assert (rows[a.id].status, rows[a.id].last_error) == ("pending", "boom")
    assert (rows[b.id].status, rows[b.id].last_error) == ("dead", "gone")
    assert (rows[c.id].status, rows[c.id].attempts) == ("pending", 0)


def test_claim_any_and_claim_limited(engine: sa.Engine, raw: psycopg.Connection[Any],
                                     store: Store) -> None:
    ids = insert_jobs(engine, 3, queue="slow")
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO flowq.queues (name, concurrency) VALUES ('slow', 1)"))
    assert store.controlled_queues(["slow", "default"]) == {"slow": False}
    assert store.claim("slow", 5, "w1") == []  # limited: only through claim_limited
    with raw.transaction():
        got = store.claim_limited("slow", 5, "w1")
    assert [j.id for j in got.jobs] == ids[:1] and got.held_back
    with raw.transaction():
        assert store.claim_limited("slow", 5, "w1").jobs == []
    (any_job,) = store.claim_any("slow", 1, "w2", run_ids=[got.jobs[0].run_id + 1])
    assert any_job.id == ids[1]


def test_reap(engine: sa.Engine, store: Store) -> None:
    insert_jobs(engine, 1)
    (job,) = store.claim("default", 1, "w1")
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.jobs SET heartbeat_at = now() - interval '1 hour'"))
    (reaped,) = store.reap(60, 10)
    assert (reaped.id, reaped.status, reaped.attempts) == (job.id, "pending", 1)


def test_a_dedicated_connection_is_a_runner(engine: sa.Engine, db_url: str) -> None:
    """The worker's hot-path connection sends the store's verbs, and a limited claim's two
    statements in one transaction (`claim_limited_statements`, then `read_limited`)."""
    from flowq.worker.connection import DedicatedConnection

    ids = insert_jobs(engine, 2, queue="slow")
    insert_jobs(engine, 1)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO flowq.queues (name, concurrency) VALUES ('slow', 1)"))
    conn = DedicatedConnection(normalize_url(db_url), "test store")
    try:
        store = Store(conn.execute)
        (job,) = store.claim("default", 5, "w1")
        assert [b.id for b in store.heartbeat("w1", [job.claim])] == [job.id]
        got = store.read_limited(conn.transaction(
            store.claim_limited_statements("slow", 5, "w1")))
        assert [j.id for j in got.jobs] == ids[:1] and got.held_back
    finally:
        conn.close()
