"""`flowq.testing.drain` where durable features meet: a step waiting for a child on another
queue, batch callbacks, suspensions counted apart from retries, and what drain says when it
gives up (issue 37)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import orm
from tenacity import stop_after_attempt

import flowq
from flowq.testing import DrainResult, all_enqueued, drain


def shop(app: flowq.FlowQ) -> None:
    """A parent on queue `fulfil` waiting for a child on `labels`: `fulfil` sorts first, so
    the parent's queue is tried first at every turn."""

    @app.task(queue="labels")
    def print_label(ctx: flowq.Context, order: int) -> dict[str, Any]:
        return {"label": f"L-{order}"}

    @app.task(queue="fulfil")
    def fulfil(ctx: flowq.Context, order: int) -> dict[str, Any]:
        label = ctx.wait(ctx.start_child(print_label, order=order))
        return {"order": order, **label}


def statuses(conn: sa.Connection) -> list[tuple[str, str]]:
    return [(r.task, r.status) for r in conn.execute(sa.text(
        "SELECT task, status FROM flowq.steps ORDER BY id"))]


def test_a_parent_waits_for_its_child_on_a_queue_that_sorts_after_its_own(
        app: flowq.FlowQ, engine: sa.Engine) -> None:
    shop(app)
    with engine.connect() as conn, conn.begin():
        run = flowq.enqueue(conn, app.get("fulfil"), order=3)
        # Once suspended, the parent is not claimed again before its child has ended.
        assert drain(conn, app, max_jobs=50) == DrainResult(succeeded=2, suspended=1)
        assert statuses(conn) == [("fulfil", "succeeded"), ("print_label", "succeeded")]
        assert flowq.runs.get_run(conn, run.id).result == {"order": 3, "label": "L-3"}


def test_the_queues_of_a_waited_on_child_are_drained_whatever_was_asked(
        app: flowq.FlowQ, engine: sa.Engine) -> None:
    shop(app)
    with engine.connect() as conn, conn.begin():
        run = flowq.enqueue(conn, app.get("fulfil"), order=4)
        assert drain(conn, app, queues=["fulfil"], runs=[run], max_jobs=50) == DrainResult(
            succeeded=2, suspended=1)
        assert statuses(conn) == [("fulfil", "succeeded"), ("print_label", "succeeded")]
    with engine.begin() as conn:  # an Engine: each job commits, the clock moves
        run = flowq.enqueue(conn, app.get("fulfil"), order=5)
    assert drain(engine, app, queues=["fulfil"], max_jobs=50) == DrainResult(
        succeeded=2, suspended=1)
    assert flowq.runs.get_run(engine, run.id).result == {"order": 5, "label": "L-5"}


def test_giving_up_names_the_jobs_that_kept_drain_busy_and_what_they_waited_on(
        app: flowq.FlowQ, engine: sa.Engine) -> None:
    @app.task(queue="labels", retry=flowq.Retry(stop=stop_after_attempt(10_000)))
    def print_label(ctx: flowq.Context) -> None:
        raise flowq.RetryStep(after=0, reason="printer jammed")

    @app.task(queue="fulfil")
    def fulfil(ctx: flowq.Context) -> None:
        ctx.wait(ctx.start_child(print_label))

    with engine.connect() as conn, conn.begin():
        parent = flowq.enqueue(conn, fulfil)
        with pytest.raises(AssertionError) as raised:
            drain(conn, app, max_jobs=20)
        [child] = conn.execute(sa.text("SELECT run_id FROM flowq.children")).scalars()
        [(parent_job, child_job)] = conn.execute(sa.text(
            "SELECT (SELECT id FROM flowq.jobs WHERE task = 'fulfil'), "
            "(SELECT id FROM flowq.jobs WHERE task = 'print_label')")).all()
    message = str(raised.value)
    assert message.startswith("drain ran 20 jobs (max_jobs) and jobs are still due")
    assert (f"job {child_job} (run {child}, task 'print_label', step 'print_label'): "
            f"19 attempts, the last retried: RetryStep: printer jammed") in message
    assert (f"job {parent_job} (run {parent.id}, task 'fulfil', step 'fulfil'): 1 attempt, "
            f"the last suspended: ctx.wait: 1 of 1 child runs unfinished "
            f"(waiting on run {child}: pending)") in message


