"""Checkpoints, durable sleeps and snoozes (flowq.durable) through the test kit's drain, which
runs attempts with the worker's own parts: what replays, what commits together, what is
refused. The real-process guarantees (SIGKILL, SIGSTOP, 1,000 sleepers) are in
tests/acceptance/test_durable.py."""

from __future__ import annotations

import json
import math
import warnings
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.orm import Session
from support import enqueue_id as enqueue
from tenacity import stop_after_attempt

import flowq
from flowq.cli import main
from flowq.db.runner import runner
from flowq.db.store import Store
from flowq.durable.checkpoints import MAX_SNOOZES, ClaimLost, Ledger
from flowq.durable.session import StepSession
from flowq.testing import drain, job_rows, run_step
from flowq.worker.pruner import Pruner

ONCE = flowq.Retry(stop=stop_after_attempt(1))
THRICE = flowq.Retry(stop=stop_after_attempt(3))


@pytest.fixture
def effects(engine: sa.Engine) -> sa.Engine:
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE effects (name text PRIMARY KEY)")
        conn.exec_driver_sql("CREATE TABLE calls (id serial PRIMARY KEY, name text)")
    return engine


def calls(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT name FROM calls ORDER BY id")).scalars())


def names(engine: sa.Engine, table: str = "effects") -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.execute(sa.text(f"SELECT name FROM {table}")).scalars())


def stored(engine: sa.Engine, run_id: int) -> list[tuple[str, int, Any]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(
            "SELECT name, position, result FROM flowq.checkpoints WHERE run_id = :r "
            "ORDER BY position, name"), {"r": run_id})]


def the_job(engine: sa.Engine, run_id: int) -> Any:
    (row,) = job_rows(engine, where="run_id = :r", r=run_id)
    return row


def test_a_retry_replays_recorded_checkpoints_and_runs_the_rest_once(
        engine: sa.Engine, app: flowq.FlowQ, effects: sa.Engine) -> None:
    def effect(name: str, *, session: Session) -> dict[str, str]:
        with engine.begin() as conn:  # the call log commits whatever the checkpoint does
            conn.execute(sa.text("INSERT INTO calls (name) VALUES (:n)"), {"n": name})
        session.execute(sa.text("INSERT INTO effects VALUES (:n)"), {"n": name})
        return {"done": name}

    @app.task(retry=THRICE)
    def five(ctx: flowq.Context) -> dict[str, Any]:
        got = [ctx.checkpoint(f"c{i}", effect, f"c{i}") for i in range(1, 6)
               if i <= 3 or ctx.attempt > 1]
        if ctx.attempt == 1:
            raise RuntimeError("crash after the third")
        return {"got": [g["done"] for g in got]}

    run_id = enqueue(engine, five)
    drain(engine, app)
    assert calls(engine) == ["c1", "c2", "c3", "c4", "c5"]
    assert names(engine) == ["c1", "c2", "c3", "c4", "c5"]
    assert [s[:2] for s in stored(engine, run_id)] == [(f"c{i}", i - 1) for i in range(1, 6)]
    job = the_job(engine, run_id)
    assert job.status == "succeeded" and job.attempts == 2
    assert job.result == {"got": ["c1", "c2", "c3", "c4", "c5"]}


def test_a_checkpoint_that_raises_records_nothing_and_keeps_no_write(
        engine: sa.Engine, app: flowq.FlowQ, effects: sa.Engine) -> None:
    def half(*, session: Session) -> None:
        session.execute(sa.text("INSERT INTO effects VALUES ('half')"))
        raise ValueError("half-way")

    @app.task(retry=ONCE)
    def fails(ctx: flowq.Context) -> None:
        ctx.checkpoint("half", half)

    run_id = enqueue(engine, fails)
    drain(engine, app, raise_on_dead=False)
    assert names(engine) == [] and stored(engine, run_id) == []
    assert "ValueError: half-way" in the_job(engine, run_id).last_error


def test_in_a_tests_transaction_the_rollback_undoes_checkpoints_and_their_writes(
        engine: sa.Engine, app: flowq.FlowQ, effects: sa.Engine) -> None:
    @app.task()
    def one(ctx: flowq.Context) -> Any:
        return ctx.checkpoint("a", lambda *, session: session.execute(
            sa.text("INSERT INTO effects VALUES ('a')")) and 1)

    with engine.connect() as conn:
        run = flowq.enqueue(conn, one)
        assert drain(conn, app).succeeded == 1
        assert conn.execute(sa.text("SELECT count(*) FROM effects")).scalar() == 1
        assert conn.execute(sa.text("SELECT count(*) FROM flowq.checkpoints WHERE run_id = :r"),
                            {"r": run.id}).scalar() == 1
        conn.rollback()
    assert names(engine) == [] and stored(engine, run.id) == []


