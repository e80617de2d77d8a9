"""Run deadlines: stored at enqueue (or from the definition's default), copied to the steps a
run creates, fired by the reaper's pass (driven here with `run_once()`, never by sleeping)
as a run cancel; and every hostile deadline refused with one sentence."""

from __future__ import annotations

import json
import math
import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from runs_cli import cli, cli_json

import flowq
from flowq.db.sql import Queries
from flowq.ops.runs import get_run
from flowq.testing import drain, job_rows, running_worker, wait_until
from flowq.worker.reaper import Reaper

Q = Queries("flowq")
HOUR = timedelta(hours=1)


def make_app() -> flowq.FlowQ:
    app = flowq.FlowQ()

    @app.task(deadline=HOUR)
    def bounded(ctx: flowq.Context, n: int) -> None: ...

    @app.task()
    def plain(ctx: flowq.Context, n: int) -> None: ...

    chain = app.pipeline("chain", deadline=timedelta(minutes=5))

    @chain.step()
    def first(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"n": n}

    @chain.step()
    def second(ctx: flowq.Context, n: int) -> None: ...

    fan = app.pipeline("fan")

    @fan.step()
    def split(ctx: flowq.Context, count: int) -> flowq.Each:
        return flowq.each([{"i": i} for i in range(count)])

    @fan.step()
    def square(ctx: flowq.Context, i: int) -> int:
        return i * i

    approval = app.pipeline("approval")

    @approval.step()
    def request(ctx: flowq.Context, doc: str) -> dict[str, str]:
        return {"doc": doc}

    @approval.step(wait_for="approved", wait_timeout=timedelta(hours=1))
    def publish(ctx: flowq.Context, doc: str, approved: Any) -> None: ...

    return app


def deadlines(engine: sa.Engine, run_id: int) -> list[Any]:
    with engine.connect() as conn:
        return [r.deadline for r in conn.execute(sa.text(
            "SELECT deadline FROM flowq.steps WHERE run_id = :r ORDER BY id"), {"r": run_id})]


def seconds_left(engine: sa.Engine, run_id: int) -> float:
    with engine.connect() as conn:
        return float(conn.execute(sa.text(
            "SELECT extract(epoch FROM min(deadline) - now()) FROM flowq.steps "
            "WHERE run_id = :r"), {"r": run_id}).scalar_one())


def expire(engine: sa.Engine, run_id: int) -> None:
    """The deadline passes (moved into the past rather than waited for)."""
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.jobs SET deadline = now() - interval '1 second' "
                             "WHERE run_id = :r"), {"r": run_id})


def reap(engine: sa.Engine) -> int:
    return Reaper(engine, "flowq", stale_after=30).run_once()


# -- stored ----------------------------------------------------------------------------------


def test_a_deadline_is_stored_from_the_option_or_the_definitions_default(
        engine: sa.Engine) -> None:
    app = make_app()
    at = datetime.now(timezone.utc) + timedelta(days=2)
    with engine.begin() as conn:
        default = flowq.enqueue(conn, app.get("bounded"), n=1)
        overridden = flowq.enqueue(conn, app.get("bounded"), deadline=30, n=2)
        absolute = flowq.enqueue(conn, app.get("plain"), deadline=at, n=3)
        none = flowq.enqueue(conn, app.get("plain"), n=4)
        many = flowq.enqueue_many(conn, app.get("plain"), [{"n": 5}, {"n": 6}],
                                  deadline=timedelta(minutes=10))
        by_name = flowq.enqueue(conn, "elsewhere", queue="default", deadline=HOUR, n=7)
    assert 3590 < seconds_left(engine, default.id) <= 3600
    assert 20 < seconds_left(engine, overridden.id) <= 30
    assert deadlines(engine, absolute.id) == [at]
    assert deadlines(engine, none.id) == [None]
    assert all(590 < seconds_left(engine, r) <= 600 for r in many)
    assert 3590 < seconds_left(engine, by_name.id) <= 3600
    assert get_run(engine, absolute.id).deadline == at


def test_flowq_runs_show_prints_the_deadline(engine: sa.Engine, db_url: str) -> None:
    app = make_app()
    at = datetime(2031, 5, 6, 7, 8, 9, tzinfo=timezone.utc)
    with engine.begin() as conn:
        run = flowq.enqueue(conn, app.get("plain"), deadline=at, n=1)
        none = flowq.enqueue(conn, app.get("plain"), n=2)
    code, out, _ = cli(db_url, "show", str(run.id))
    assert code == 0 and f"deadline {at.astimezone().strftime('%Y-%m-%d %H:%M:%S')}" in out
    assert datetime.fromisoformat(cli_json(db_url, "show", str(run.id))["deadline"]) == at
    code, out, _ = cli(db_url, "show", str(none.id))
    assert code == 0 and "deadline" not in out
    assert cli_json(db_url, "show", str(none.id))["deadline"] is None


