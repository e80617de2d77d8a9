"""flowq.Context and the StepSession behind ctx.session."""

from __future__ import annotations

import pickle

import pytest
import sqlalchemy as sa

import flowq
from flowq.durable.context import Context
from flowq.durable.session import StepSession, commit_step_session


def make_ctx(**over: object) -> Context:
    fields: dict[str, object] = dict(job_id=7, run_id=3, task="t", step="s", attempt=1,
                                     queue="default")
    fields.update(over)
    return Context(**fields)  # type: ignore[arg-type]


def test_context_is_exported() -> None:
    assert flowq.Context is Context


def test_idempotency_key_is_per_run_and_step_not_per_attempt() -> None:
    key = make_ctx().idempotency_key
    assert make_ctx(attempt=5, job_id=8).idempotency_key == key  # a retry, or a re-run
    assert make_ctx(run_id=4).idempotency_key != key
    assert make_ctx(step="other").idempotency_key != key
    assert "3" in key and "s" in key


def test_session_is_opened_lazily_and_once() -> None:
    made: list[StepSession] = []

    def factory() -> StepSession:
        made.append(StepSession())
        return made[-1]

    ctx = make_ctx(session_factory=factory)
    assert not ctx.session_used and made == []
    assert ctx.session is ctx.session
    assert ctx.session_used and len(made) == 1


def test_session_outside_a_worker_is_a_clear_error() -> None:
    with pytest.raises(flowq.FlowqError, match="not run by a worker"):
        make_ctx().session  # noqa: B018


def test_context_cannot_be_pickled() -> None:
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(make_ctx())


def test_repr_hides_the_session() -> None:
    assert "_session" not in repr(make_ctx())


def test_step_session_refuses_commit_but_flowq_can_commit(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE t (x int)"))
    s = StepSession(bind=engine)
    s.execute(sa.text("INSERT INTO t VALUES (1)"))
    with pytest.raises(flowq.FlowqError, match=r"do not call commit\(\)"):
        s.commit()
    commit_step_session(s)
    with pytest.raises(flowq.FlowqError):  # the permission does not outlive flowq's commit
        s.commit()
    s.close()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM t")).scalar() == 1


def test_step_session_can_enqueue(app: flowq.FlowQ, engine: sa.Engine) -> None:
    @app.task()
    def follow_up(ctx: Context, n: int) -> None:
        pass

    s = StepSession(bind=engine)
    s.enqueue(follow_up, n=1)
    commit_step_session(s)
    s.close()
    from flowq.testing import assert_enqueued

    assert_enqueued(engine, follow_up, n=1)


def test_enqueued_at_and_started_at_come_from_the_claimed_row(
        engine: sa.Engine, db_url: str, app: flowq.FlowQ) -> None:
    """Read by the claim itself (no query per job), on the database's clock, by the worker
    and by drain alike: `started_at - enqueued_at` is the pickup latency."""
    from datetime import timezone

    from flowq.testing import drain, job_rows, run_until_idle

    seen: dict[int, tuple[object, object]] = {}

    @app.task()
    def timed(ctx: Context, n: int) -> None:
        seen[n] = (ctx.enqueued_at, ctx.started_at)

    with engine.begin() as conn:
        first = flowq.enqueue(conn, timed, n=1)
        flowq.enqueue(conn, timed, n=2)
    drain(engine, app, runs=[first])
    run_until_idle(app, db_url)
    with engine.connect() as conn:
        db_now = conn.execute(sa.text("SELECT now()")).scalar_one()
    rows = {r.args["n"]: r for r in job_rows(engine)}
    assert sorted(seen) == [1, 2]
    for n, (enqueued_at, started_at) in seen.items():
        assert enqueued_at == rows[n].created_at
        assert enqueued_at.tzinfo is timezone.utc and started_at.tzinfo is timezone.utc
        assert rows[n].created_at <= started_at <= rows[n].finished_at <= db_now


def test_a_context_built_by_hand_has_times_too() -> None:
    ctx = make_ctx()
    assert ctx.enqueued_at.tzinfo is not None and ctx.started_at >= ctx.enqueued_at