def test_a_lost_claim_records_neither_the_checkpoint_nor_its_writes(
        engine: sa.Engine, app: flowq.FlowQ, effects: sa.Engine) -> None:
    @app.task()
    def t(ctx: flowq.Context) -> None: ...

    run_id = enqueue(engine, t)
    with engine.begin() as conn:
        (job,) = Store(runner(conn, direct=False)).claim_any("default", 1, "test")
    ledger = Ledger(run_id=run_id, step="t", map_index=None, claim=(job.id, job.lease + 1),
                    session_factory=lambda: StepSession(bind=engine))
    with pytest.raises(ClaimLost, match="no longer holds its claim"):
        ledger.checkpoint("w", lambda *, session: session.execute(
            sa.text("INSERT INTO effects VALUES ('w')")) and None, (), {})
    assert names(engine) == [] and stored(engine, run_id) == []
    # The claim that is still ours records.
    ours = Ledger(run_id=run_id, step="t", map_index=None, claim=job.claim,
                  session_factory=lambda: StepSession(bind=engine))
    assert ours.checkpoint("w", lambda: [1, (2,)], (), {}) == [1, [2]]
    assert stored(engine, run_id) == [("w", 0, [1, [2]])]


def test_a_name_reused_in_one_attempt_is_an_error_naming_both_positions(
        engine: sa.Engine, app: flowq.FlowQ) -> None:
    @app.task(retry=THRICE)
    def twice(ctx: flowq.Context) -> None:
        ctx.checkpoint("a", lambda: 1)
        ctx.checkpoint("b", lambda: 2)
        ctx.checkpoint("a", lambda: 3)

    run_id = enqueue(engine, twice)
    drain(engine, app, raise_on_dead=False)
    job = the_job(engine, run_id)
    assert job.status == "dead" and job.attempts == 1  # a CheckpointError is not retried
    assert ("CheckpointError: checkpoint 'a' was already used at position 0 of this attempt, "
            "and is used again at position 2") in job.last_error


@pytest.mark.parametrize(("name", "message"), [
    (7, "must be a str, got int"),
    ("", "1-200 characters, got 0"),
    ("x" * 201, "1-200 characters, got 201"),
    ("a\x00b", "NUL"),
    ("a\udcffb", "lone surrogate"),
    ("flowq.sleep.0", "flowq's own"),
])
def test_hostile_checkpoint_names_are_refused(engine: sa.Engine, app: flowq.FlowQ,
                                              name: Any, message: str) -> None:
    @app.task(retry=ONCE)
    def named(ctx: flowq.Context) -> None:
        ctx.checkpoint(name, lambda: 1)

    run_id = enqueue(engine, named)
    drain(engine, app, raise_on_dead=False)
    job = the_job(engine, run_id)
    assert job.status == "dead" and "CheckpointError" in job.last_error
    assert message in job.last_error
    assert stored(engine, run_id) == []


@pytest.mark.parametrize(("result", "message"), [
    (math.nan, "NaN"), ({1, 2}, "set"), ("a\x00", "NUL"), ({1: "x"}, "key"),
])
def test_hostile_checkpoint_results_are_refused_by_the_step_output_rule(
        engine: sa.Engine, app: flowq.FlowQ, result: Any, message: str) -> None:
    @app.task(retry=ONCE)
    def returns(ctx: flowq.Context) -> None:
        ctx.checkpoint("r", lambda: result)

    run_id = enqueue(engine, returns)
    drain(engine, app, raise_on_dead=False)
    job = the_job(engine, run_id)
    assert job.status == "dead"
    assert "CheckpointError: checkpoint 'r' returned a value flowq cannot store" in job.last_error
    assert message.lower() in job.last_error.lower()