def test_the_steps_a_run_creates_inherit_its_deadline(engine: sa.Engine) -> None:
    app = make_app()
    with engine.begin() as conn:
        chained = flowq.enqueue(conn, app.get("chain"), n=1)
        mapped = flowq.enqueue(conn, app.get("fan"), deadline=HOUR, count=3)
        waiting = flowq.enqueue(conn, app.get("approval"), deadline=HOUR, doc="d")
    drain(engine, app)
    for run in (chained, mapped, waiting):
        stored = deadlines(engine, run.id)
        assert len(stored) > 1 and stored[0] is not None and set(stored) == {stored[0]}, stored
    assert len(deadlines(engine, mapped.id)) == 4  # split + 3 instances
    assert get_run(engine, waiting.id).status == "waiting"


# -- fired -----------------------------------------------------------------------------------


def test_the_reaper_cancels_pending_sleeping_and_waiting_steps_past_the_deadline(
        engine: sa.Engine) -> None:
    app = make_app()
    with engine.begin() as conn:
        pending = flowq.enqueue(conn, app.get("plain"), deadline=HOUR, n=1)
        sleeping = flowq.enqueue(conn, app.get("plain"), deadline=HOUR * 3, delay=HOUR, n=2)
        waiting = flowq.enqueue(conn, app.get("approval"), deadline=HOUR, doc="d")
        later = flowq.enqueue(conn, app.get("plain"), deadline=HOUR, n=3)
        never = flowq.enqueue(conn, app.get("plain"), n=4)
    drain(engine, app, runs=[waiting])
    assert get_run(engine, waiting.id).status == "waiting"
    assert reap(engine) == 0  # nothing has passed yet
    for run in (pending, sleeping, waiting):
        expire(engine, run.id)
    assert reap(engine) == 3
    for run in (pending, sleeping, waiting):
        info = get_run(engine, run.id)
        assert info.status == "cancelled", info
        last = info.steps[-1]
        assert last.status == "cancelled" and last.finished_at is not None
        assert last.last_error is not None
        assert last.last_error.startswith(
            "DeadlineExceeded: The run's deadline passed before it finished"), last.last_error
    assert get_run(engine, waiting.id).steps[0].status == "succeeded"  # finished: untouched
    assert get_run(engine, later.id).status == "pending"
    assert get_run(engine, never.id).status == "pending"
    assert reap(engine) == 0  # fired once
    drain(engine, app)  # what was cancelled never runs
    assert get_run(engine, pending.id).steps[0].attempts == 0
    # A signal for the cancelled waiting step is refused like one for any cancelled run.
    with engine.begin() as conn, pytest.raises(flowq.RunStateError):
        flowq.signal(conn, waiting.id, "approved", {"ok": True})


def test_a_running_handler_sees_ctx_cancelled_and_creates_no_successor(
        engine: sa.Engine, db_url: str) -> None:
    app = flowq.FlowQ()
    started, saw = threading.Event(), threading.Event()
    p = app.pipeline("slow", deadline=HOUR)

    @p.step()
    def loop(ctx: flowq.Context) -> dict[str, int]:
        started.set()
        wait_until(lambda: ctx.cancelled, timeout=30, interval=0.02,
                   message="ctx.cancelled")
        saw.set()
        return {"n": 1}  # finishing anyway: the run stays cancelled, no successor runs

    @p.step()
    def after(ctx: flowq.Context, n: int) -> None:
        raise AssertionError("a step after the deadline ran")

    with engine.begin() as conn:
        run = flowq.enqueue(conn, p)
    with running_worker(app, db_url, heartbeat_interval=0.1, stale_after=30,
                        reap_interval=3600):
        assert started.wait(30)
        expire(engine, run.id)
        assert reap(engine) == 1
        assert saw.wait(30)
        wait_until(lambda: job_rows(engine, where="run_id = :r AND status = 'succeeded'",
                                    r=run.id), message="the handler's end")
    info = get_run(engine, run.id)
    assert info.status == "cancelled"
    assert [s.step for s in info.steps] == ["loop"]
    assert info.cancel_requested
    assert reap(engine) == 0


def test_the_deadline_pass_is_bounded_and_leaves_locked_rows_to_the_next(
        engine: sa.Engine) -> None:
    app = make_app()
    with engine.begin() as conn:
        runs = flowq.enqueue_many(conn, app.get("plain"), [{"n": i} for i in range(5)],
                                  deadline=HOUR)
    for r in runs:
        expire(engine, r)
    with engine.connect() as holder:  # a write in flight holds one row
        holder.execute(sa.text("SELECT 1 FROM flowq.jobs WHERE run_id = :r FOR UPDATE"),
                       {"r": runs[0]})
        assert Reaper(engine, "flowq", stale_after=30, limit=2).run_once() == 2
        assert Reaper(engine, "flowq", stale_after=30, limit=10).run_once() == 2  # skipped, not waited
        holder.rollback()
    assert reap(engine) == 1
    assert {get_run(engine, r).status for r in runs} == {"cancelled"}