def test_a_job_that_keeps_enqueueing_another_is_named_by_its_task(
        app: flowq.FlowQ, engine: sa.Engine) -> None:
    @app.task()
    def forever(ctx: flowq.Context) -> None:
        flowq.enqueue(ctx.session, forever)

    with engine.connect() as conn, conn.begin():
        flowq.enqueue(conn, forever)
        with pytest.raises(AssertionError, match=r"drain ran 5 jobs \(max_jobs\) and jobs are "
                           r"still due: 5 jobs of task 'forever', step 'forever' ran once each "
                           r"\(a job that keeps enqueueing another\?\)"):
            drain(conn, app, max_jobs=5)


def test_a_batch_callback_runs_inside_drain_in_the_tests_transaction(
        app: flowq.FlowQ, engine: sa.Engine) -> None:
    calls: list[dict[str, int]] = []

    @app.task(queue="packing", retry=flowq.Retry(stop=stop_after_attempt(1)))
    def pack(ctx: flowq.Context, n: int) -> None:
        if n == 2:
            raise RuntimeError("box 2 is torn")

    @app.task(queue="announce")
    def packed(ctx: flowq.Context, batch_id: int, succeeded: int, dead: int,
               cancelled: int) -> None:
        calls.append({"succeeded": succeeded, "dead": dead, "cancelled": cancelled})

    Session = orm.sessionmaker(engine, class_=flowq.Session)
    with Session() as session:
        with session.batch(on_complete=packed) as batch:
            for n in range(3):
                session.enqueue(pack, n=n)
        assert drain(session, app, raise_on_dead=False) == DrainResult(succeeded=3, dead=1)
        assert calls == [{"succeeded": 2, "dead": 1, "cancelled": 0}]
        fired = session.execute(sa.text("SELECT fired_at IS NOT NULL FROM flowq.batches "
                                        "WHERE id = :id"), {"id": batch.id}).scalar_one()
        assert fired
        session.rollback()
    with engine.connect() as conn:  # nothing was committed on another connection
        assert conn.execute(sa.text("SELECT count(*) FROM flowq.batches")).scalar() == 0


def test_batches_false_leaves_the_callback_to_the_reapers_pass(app: flowq.FlowQ,
                                                               engine: sa.Engine) -> None:
    @app.task()
    def work(ctx: flowq.Context) -> None:
        pass

    @app.task()
    def done(ctx: flowq.Context, batch_id: int, succeeded: int, dead: int,
             cancelled: int) -> None:
        pass

    Session = orm.sessionmaker(engine, class_=flowq.Session)
    with Session() as session:
        with session.batch(on_complete=done):
            session.enqueue(work)
        assert drain(session, app, batches=False) == DrainResult(succeeded=1)
        assert all_enqueued(session) == []
        session.rollback()


def test_suspensions_are_counted_apart_from_retries(app: flowq.FlowQ,
                                                    engine: sa.Engine) -> None:
    @app.task()
    def nap(ctx: flowq.Context) -> None:
        ctx.sleep(3600)
        ctx.sleep(60)

    snoozed: list[int] = []

    @app.task()
    def poll(ctx: flowq.Context) -> None:
        if len(snoozed) < 2:
            snoozed.append(ctx.attempt)
            raise flowq.Snooze(0, reason="not ready")

    @app.task(retry=flowq.Retry(stop=stop_after_attempt(3)))
    def flaky(ctx: flowq.Context) -> None:
        if ctx.attempt < 2:
            raise ValueError("once")

    with engine.connect() as conn, conn.begin():
        flowq.enqueue(conn, nap)
        flowq.enqueue(conn, poll)
        flowq.enqueue(conn, flaky)
        result = drain(conn, app)
        assert result == DrainResult(succeeded=3, retried=1, suspended=4)
        assert result.total == 8 and snoozed == [1, 1]  # a suspension spends no attempt
