"""The helpers flowq ships for its users' tests (flowq.testing)."""

from __future__ import annotations

import itertools

import pytest
import sqlalchemy as sa

import flowq
from flowq.context import Context
from flowq.testing import assert_enqueued, job_rows, run_until_idle, wait_until


def test_wait_until_returns_the_first_truthy_value() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter) >= 3 and "done", timeout=5, interval=0.001) == "done"


def test_wait_until_fails_at_the_deadline_with_the_message() -> None:
    with pytest.raises(AssertionError, match=r"timed out after 0\.05s waiting for the moon"):
        wait_until(lambda: None, timeout=0.05, interval=0.01, message="the moon")


def test_job_rows_and_assert_enqueued(app: flowq.FlowQ, engine: sa.Engine) -> None:
    @app.task(queue="mail")
    def send(ctx: Context, to: str, n: int = 0) -> None:
        pass

    with engine.begin() as conn:
        a = flowq.enqueue(conn, send, to="a@x", n=1)
        flowq.enqueue(conn, send, to="b@x")
    rows = job_rows(engine)
    assert rows[0].run_id == a.id and len(rows) == 2
    assert [r.args["to"] for r in job_rows(engine, where="args->>'to' = :to", to="b@x")] == [
        "b@x"]
    assert assert_enqueued(engine, send, to="a@x").run_id == a.id
    assert assert_enqueued(engine, "send", n=1).args == {"to": "a@x", "n": 1}
    assert assert_enqueued(engine, send).queue == "mail"
    with pytest.raises(AssertionError, match="no pending job of 'send'"):
        assert_enqueued(engine, send, to="c@x")
    with pytest.raises(AssertionError):
        assert_enqueued(engine, "other")
    with pytest.raises(flowq.ConfigurationError):
        job_rows(engine, schema="bad; DROP")


def test_assert_enqueued_ignores_jobs_that_already_ran(app: flowq.FlowQ, engine: sa.Engine,
                                                      db_url: str) -> None:
    @app.task()
    def once(ctx: Context) -> None:
        pass

    with engine.begin() as conn:
        flowq.enqueue(conn, once)
    assert_enqueued(engine, once)
    run_until_idle(app, db_url)
    with pytest.raises(AssertionError):
        assert_enqueued(engine, once)


def test_run_until_idle_waits_for_retries_within_the_horizon(app: flowq.FlowQ,
                                                            engine: sa.Engine,
                                                            db_url: str) -> None:
    @app.task()
    def soon(ctx: Context) -> None:
        if ctx.attempt == 1:
            raise flowq.RetryStep(after=0.3)

    @app.task(queue="other")
    def elsewhere(ctx: Context) -> None:
        pass

    with engine.begin() as conn:
        flowq.enqueue(conn, soon)
        flowq.enqueue(conn, elsewhere)
    run_until_idle(app, db_url, queues=["default"])  # config reaches the worker
    assert {r.task: (r.status, r.attempts) for r in job_rows(engine)} == {
        "soon": ("succeeded", 2), "elsewhere": ("pending", 0)}


def test_run_until_idle_with_no_horizon_leaves_later_retries(app: flowq.FlowQ,
                                                            engine: sa.Engine,
                                                            db_url: str) -> None:
    @app.task()
    def soon(ctx: Context) -> None:
        raise flowq.RetryStep(after=2)

    with engine.begin() as conn:
        flowq.enqueue(conn, soon)
    run_until_idle(app, db_url, horizon=0)
    [row] = job_rows(engine)
    assert (row.status, row.attempts) == ("pending", 1)
