"""The completer against a real PostgreSQL: outcomes it cannot write never hold up others."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import sqlalchemy as sa

from flowq.db import normalize_url
from flowq.db.rows import ClaimedJob
from flowq.db.runner import Rows, runner
from flowq.db.sql import Queries
from flowq.db.store import Store
from flowq.testing import job_rows, wait_until
from flowq.worker.completer import Completer
from flowq.worker.connection import HOT_PATH_OPTIONS, HOT_PATH_TIMEOUT, DedicatedConnection
from flowq.worker.model import Cancelled, Failed, Retried, Succeeded
from flowq.worker.writes import write_successes

Q = Queries("flowq")
APP_NAME = "test complete"


def claim(engine: sa.Engine, n: int) -> list[ClaimedJob]:
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO flowq.jobs (task, step) "
                             "SELECT 't', 't' FROM generate_series(1, :n)"), {"n": n})
        jobs = Store(runner(conn, direct=False)).claim("default", n, "w")
        return sorted(jobs, key=lambda j: j.id)


@pytest.fixture
def completer(db_url: str) -> Iterator[Completer]:
    c = Completer(DedicatedConnection(normalize_url(db_url), APP_NAME), "flowq")
    c.start()
    yield c
    c.stop(timeout=5.0)
    c.conn.close()


def rows(engine: sa.Engine) -> dict[int, Any]:
    return {r.id: r for r in job_rows(engine)}


def test_an_outcome_the_database_refuses_does_not_hold_up_the_batch(
        engine: sa.Engine, completer: Completer) -> None:
    """Values that reach the completer unsanitized (a bug, or a future outcome type) fail the
    batch; it is written item by item, and each item the database still refuses is recorded
    by the minimal fallback write (issue 9, #2)."""
    a, b, c, d, e = claim(engine, 5)
    for job, outcome in ((a, Failed("text with a \x00", None)),
                         (b, Succeeded('{"ok": 1}')),
                         (c, Retried(1e300, "far")),  # interval out of range
                         (d, Cancelled("cancelled \x00 too")),
                         (e, Failed("plain", 5.0))):
        completer.submit(job, outcome, 0.1)
    assert completer.flush(30.0), "the completer is stuck"
    got = rows(engine)
    assert (got[b.id].status, got[b.id].result) == ("succeeded", {"ok": 1})
    for bad in (a, c, d):
        assert got[bad.id].status == "dead"
        assert got[bad.id].last_error.startswith("outcome could not be recorded: ")
    assert (got[e.id].status, got[e.id].last_error) == ("pending", "plain")
    assert completer.pending_claims() == []


def test_a_lost_connection_keeps_the_outcomes_and_writes_them_once_back(
        engine: sa.Engine, completer: Completer) -> None:
    first, second = claim(engine, 2)
    completer.submit(first, Succeeded("{}"), 0.1)
    assert completer.flush(10.0)
    with engine.connect() as conn:
        assert conn.execute(sa.text(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = :a"), {"a": APP_NAME}).scalar() == 1
    completer.submit(second, Succeeded('{"n": 2}'), 0.1)
    wait_until(lambda: rows(engine)[second.id].status == "succeeded", timeout=30,
               message="the outcome to be written after the reconnect")
    assert rows(engine)[second.id].result == {"n": 2}


def test_a_stale_claims_outcome_is_dropped_not_written(engine: sa.Engine,
                                                       completer: Completer) -> None:
    [job] = claim(engine, 1)
    with engine.begin() as conn:  # reaped and claimed again: a new lease
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'pending'"))
        [again] = conn.execute(Q.claim_jobs, {"queue": "default", "limit": 1, "worker": "w2"})
    completer.submit(job, Succeeded('{"late": true}'), 0.1)
    assert completer.flush(10.0)
    row = rows(engine)[job.id]
    assert (row.status, row.result, row.lease) == ("running", None, again.lease)


def test_two_claims_of_one_step_in_a_batch_create_one_successor(
        engine: sa.Engine, db_url: str) -> None:
    """A worker can hold two claims of one step: an attempt the reaper took, and its own
    re-claim. Both successes may land in one batch; only the current claim completes, and
    only it creates the next step (found by tests/integration/test_lifecycle.py)."""
    import flowq
    from flowq.worker.model import Spawn

    app = flowq.FlowQ()
    chain = app.pipeline("chain")

    @chain.step()
    def one(ctx: Any) -> dict[str, int]:
        return {"n": 1}

    @chain.step()
    def two(ctx: Any, n: int) -> None: ...

    [old] = claim(engine, 1)
    with engine.begin() as conn:  # reaped, then claimed again by the same worker
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'pending'"))
        [new] = Store(runner(conn, direct=False)).claim("default", 1, "w")
    nxt = (Spawn(two, "chain", '{"n": 1}'),)
    batched = Completer(DedicatedConnection(normalize_url(db_url), APP_NAME), "flowq")
    # Submitted before its thread starts: both outcomes are in its first batch.
    batched.submit(old, Succeeded('{"n": 1}', nxt), 0.1)
    batched.submit(new, Succeeded('{"n": 1}', nxt), 0.1)
    batched.start()
    try:
        assert batched.flush(10.0)
    finally:
        batched.stop(timeout=5.0)
        batched.conn.close()
    steps = [(r.step, r.status) for r in job_rows(engine)]
    assert steps == [("t", "succeeded"), ("two", "pending")]


def test_completions_and_heartbeats_lock_rows_in_id_order() -> None:
    """Both statements lock the same rows (a beat covers the batch being written): sent in
    one order, they cannot deadlock each other."""
    from flowq.worker.heartbeat import Heartbeat

    sent: list[dict[str, Any]] = []

    def run(statement: Any, params: Mapping[str, Any], /) -> Rows:
        sent.append(dict(params))
        return Rows()

    jobs = [ClaimedJob(i, i, i, "t", "t", 0, "default", 0, 1, 3, "{}", False, 0.0)
            for i in (7, 3, 9, 1)]
    write_successes(Store(run), [(j, Succeeded("null")) for j in jobs])
    assert sent[-1]["ids"] == [1, 3, 7, 9]

    class Conn:
        def execute(self, statement: Any, params: dict[str, Any]) -> list[tuple[Any, ...]]:
            sent.append(params)
            return []

    Heartbeat(Conn(), "flowq",  # type: ignore[arg-type]
              lambda: [(7, 70), (3, 30), (9, 90)], worker="w").run_once()
    assert sent[-1] == {"worker": "w", "ids": [3, 7, 9], "leases": [30, 70, 90],
                        "progress": [None, None, None]}


def test_a_completion_cancelled_by_its_statement_timeout_is_sent_again(
        engine: sa.Engine, db_url: str) -> None:
    """The completion connection's `statement_timeout` (`HOT_PATH_TIMEOUT`, minutes; 1 s here)
    cancels a completion that runs away; the completer keeps the outcome and sends it again,
    rather than waiting on it forever (here: a row lock nobody releases, for a while)."""
    options = HOT_PATH_OPTIONS.replace(f"statement_timeout={HOT_PATH_TIMEOUT}",
                                       "statement_timeout=1s")
    assert options != HOT_PATH_OPTIONS
    c = Completer(DedicatedConnection(normalize_url(db_url), APP_NAME, options=options), "flowq")
    c.start()
    try:
        [job] = claim(engine, 1)
        with engine.connect() as holder, holder.begin():
            holder.execute(sa.text("SELECT 1 FROM flowq.jobs WHERE id = :i FOR UPDATE"),
                           {"i": job.id})
            c.submit(job, Succeeded('{"n": 1}'), 0.1)

            def waiting_since() -> Any:
                with engine.connect() as conn:  # a fresh snapshot of the view each time
                    return conn.execute(sa.text(
                        "SELECT query_start FROM pg_stat_activity WHERE application_name = :a "
                        "AND wait_event_type = 'Lock'"), {"a": APP_NAME}).scalar()

            wait_until(lambda: waiting_since() is not None, timeout=15,
                       message="the completion to wait for the row lock")
            first = waiting_since()
            wait_until(lambda: waiting_since() not in (None, first), timeout=15,
                       message="the completion to be cancelled and sent again")
        wait_until(lambda: rows(engine)[job.id].status == "succeeded", timeout=30,
                   message="the outcome to be written once the lock is gone")
        assert rows(engine)[job.id].result == {"n": 1}
    finally:
        c.stop(timeout=5.0)
        c.conn.close()