def test_a_sleep_gives_its_attempt_back_and_resumes_past_its_checkpoints(
        engine: sa.Engine, app: flowq.FlowQ, effects: sa.Engine) -> None:
    def before() -> str:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO calls (name) VALUES ('before')"))
        return "ok"

    @app.task()
    def napper(ctx: flowq.Context) -> dict[str, Any]:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO calls (name) VALUES ('handler')"))
        first = ctx.checkpoint("before", before)
        ctx.sleep(timedelta(seconds=30))
        return {"first": first, "attempt": ctx.attempt}

    run_id = enqueue(engine, napper)
    drain(engine, app, skip_waits=False)  # a worker's view: the job sleeps
    job = the_job(engine, run_id)
    assert job.status == "pending" and job.attempts == 0 and job.last_error is None
    with engine.connect() as conn:
        due_in = conn.execute(sa.text("SELECT extract(epoch FROM run_at - now()) FROM flowq.steps"
                                      " WHERE run_id = :r"), {"r": run_id}).scalar_one()
    assert 25 < due_in <= 30
    (sleep,) = [s for s in stored(engine, run_id) if s[0] == "flowq.sleep.0"]
    assert sleep[1] == 1 and "until" in sleep[2]
    # Due now (as if the 30 s passed): the handler runs again, the checkpoint replays.
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.checkpoints SET result = jsonb_build_object("
                             "'until', now() - interval '1 second') WHERE name = 'flowq.sleep.0'"))
        conn.execute(sa.text("UPDATE flowq.jobs SET run_at = now()"))
    drain(engine, app, skip_waits=False)
    job = the_job(engine, run_id)
    assert job.status == "succeeded" and job.attempts == 1
    assert job.result == {"first": "ok", "attempt": 1}
    assert calls(engine) == ["handler", "before", "handler"]


def test_drain_skips_sleeps_like_retry_waits(engine: sa.Engine, app: flowq.FlowQ) -> None:
    @app.task()
    def napper(ctx: flowq.Context) -> dict[str, int]:
        ctx.sleep(3600)
        ctx.sleep_until(datetime.now(timezone.utc) + timedelta(days=1))
        ctx.sleep(0)
        ctx.sleep_until(datetime(2000, 1, 1, tzinfo=timezone.utc))  # past: returns at once
        return {"n": ctx.checkpoint("n", lambda: 5)}

    run_id = enqueue(engine, napper)
    result = drain(engine, app)
    job = the_job(engine, run_id)
    assert job.status == "succeeded" and job.attempts == 1 and job.result == {"n": 5}
    assert result.succeeded == 1 and result.suspended == 2 and result.retried == 0
    assert [s[0] for s in stored(engine, run_id)] == ["flowq.sleep.0", "flowq.sleep.1", "n"]


@pytest.mark.parametrize(("call", "message"), [
    (lambda ctx: ctx.sleep(math.nan), "between 0 seconds"),
    (lambda ctx: ctx.sleep(math.inf), "between 0 seconds"),
    (lambda ctx: ctx.sleep(-1), "between 0 seconds"),
    (lambda ctx: ctx.sleep(1e300), "between 0 seconds"),
    (lambda ctx: ctx.sleep(True), "seconds or a timedelta"),
    (lambda ctx: ctx.sleep("5"), "seconds or a timedelta"),
    (lambda ctx: ctx.sleep_until(datetime(2100, 1, 1)), "naive"),
    (lambda ctx: ctx.sleep_until(datetime.max.replace(tzinfo=timezone.utc)),
     "between 0 seconds"),
    (lambda ctx: ctx.sleep_until(1700000000), "aware datetime, got int"),
])
def test_hostile_sleeps_fail_with_the_delay_rule(engine: sa.Engine, app: flowq.FlowQ,
                                                 call: Any, message: str) -> None:
    @app.task(retry=ONCE)
    def sleeper(ctx: flowq.Context) -> None:
        call(ctx)

    run_id = enqueue(engine, sleeper)
    drain(engine, app, raise_on_dead=False)
    job = the_job(engine, run_id)
    assert job.status == "dead" and "ConfigurationError" in job.last_error
    assert message in job.last_error


def test_a_tiny_sleep_is_a_sleep_of_no_time(engine: sa.Engine, app: flowq.FlowQ) -> None:
    @app.task()
    def tiny(ctx: flowq.Context) -> None:
        ctx.sleep(1e-320)

    run_id = enqueue(engine, tiny)
    drain(engine, app)
    assert the_job(engine, run_id).status == "succeeded"


def test_a_snooze_spends_no_attempt_and_is_counted(engine: sa.Engine,
                                                   app: flowq.FlowQ) -> None:
    @app.task(retry=ONCE)
    def poll(ctx: flowq.Context) -> dict[str, int]:
        with engine.connect() as conn:
            n = conn.execute(sa.text("SELECT COALESCE(max(result::text::int), 0) FROM "
                                     "flowq.checkpoints WHERE name = 'flowq.snoozes'")
                             ).scalar_one()
        if n < 3:
            raise flowq.Snooze(timedelta(seconds=0), reason=f"not yet ({n})")
        return {"snoozed": n, "attempt": ctx.attempt}

    run_id = enqueue(engine, poll)
    result = drain(engine, app)
    job = the_job(engine, run_id)
    assert job.status == "succeeded" and job.attempts == 1 and result.suspended == 3
    assert job.result == {"snoozed": 3, "attempt": 1}


