"""The helpers flowq ships for its users' tests (flowq.testing)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import orm
from tenacity import stop_after_attempt, wait_fixed

import flowq
from flowq.define.retry import DEFAULT_MAX_ATTEMPTS
from flowq.durable.context import Context
from flowq.testing import (
    DrainResult,
    aall_enqueued,
    aassert_enqueued,
    adrain,
    all_enqueued,
    arefute_enqueued,
    arun_step,
    assert_enqueued,
    drain,
    job_rows,
    make_context,
    refute_enqueued,
    run_step,
    run_until_idle,
    wait_until,
)


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


# -- assertions through the caller's own transaction ------------------------------------------


def test_assertions_see_uncommitted_jobs_through_a_connection(app: flowq.FlowQ,
                                                              engine: sa.Engine) -> None:
    @app.task(queue="mail")
    def send(ctx: Context, to: str, tags: list[str] | None = None) -> None:
        pass

    with engine.connect() as conn, conn.begin() as tx:
        run = flowq.enqueue(conn, send, to="a@x", tags=("vip",))
        flowq.enqueue(conn, send, to="b@x")
        assert assert_enqueued(conn, send, to="a@x").run_id == run.id
        assert assert_enqueued(conn, send, tags=["vip"]).run_id == run.id  # tuple -> list
        assert assert_enqueued(conn, send, tags=("vip",)).run_id == run.id
        refute_enqueued(conn, send, to="c@x")
        refute_enqueued(conn, "other")
        assert [r.args["to"] for r in all_enqueued(conn, send)] == ["a@x", "b@x"]
        assert len(all_enqueued(conn, queue="mail")) == 2
        assert all_enqueued(conn, queue="default") == []
        with pytest.raises(AssertionError, match=r"no pending job of 'send' with arguments "
                                                 r"\{'to': 'c@x'\}; pending jobs of 'send': "
                                                 r"\[\{'to': 'a@x'"):
            assert_enqueued(conn, send, to="c@x")
        with pytest.raises(AssertionError, match=rf"unexpected pending job of 'send' with "
                                                 rf"arguments \{{'to': 'a@x'\}}: job \d+ "
                                                 rf"\(run {run.id}\)"):
            refute_enqueued(conn, send, to="a@x")
        # Uncommitted: another connection (the engine) sees nothing.
        refute_enqueued(engine, send)
        tx.rollback()
    assert all_enqueued(engine) == []


def test_assertions_see_uncommitted_jobs_through_a_session(app: flowq.FlowQ,
                                                           engine: sa.Engine) -> None:
    @app.task()
    def bill(ctx: Context, order: int) -> None:
        pass

    Session = orm.sessionmaker(engine, class_=flowq.Session)
    with Session() as session:
        session.enqueue(bill, order=7)
        assert assert_enqueued(session, bill, order=7).args == {"order": 7}
        assert [r.task for r in all_enqueued(session)] == ["bill"]
        refute_enqueued(session, bill, order=8)
        refute_enqueued(engine, bill)
        session.rollback()
        refute_enqueued(session, bill)


def test_assertions_through_an_async_session(app: flowq.FlowQ, db_url: str) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from flowq.enqueueing.aio import AsyncSession

    @app.task()
    def ping(ctx: Context, n: int) -> None:
        pass

    async def main() -> None:
        aengine = create_async_engine(db_url)
        try:
            async with async_sessionmaker(aengine, class_=AsyncSession)() as session:
                await session.enqueue(ping, n=1)
                assert (await aassert_enqueued(session, ping, n=1)).args == {"n": 1}
                await arefute_enqueued(session, ping, n=2)
                assert len(await aall_enqueued(session, ping)) == 1
                await arefute_enqueued(aengine, ping)  # not committed
                with pytest.raises(AssertionError):
                    await aassert_enqueued(session, ping, n=2)
        finally:
            await aengine.dispose()

    asyncio.run(main())


# -- drain ------------------------------------------------------------------------------------


def test_drain_retries_a_failing_job_until_it_succeeds(app: flowq.FlowQ,
                                                       engine: sa.Engine) -> None:
    @app.task(retry=flowq.Retry(stop=stop_after_attempt(5), wait=wait_fixed(3600)))
    def flaky(ctx: Context) -> str:
        if ctx.attempt < 3:
            raise ValueError(f"boom {ctx.attempt}")
        return "ok"

    with engine.connect() as conn, conn.begin():
        flowq.enqueue(conn, flaky)
        result = drain(conn, app)
        assert result == DrainResult(succeeded=1, retried=2) and result.total == 3
        [row] = conn.execute(sa.text("SELECT * FROM flowq.steps")).all()
        assert (row.status, row.attempts, row.result, row.locked_by) == (
            "succeeded", 3, "ok", None)
        assert "ValueError: boom 2" in row.last_error  # the retry_job write kept the error


def test_drain_runs_a_pipeline_across_queues_in_order(app: flowq.FlowQ,
                                                      engine: sa.Engine) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    onboard = app.pipeline("onboard")

    @onboard.step()
    def create(ctx: Context, user: int) -> dict[str, Any]:
        seen.append((ctx.step, {"user": user}))
        return {"account": user * 10}

    @onboard.step(queue="mail")
    def welcome(ctx: Context, account: int) -> None:
        seen.append((ctx.step, {"account": account}))
        if ctx.attempt == 1:
            raise flowq.RetryStep(after=600)

    with engine.connect() as conn, conn.begin():
        run = flowq.enqueue(conn, onboard, user=4)
        assert drain(conn, app) == DrainResult(succeeded=2, retried=1)
        assert seen == [("create", {"user": 4}), ("welcome", {"account": 40}),
                        ("welcome", {"account": 40})]
        rows = conn.execute(sa.text("SELECT step, status, run_id, queue FROM flowq.steps "
                                    "ORDER BY id")).all()
        assert [tuple(r) for r in rows] == [("create", "succeeded", run.id, "default"),
                                            ("welcome", "succeeded", run.id, "mail")]


def test_drain_raises_on_a_dead_job_naming_it_and_its_error(app: flowq.FlowQ,
                                                            engine: sa.Engine) -> None:
    @app.task(retry=flowq.Retry(stop=stop_after_attempt(3)))
    def doomed(ctx: Context, n: int) -> None:
        raise RuntimeError(f"no luck with {n}")

    with engine.connect() as conn, conn.begin():
        run = flowq.enqueue(conn, doomed, n=5)
        with pytest.raises(AssertionError, match=rf"job \d+ \(run {run.id}, task 'doomed', "
                                                 r"step 'doomed'\) is dead after attempt 3: "
                                                 r"RuntimeError: no luck with 5"):
            drain(conn, app)
        [row] = conn.execute(sa.text("SELECT status, attempts FROM flowq.steps")).all()
        assert tuple(row) == ("dead", 3)  # written before raising, at the attempt cap


def test_drain_counts_dead_and_cancelled_without_raising(app: flowq.FlowQ,
                                                         engine: sa.Engine) -> None:
    @app.task(retry=flowq.Retry(stop=stop_after_attempt(2)))
    def doomed(ctx: Context) -> None:
        raise flowq.RetryStep(after=1)  # asks again and again: the cap stops it

    @app.task()
    def called_off(ctx: Context) -> None:
        raise flowq.CancelRun("not needed")

    with engine.connect() as conn, conn.begin():
        flowq.enqueue(conn, doomed)
        flowq.enqueue(conn, called_off)
        assert drain(conn, app, raise_on_dead=False) == DrainResult(retried=1, dead=1,
                                                                    cancelled=1)


def test_drain_inside_a_rolled_back_transaction_leaves_nothing_behind(
        app: flowq.FlowQ, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE notes (body text NOT NULL)"))

    @app.task(retry=flowq.Retry(stop=stop_after_attempt(3)))
    def note(ctx: Context, body: str) -> None:
        ctx.session.execute(sa.text("INSERT INTO notes VALUES (:b)"),
                            {"b": f"{body} {ctx.attempt}"})
        if ctx.attempt == 1:
            raise ValueError("first try fails: its note must be rolled back")
        flowq.enqueue(ctx.session, "audit", queue="default", what=body)  # in the handler's transaction too

    @app.task()
    def audit(ctx: Context, what: str) -> None:
        ctx.session.execute(sa.text("INSERT INTO notes VALUES (:b)"), {"b": f"audit {what}"})

    Session = orm.sessionmaker(engine, class_=flowq.Session)
    with Session() as session:
        session.enqueue(note, body="hello")
        assert drain(session, app) == DrainResult(succeeded=2, retried=1)
        assert session.execute(sa.text("SELECT body FROM notes")).scalars().all() == [
            "hello 2", "audit hello"]
        assert [r.status for r in session.execute(sa.text("SELECT * FROM flowq.steps"))] == [
            "succeeded", "succeeded"]
        assert job_rows(engine) == []  # nothing committed, even mid-test
        session.rollback()
    assert job_rows(engine) == []
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM notes")).scalar() == 0


def test_drain_a_handler_whose_writes_fail_at_commit_is_retried(app: flowq.FlowQ,
                                                                engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE uniq (k int PRIMARY KEY)"))

    class Uniq(orm.DeclarativeBase):
        pass

    class Row(Uniq):
        __tablename__ = "uniq"
        k: orm.Mapped[int] = orm.mapped_column(primary_key=True)

    @app.task(retry=flowq.Retry(stop=stop_after_attempt(2)))
    def clash(ctx: Context) -> None:
        ctx.session.add(Row(k=1))  # flushed at commit, where the duplicate key fails

    with engine.connect() as conn, conn.begin():
        conn.execute(sa.text("INSERT INTO uniq VALUES (1)"))
        flowq.enqueue(conn, clash)
        with pytest.raises(AssertionError, match="IntegrityError"):
            drain(conn, app)
        assert conn.execute(sa.text("SELECT attempts FROM flowq.steps")).scalar() == 2


def test_drain_options_skip_waits_runs_queues_and_an_engine(app: flowq.FlowQ,
                                                            engine: sa.Engine) -> None:
    @app.task()
    def later(ctx: Context) -> None:
        raise flowq.RetryStep(after=60)

    @app.task(queue="side")
    def side(ctx: Context, n: int) -> None:
        pass

    with engine.connect() as conn, conn.begin() as tx:
        flowq.enqueue(conn, later)
        flowq.enqueue(conn, side, n=1, delay=3600)  # not due: left alone
        assert drain(conn, app, skip_waits=False) == DrainResult(retried=1)
        assert_enqueued(conn, later)
        assert_enqueued(conn, side, n=1)
        tx.rollback()

    with engine.begin() as conn:
        first = flowq.enqueue(conn, side, n=1)
        flowq.enqueue(conn, side, n=2)
    assert drain(engine, app, queues=["default"]) == DrainResult()
    assert drain(engine, app, runs=[first]) == DrainResult(succeeded=1)  # committed
    assert [r.args["n"] for r in all_enqueued(engine, side)] == [2]
    assert drain(engine, app, runs=[first.id]) == DrainResult()
    assert drain(engine, app) == DrainResult(succeeded=1)
    assert all_enqueued(engine) == []


def test_drain_stops_a_job_that_keeps_enqueueing_another(app: flowq.FlowQ,
                                                         engine: sa.Engine) -> None:
    @app.task()
    def forever(ctx: Context) -> None:
        flowq.enqueue(ctx.session, forever)

    with engine.connect() as conn, conn.begin():
        flowq.enqueue(conn, forever)
        with pytest.raises(AssertionError, match=r"drain ran 5 jobs \(max_jobs\)"):
            drain(conn, app, max_jobs=5)


def test_drain_awaits_async_handlers_and_unknown_tasks_die(app: flowq.FlowQ,
                                                           engine: sa.Engine) -> None:
    @app.task()
    async def nap(ctx: Context, n: int) -> int:
        await asyncio.sleep(0)
        return n + 1

    with engine.connect() as conn, conn.begin():
        flowq.enqueue(conn, nap, n=1)
        flowq.enqueue(conn, "nobody_knows", queue="default")
        # By name, unknown to this app: the default policy's cap, then dead.
        assert drain(conn, app, raise_on_dead=False) == DrainResult(
            succeeded=1, retried=DEFAULT_MAX_ATTEMPTS - 1, dead=1)
        assert conn.execute(sa.text("SELECT result FROM flowq.steps WHERE task = 'nap'")
                            ).scalar() == 2


def test_adrain_in_an_async_session(app: flowq.FlowQ, db_url: str, engine: sa.Engine) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from flowq.enqueueing.aio import AsyncSession

    @app.task()
    def sync_step(ctx: Context, n: int) -> int:
        ctx.session.execute(sa.text("SELECT 1"))
        return n

    @app.task()
    async def async_step(ctx: Context) -> str:
        await asyncio.sleep(0)
        return "done"

    async def main() -> DrainResult:
        aengine = create_async_engine(db_url)
        try:
            async with async_sessionmaker(aengine, class_=AsyncSession)() as session:
                await session.enqueue(sync_step, n=3)
                await session.enqueue(async_step)
                result = await adrain(session, app)
                assert await aall_enqueued(session) == []
                await session.rollback()
                return result
        finally:
            await aengine.dispose()

    assert asyncio.run(main()) == DrainResult(succeeded=2)
    assert job_rows(engine) == []


# -- run_step -----------------------------------------------------------------------------------


def test_run_step_gives_the_handler_a_real_context(app: flowq.FlowQ,
                                                   engine: sa.Engine) -> None:
    @app.task(queue="mail")
    def greet(ctx: Context, name: str) -> dict[str, Any]:
        count = ctx.session.execute(sa.text("SELECT count(*) FROM flowq.steps")).scalar()
        return {"hello": name, "ctx": [ctx.job_id, ctx.run_id, ctx.step, ctx.attempt,
                                       ctx.queue, ctx.idempotency_key], "jobs": count}

    with orm.Session(engine) as session:
        assert run_step(greet, session=session, name="ada") == {
            "hello": "ada", "ctx": [0, 0, "greet", 1, "mail", "flowq:0:greet"], "jobs": 0}
    ctx = make_context(greet, attempt=3, run_id=9)
    assert (ctx.attempt, ctx.idempotency_key) == (3, "flowq:9:greet")
    with pytest.raises(flowq.FlowqError, match="no database session"):
        run_step(greet, name="ada")  # no session given, and the handler needs one
    with pytest.raises(flowq.InvalidArgumentsError):
        run_step(greet, session=None, nom="ada")


def test_run_step_checks_results_and_lets_control_flow_through(app: flowq.FlowQ) -> None:
    p = app.pipeline("p")

    @p.step()
    def first(ctx: Context, n: int) -> Any:
        if n < 0:
            raise flowq.RetryStep(after=1)
        return {"m": n} if n else [n]

    @p.step()
    async def second(ctx: Context, m: int) -> dict[str, float]:
        return {"x": float(m)}

    assert run_step(p, n=2) == {"m": 2}
    assert run_step(first, n=2) == {"m": 2}
    with pytest.raises(AssertionError, match="must return a dict"):
        run_step(p, n=0)  # the next step takes keywords
    assert run_step(first, n=0) == [0]  # a bare step: only storability is known
    with pytest.raises(flowq.RetryStep):
        run_step(p, n=-1)
    assert run_step(second, m=3) == {"x": 3.0}
    assert asyncio.run(arun_step(second, m=4)) == {"x": 4.0}
    with pytest.raises(AssertionError, match="arguments flowq cannot enqueue"):
        run_step(second, m=float("nan"))

    @app.task()
    def odd(ctx: Context) -> Any:
        return {1, 2}

    with pytest.raises(AssertionError, match="returned a value flowq cannot store"):
        run_step(odd)


# -- the pytest plugin ------------------------------------------------------------------------


def test_the_pytest_plugin_fixtures(server_url: str, tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text('''
import sqlalchemy as sa
import flowq
from flowq.testing import assert_enqueued, drain, refute_enqueued

app = flowq.FlowQ()

@app.task()
def remember(ctx, text):
    ctx.session.execute(sa.text("INSERT INTO memo VALUES (:t)"), {"t": text})

def test_setup(flowq_engine):
    with flowq_engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE memo (t text)"))

def test_enqueue_and_drain(flowq_session):
    flowq_session.enqueue(remember, text="hi")
    flowq_session.commit()  # only a savepoint: the fixture rolls the test back
    assert_enqueued(flowq_session, remember, text="hi")
    assert drain(flowq_session, app).succeeded == 1
    assert flowq_session.execute(sa.text("SELECT t FROM memo")).scalars().all() == ["hi"]

def test_nothing_left_behind(flowq_session, flowq_engine, flowq_database_url):
    refute_enqueued(flowq_engine, remember)
    with flowq_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM memo")).scalar() == 0
        assert conn.execute(sa.text("SELECT current_database()")).scalar().startswith(
            "flowq_test_")
    assert flowq_database_url.startswith("postgresql+psycopg://")
''')
    admin = sa.create_engine(server_url, poolclass=sa.pool.NullPool)

    def databases() -> set[str]:
        with admin.connect() as conn:
            return set(conn.execute(sa.text("SELECT datname FROM pg_database")).scalars())

    try:
        before = databases()
        # Once flowq's pytest11 entry point is installed the plugin loads by itself, and
        # naming it again with -p would register it twice.
        plugin = "flowq.testing.pytest_plugin"
        installed = any(ep.value == plugin
                        for ep in importlib.metadata.entry_points(group="pytest11"))
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", *([] if installed else ["-p", plugin]), "-q",
             "-p", "no:cacheprovider", "test_user.py"],
            cwd=tmp_path, capture_output=True, text=True, timeout=240,
            env={**os.environ, "FLOWQ_TEST_DATABASE_URL": server_url})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "3 passed" in proc.stdout
        assert databases() == before  # the throwaway database was dropped
    finally:
        admin.dispose()
