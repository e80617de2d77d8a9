"""The hot table and its history (revision 0018): `flowq.jobs` holds live rows only; a row
that ends moves to `flowq.job_history` in the transaction that ends it, whoever writes the
end; idempotency keys outlive the row that carried them; the previous release's workers keep
their layout while they are registered; an existing database migrates with its data."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa
from tenacity import stop_after_attempt

import flowq
from flowq.db.migrations import downgrade, migrate
from flowq.db.schema import JOB_COLUMNS
from flowq.ops.runs import get_run, retry_run
from flowq.testing import drain


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def where(engine: sa.Engine, job_id: int) -> tuple[int, int]:
    """How many rows of job `job_id` are in (jobs, job_history)."""
    return (scalar(engine, "SELECT count(*) FROM flowq.jobs WHERE id = :i", i=job_id),
            scalar(engine, "SELECT count(*) FROM flowq.job_history WHERE id = :i", i=job_id))


def first_job(engine: sa.Engine, run_id: int) -> int:
    return int(scalar(engine, "SELECT min(id) FROM flowq.steps WHERE run_id = :r", r=run_id))


@pytest.fixture
def hist_app() -> flowq.FlowQ:
    app = flowq.FlowQ()

    @app.task(name="ok")
    def ok(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"n": n}

    @app.task(name="boom", retry=flowq.Retry(stop=stop_after_attempt(1)))
    def boom(ctx: flowq.Context) -> None:
        raise RuntimeError("boom")

    pipe = app.pipeline("two")

    @pipe.step()
    def a(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"m": n + 1}

    @pipe.step()
    def b(ctx: flowq.Context, m: int) -> int:
        return m * 2

    return app


def test_every_end_moves_its_row_and_live_rows_stay(engine: sa.Engine,
                                                    hist_app: flowq.FlowQ) -> None:
    with engine.begin() as conn:
        ok = flowq.enqueue(conn, "ok", n=1)
        bad = flowq.enqueue(conn, "boom")
        later = flowq.enqueue(conn, "ok", n=2, delay=3600)
        two = flowq.enqueue(conn, "two", n=3)
        doomed = flowq.enqueue(conn, "ok", n=4, delay=3600)
    drain(engine, hist_app, raise_on_dead=False)
    assert where(engine, first_job(engine, ok.id)) == (0, 1)      # a success: the fast path
    assert where(engine, first_job(engine, bad.id)) == (0, 1)     # dead: the trigger
    assert where(engine, first_job(engine, later.id)) == (1, 0)   # pending: live
    assert scalar(engine, "SELECT count(*) FROM flowq.job_history WHERE run_id = :r",
                  r=two.id) == 2                                   # both steps of a pipeline
    assert get_run(engine, two.id).status == "succeeded"
    assert get_run(engine, two.id).steps[-1].result == 8
    with engine.begin() as conn:  # an operator's UPDATE by hand moves it too
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'cancelled', finished_at = now() "
                             "WHERE run_id = :r"), {"r": doomed.id})
    assert where(engine, first_job(engine, doomed.id)) == (0, 1)
    assert scalar(engine, "SELECT count(*) FROM flowq.jobs WHERE status IN "
                          "('succeeded', 'dead', 'cancelled')") == 0
    row = get_run(engine, ok.id).steps[0]
    assert (row.status, row.result, row.locked_by) == ("succeeded", {"n": 1}, None)
    assert row.finished_at is not None and row.started_at is not None


def test_a_key_outlives_its_first_row(engine: sa.Engine, hist_app: flowq.FlowQ) -> None:
    with engine.begin() as conn:
        first = flowq.enqueue(conn, "ok", n=1, idempotency_key="order-7")
    drain(engine, hist_app, raise_on_dead=False)
    assert where(engine, first_job(engine, first.id)) == (0, 1)
    with engine.begin() as conn:
        again = flowq.enqueue(conn, "ok", n=2, idempotency_key="order-7")
    assert (again.id, again.created) == (first.id, False)
    assert scalar(engine, "SELECT count(*) FROM flowq.steps WHERE task = 'ok'") == 1
    with engine.begin() as conn:  # a workflow's multi-root enqueue meets the same key
        again = flowq.enqueue(conn, "two", n=2, idempotency_key="order-7")
    assert (again.id, again.created) == (first.id, False)


def test_two_enqueues_of_one_key_meet_on_its_entry(engine: sa.Engine,
                                                   hist_app: flowq.FlowQ) -> None:
    results: list[flowq.Enqueued] = []
    with engine.connect() as holder:
        holder.begin()
        mine = flowq.enqueue(holder, "ok", n=1, idempotency_key="k")

        def other() -> None:
            with engine.begin() as conn:
                results.append(flowq.enqueue(conn, "ok", n=2, idempotency_key="k"))

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive()  # waiting for the holder's entry in run_keys
        holder.commit()
        thread.join(30)
    assert [(r.id, r.created) for r in results] == [(mine.id, False)]
    assert scalar(engine, "SELECT count(*) FROM flowq.steps") == 1


def test_a_retried_dead_run_comes_back_to_jobs(engine: sa.Engine,
                                                hist_app: flowq.FlowQ) -> None:
    with engine.begin() as conn:
        bad = flowq.enqueue(conn, "boom")
    drain(engine, hist_app, raise_on_dead=False)
    job = first_job(engine, bad.id)
    assert get_run(engine, bad.id).status == "dead"
    assert retry_run(engine, bad.id).job_ids == (job,)
    assert where(engine, job) == (1, 0)
    assert get_run(engine, bad.id).status == "pending"
    drain(engine, hist_app, raise_on_dead=False)  # dies again, and moves again
    assert where(engine, job) == (0, 1)
    (row,) = get_run(engine, bad.id).steps
    assert (row.status, row.attempts) == ("dead", 1)


def test_while_a_previous_release_worker_is_registered_rows_stay(
        engine: sa.Engine, hist_app: flowq.FlowQ) -> None:
    """A worker without the `job_history` capability reads finished rows from `jobs` only
    (a join's mapped results, a child's end): until it is gone nothing moves."""
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO flowq.workers (name, host, pid, queues, tasks, concurrency, version) "
            "VALUES ('old', 'h', 1, '{default}', '{ok}', 1, '0.9')"))  # capabilities NULL
        ok = flowq.enqueue(conn, "ok", n=1)
        bad = flowq.enqueue(conn, "boom")
    drain(engine, hist_app, raise_on_dead=False)
    assert where(engine, first_job(engine, ok.id)) == (1, 0)
    assert where(engine, first_job(engine, bad.id)) == (1, 0)
    assert get_run(engine, ok.id).status == "succeeded"
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM flowq.workers WHERE name = 'old'"))
        later = flowq.enqueue(conn, "ok", n=2)
    drain(engine, hist_app, raise_on_dead=False)
    assert where(engine, first_job(engine, later.id)) == (0, 1)


def test_an_existing_database_migrates_with_its_data(engine: sa.Engine,
                                                   hist_app: flowq.FlowQ) -> None:
    """From revision 0017 with finished, live and keyed rows: nothing is lost, keys hold,
    the finished rows stay readable (in `jobs` until the maintenance pass moves them)."""
    downgrade(engine, revision="0017")
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO flowq.jobs (task, step, status, result, finished_at, "
            "idempotency_key) VALUES ('ok', 'ok', 'succeeded', '{\"n\": 1}', now(), 'k1'), "
            "('ok', 'ok', 'pending', NULL, NULL, 'k2'), ('ok', 'ok', 'dead', NULL, now(), NULL)"))
        before = conn.execute(sa.text("SELECT id, run_id, status FROM flowq.jobs ORDER BY id")
                              ).all()
    migrate(engine)
    with engine.connect() as conn:
        after = conn.execute(sa.text("SELECT id, run_id, status FROM flowq.steps ORDER BY id")
                             ).all()
        keys = conn.execute(sa.text("SELECT key, run_id FROM flowq.run_keys ORDER BY key")
                            ).all()
    assert after == before
    assert keys == [("k1", before[0].run_id), ("k2", before[1].run_id)]
    with engine.begin() as conn:
        for key, row in (("k1", before[0]), ("k2", before[1])):
            again = flowq.enqueue(conn, "ok", n=9, idempotency_key=key)
            assert (again.id, again.created) == (row.run_id, False)
    downgrade(engine, revision="0017")  # and back: the finished rows return to jobs
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id, run_id, status FROM flowq.jobs ORDER BY id")
                            ).all() == before
    migrate(engine)


def test_steps_has_the_columns_of_jobs(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        names = conn.execute(sa.text(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = 'flowq' "
            "AND table_name = :t ORDER BY ordinal_position"), {"t": "steps"}).scalars().all()
    assert names == [*JOB_COLUMNS.split(", "), "retired_at"]