def test_a_snooze_keeps_its_delay_and_attempts(engine: sa.Engine, app: flowq.FlowQ) -> None:
    @app.task()
    def later(ctx: flowq.Context) -> None:
        raise flowq.Snooze(120)

    run_id = enqueue(engine, later)
    drain(engine, app, skip_waits=False)
    job = the_job(engine, run_id)
    assert job.status == "pending" and job.attempts == 0
    assert stored(engine, run_id) == [("flowq.snoozes", -1, 1)]


def test_the_snooze_cap_ends_the_step_dead_with_a_sentence(engine: sa.Engine,
                                                          app: flowq.FlowQ) -> None:
    @app.task()
    def forever(ctx: flowq.Context) -> None:
        raise flowq.Snooze(0)

    run_id = enqueue(engine, forever)
    with pytest.raises(AssertionError, match="max_jobs"):  # it would snooze on: stopped at 2
        drain(engine, app, skip_waits=False, max_jobs=2)
    assert stored(engine, run_id) == [("flowq.snoozes", -1, 2)]
    with engine.begin() as conn:  # as if it had snoozed up to the cap
        conn.execute(sa.text("UPDATE flowq.checkpoints SET result = to_jsonb(:n) "
                             "WHERE name = 'flowq.snoozes'"), {"n": MAX_SNOOZES})
    drain(engine, app, raise_on_dead=False)
    job = the_job(engine, run_id)
    assert job.status == "dead" and job.attempts == 1
    assert job.last_error.startswith(
        f"Snooze: the step snoozed {MAX_SNOOZES} times, the cap of {MAX_SNOOZES} snoozes per "
        "step (flowq.durable.MAX_SNOOZES), so it is dead rather than polling forever")


@pytest.mark.parametrize("seconds", [math.nan, -5, math.inf, "soon"])
def test_a_hostile_snooze_delay_is_a_failure(engine: sa.Engine, app: flowq.FlowQ,
                                             seconds: Any) -> None:
    @app.task(retry=ONCE)
    def bad(ctx: flowq.Context) -> None:
        raise flowq.Snooze(seconds)

    run_id = enqueue(engine, bad)
    drain(engine, app, raise_on_dead=False)
    job = the_job(engine, run_id)
    assert job.status == "dead" and "Snooze(seconds)" in job.last_error


def test_map_instances_keep_checkpoints_of_their_own(engine: sa.Engine,
                                                     app: flowq.FlowQ) -> None:
    flow = app.pipeline("fan")

    @flow.step()
    def split(ctx: flowq.Context) -> Any:
        return flowq.each([{"i": i} for i in range(3)])

    @flow.step()
    def item(ctx: flowq.Context, i: int) -> dict[str, int]:
        return {"i": ctx.checkpoint("same-name", lambda: i * 10)}

    run_id = enqueue(engine, flow)
    drain(engine, app)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT map_index, result FROM flowq.checkpoints "
                                    "WHERE run_id = :r ORDER BY map_index"), {"r": run_id}).all()
    assert [tuple(r) for r in rows] == [(0, 0), (1, 10), (2, 20)]


def test_run_step_runs_checkpoints_in_memory_and_sleeps_return(app: flowq.FlowQ) -> None:
    seen: list[int] = []

    @app.task()
    def unit(ctx: flowq.Context) -> dict[str, Any]:
        a = ctx.checkpoint("a", lambda: seen.append(1) or (1, 2))
        ctx.sleep(60)
        return {"a": a}

    assert run_step(unit) == {"a": [1, 2]} and seen == [1]
    with pytest.raises(flowq.Snooze):
        run_step(app.task(name="snoozy")(lambda ctx: (_ for _ in ()).throw(flowq.Snooze(1))))


def test_prune_deletes_a_runs_checkpoints(engine: sa.Engine, app: flowq.FlowQ) -> None:
    @app.task()
    def kept(ctx: flowq.Context) -> None:
        ctx.checkpoint("k", lambda: 1)

    run_id = enqueue(engine, kept)
    drain(engine, app)
    assert len(stored(engine, run_id)) == 1
    Pruner(engine, "flowq", retention=0.0, dead_retention=0.0).run_once()
    assert stored(engine, run_id) == [] and job_rows(engine) == []