def test_the_deadline_pass_reads_the_partial_deadline_index(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("""
            INSERT INTO flowq.jobs (task, step, status, finished_at, deadline)
            SELECT 't', 't', 'succeeded', now(), now() - interval '1 day'
              FROM generate_series(1, 20000)"""))
        conn.execute(sa.text("""
            INSERT INTO flowq.jobs (task, step) SELECT 't', 't' FROM generate_series(1, 5000)"""))
        conn.execute(sa.text("""
            INSERT INTO flowq.jobs (task, step, deadline)
            SELECT 't', 't', now() + interval '1 day' FROM generate_series(1, 50)"""))
        conn.execute(sa.text("ANALYZE flowq.jobs"))
    compiled = Q.cancel_expired_jobs.bindparams(error="x %s", limit=1000).compile(
        engine, compile_kwargs={"literal_binds": True})
    with engine.connect() as conn:
        raw = conn.execute(sa.text("EXPLAIN (FORMAT JSON) " + str(compiled))).scalar()
        conn.rollback()
    plan = raw if isinstance(raw, list) else json.loads(str(raw))
    assert '"jobs_deadline_idx"' in json.dumps(plan), json.dumps(plan, indent=1)


# -- hostile ---------------------------------------------------------------------------------


NOW = datetime.now(timezone.utc)


@pytest.mark.parametrize(("deadline", "message"), [
    (datetime(2030, 1, 1), "deadline must be a timezone-aware datetime"),
    (NOW - timedelta(minutes=1), "has already passed"),
    (datetime(1, 1, 1, tzinfo=timezone.utc), "deadline must be between"),
    (datetime.max.replace(tzinfo=timezone.utc), "deadline must be between"),
    (timedelta(0), "deadline must be a positive duration"),
    (0, "deadline must be a positive duration"),
    (timedelta(seconds=-5), "deadline must be a positive duration"),
    (-1e300, "deadline must end the run between"),
    (timedelta.max, "deadline must end the run between"),
    (1e300, "deadline must end the run between"),
    (10**30, "deadline must end the run between"),
    (math.nan, "deadline must be a finite number of seconds"),
    (math.inf, "deadline must be a finite number of seconds"),
    ("10", "deadline must be seconds (a number) or a timedelta"),
    (True, "deadline must be seconds (a number) or a timedelta"),
    ([1], "deadline must be seconds (a number) or a timedelta"),
])
def test_hostile_deadlines_are_refused_with_one_sentence(
        engine: sa.Engine, deadline: Any, message: str) -> None:
    app = make_app()
    with engine.begin() as conn:
        with pytest.raises(flowq.InvalidArgumentsError, match=message.replace("(", r"\(")
                           .replace(")", r"\)")):
            flowq.enqueue(conn, app.get("plain"), deadline=deadline, n=1)
        with pytest.raises(flowq.InvalidArgumentsError):
            app.get("plain").options(deadline=deadline).enqueue(conn, n=1)
        with pytest.raises(flowq.InvalidArgumentsError):
            flowq.enqueue_many(conn, app.get("plain"), [{"n": 1}], deadline=deadline)
        flowq.enqueue(conn, app.get("plain"), n=1)  # the transaction is still usable
    assert len(job_rows(engine)) == 1


def test_a_deadline_before_the_due_time_is_refused(engine: sa.Engine) -> None:
    app = make_app()
    with engine.begin() as conn:
        with pytest.raises(flowq.InvalidArgumentsError, match="not after the run's due time"):
            flowq.enqueue(conn, app.get("plain"), delay=HOUR, deadline=60, n=1)
        with pytest.raises(flowq.InvalidArgumentsError,
                           match=r"\(the default of its definition\) is not after the run's"):
            flowq.enqueue(conn, app.get("bounded"), run_at=NOW + 2 * HOUR, n=1)


@pytest.mark.parametrize("deadline", [
    math.nan, timedelta(0), -3, "1h", NOW + HOUR, timedelta.max])
def test_a_hostile_default_deadline_is_refused_at_definition(deadline: Any) -> None:
    app = flowq.FlowQ()
    with pytest.raises(flowq.ConfigurationError, match="'t': deadline must"):
        @app.task(name="t", deadline=deadline)
        def t(ctx: flowq.Context) -> None: ...
    with pytest.raises(flowq.ConfigurationError, match="'p': deadline must"):
        app.pipeline("p", deadline=deadline)


def test_deadline_is_a_reserved_option() -> None:
    app = flowq.FlowQ()
    with pytest.raises(flowq.ConfigurationError, match="deadline"):
        @app.task()
        def t(ctx: flowq.Context, deadline: int) -> None: ...