def test_runs_show_and_the_dashboard_list_a_runs_checkpoints(
        engine: sa.Engine, db_url: str, app: flowq.FlowQ) -> None:
    @app.task()
    def shown(ctx: flowq.Context) -> None:
        ctx.checkpoint("fetch \x1b[31m<b>", lambda: {"rows": 3, "html": "<script>"})
        ctx.sleep(60)

    run_id = enqueue(engine, shown)
    drain(engine, app, skip_waits=False)
    text = CliRunner().invoke(main, ["runs", "show", str(run_id), "--database-url", db_url])
    assert text.exit_code == 0, text.output
    assert "checkpoints:" in text.output and "\x1b" not in text.output
    assert '#0 "fetch \\u001b[31m<b>": {"html": "<script>", "rows": 3}' in text.output
    assert '#1 "flowq.sleep.0": {"until": ' in text.output
    as_json = CliRunner().invoke(main, ["runs", "show", str(run_id), "--json",
                                        "--database-url", db_url])
    marks = json.loads(as_json.output)["checkpoints"]
    assert [(m["step"], m["map_index"], m["name"], m["position"]) for m in marks] == [
        ("shown", None, "fetch \x1b[31m<b>", 0), ("shown", None, "flowq.sleep.0", 1)]
    assert marks[0]["result"] == {"rows": 3, "html": "<script>"}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

        from flowq.dashboard import create_app
    page = TestClient(create_app(engine), base_url="http://127.0.0.1:8080").get(
        f"/runs/{run_id}")
    assert page.status_code == 200, page.text
    assert 'id="checkpoints"' in page.text and "flowq.sleep.0" in page.text
    assert "<script>" not in page.text and "&lt;script&gt;" in page.text


# -- async handlers: acheckpoint, asleep --------------------------------------------------------

def test_an_async_checkpoint_leaves_the_event_loop_to_the_other_handlers(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    import threading

    started, proceed = threading.Event(), threading.Event()

    def blocking() -> str:  # runs in a thread: the loop must serve `releaser` meanwhile
        started.set()
        assert proceed.wait(5), "the event loop was blocked by the checkpoint"
        return "done"

    @app.task(retry=ONCE)  # one attempt: a blocked loop fails it, never hidden by a retry
    async def holder(ctx: flowq.Context) -> str:
        return str(await ctx.acheckpoint("wait", blocking))

    @app.task()
    async def releaser(ctx: flowq.Context) -> None:
        import asyncio
        while not started.is_set():
            await asyncio.sleep(0.005)
        proceed.set()

    held, released = enqueue(engine, holder), enqueue(engine, releaser)
    with flowq.testing.running_worker(app, db_url, concurrency=2):
        flowq.testing.wait_until(lambda: all(r.status in ("succeeded", "dead")
                                             for r in job_rows(engine)),
                                 message="both handlers ended")
    assert {r.run_id: r.status for r in job_rows(engine)} == {held: "succeeded",
                                                               released: "succeeded"}
    assert stored(engine, held) == [("wait", 0, "done")]


def test_an_awaited_checkpoint_and_an_async_sleep_replay_once(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    calls: list[int] = []

    async def charge(amount: int) -> dict[str, int]:
        calls.append(amount)
        return {"charged": amount}

    @app.task()
    async def pay(ctx: flowq.Context, amount: int) -> dict[str, int]:
        receipt = await ctx.acheckpoint("charge", charge, amount)
        await ctx.asleep(0.01)  # the handler runs again after it: `charge` must not
        return dict(receipt)

    run_id = enqueue(engine, pay, amount=7)
    with flowq.testing.running_worker(app, db_url):
        flowq.testing.wait_until(lambda: [r.status for r in job_rows(engine)] == ["succeeded"],
                                 message="pay succeeded")
    assert calls == [7]
    assert [r.result for r in job_rows(engine)] == [{"charged": 7}]
    assert [name for name, _, _ in stored(engine, run_id)] == ["charge", "flowq.sleep.0"]


def test_an_async_checkpoint_function_cannot_take_a_session(engine: sa.Engine) -> None:
    app = flowq.FlowQ()

    async def writes(session: Any) -> None:
        pass

    @app.task()
    async def bad(ctx: flowq.Context) -> None:
        await ctx.acheckpoint("w", writes)

    with Session(engine) as session, pytest.raises(flowq.FlowqError, match="cannot take a session"):
        run_step(bad, session=session)
