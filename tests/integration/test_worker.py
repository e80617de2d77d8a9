"""The worker in-process against a real PostgreSQL: handlers, ctx, outcomes, queues, batching.

Most tests enqueue, then `run_until_idle` (a real worker that stops once no due job is left)
and assert on the rows. Tests that need the Worker object run it in a thread.
"""

from __future__ import annotations

import asyncio
import math
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from support import enqueue_id as enqueue
from support import scalar
from tenacity import stop_after_attempt, wait_fixed

import flowq
from flowq.db.runner import Rows
from flowq.durable.context import Context
from flowq.testing import job_rows, run_until_idle, running_worker, wait_until
from flowq.worker import Worker, WorkerConfig

ONE_TRY = flowq.Retry(stop=stop_after_attempt(1))


def only_row(engine: sa.Engine, where: str = "TRUE", **params: Any) -> Any:
    [r] = job_rows(engine, where=where, **params)
    return r




@pytest.fixture
def ledger(engine: sa.Engine) -> sa.Engine:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE ledger (job_id bigint, attempt int, note text)"))
    return engine


def ledger_rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM ledger ORDER BY job_id, attempt")))


# -- handlers and their context -----------------------------------------------------------


def test_sync_and_async_handlers_run(app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    @app.task()
    def add(ctx: Context, a: int, b: int) -> dict[str, int]:
        return {"sum": a + b}

    @app.task()
    async def shout(ctx: Context, word: str) -> str:
        await asyncio.sleep(0)
        return word.upper()

    enqueue(engine, add, a=2, b=3)
    enqueue(engine, shout, word="hi")
    run_until_idle(app, db_url)
    rows = {r.task: r for r in job_rows(engine)}
    assert rows["add"].status == "succeeded" and rows["add"].result == {"sum": 5}
    assert rows["shout"].status == "succeeded" and rows["shout"].result == "HI"
    assert all(r.attempts == 1 and r.finished_at is not None and r.locked_by is None
               for r in rows.values())


def test_ctx_identifies_the_job_and_its_attempt(app: flowq.FlowQ, engine: sa.Engine,
                                               db_url: str) -> None:
    seen: list[Context] = []
    pipe = app.pipeline("flow")

    @pipe.step(retry=flowq.Retry(wait=wait_fixed(0)))
    def first(ctx: Context, n: int) -> dict[str, int]:
        seen.append(ctx)
        if ctx.attempt == 1:
            raise RuntimeError("first try fails")
        return {"n": n}

    @pipe.step()
    def second(ctx: Context, n: int) -> None:
        seen.append(ctx)

    run_a = enqueue(engine, pipe, n=1)
    run_b = enqueue(engine, pipe, n=2)
    run_until_idle(app, db_url)

    def of(run: int, step: str) -> list[Context]:
        return [c for c in seen if c.run_id == run and c.step == step]

    a1, a2 = of(run_a, "first")
    assert (a1.attempt, a2.attempt) == (1, 2)
    assert a1.job_id == a2.job_id
    assert a1.idempotency_key == a2.idempotency_key  # stable across retries
    [a_second] = of(run_a, "second")
    [b_first, _] = of(run_b, "first")
    assert a_second.attempt == 1 and a_second.job_id != a1.job_id
    keys = {a1.idempotency_key, a_second.idempotency_key, b_first.idempotency_key}
    assert len(keys) == 3  # distinct across steps and runs
    rows = {(r.run_id, r.step): r for r in job_rows(engine)}
    assert rows[(run_a, "first")].id == a1.job_id and rows[(run_a, "first")].attempts == 2
    assert rows[(run_a, "second")].id == a_second.job_id
    assert all(r.status == "succeeded" for r in rows.values())
    assert a1.task == "flow" and a1.queue == "default"


def test_ctx_session_commits_with_success_and_rolls_back_on_failure(
        app: flowq.FlowQ, ledger: sa.Engine, db_url: str) -> None:
    @app.task(retry=flowq.Retry(wait=wait_fixed(0)))
    def book(ctx: Context, fail_first: bool) -> None:
        ctx.session.execute(sa.text("INSERT INTO ledger VALUES (:j, :a, 'x')"),
                            {"j": ctx.job_id, "a": ctx.attempt})
        if fail_first and ctx.attempt == 1:
            raise RuntimeError("after writing")

    ok = enqueue(ledger, book, fail_first=False)
    flaky = enqueue(ledger, book, fail_first=True)
    run_until_idle(app, db_url)
    assert all(r.status == "succeeded" for r in job_rows(ledger))
    assert [(r.job_id, r.attempt) for r in ledger_rows(ledger)] == [(ok, 1), (flaky, 2)]


def test_ctx_session_writes_roll_back_when_the_job_dies(app: flowq.FlowQ, ledger: sa.Engine,
                                                       db_url: str) -> None:
    @app.task(retry=ONE_TRY)
    def book(ctx: Context) -> None:
        ctx.session.execute(sa.text("INSERT INTO ledger VALUES (1, 1, 'x')"))
        raise ValueError("nope")

    enqueue(ledger, book)
    run_until_idle(app, db_url)
    assert only_row(ledger).status == "dead"
    assert ledger_rows(ledger) == []


def test_committing_ctx_session_fails_the_attempt(app: flowq.FlowQ, ledger: sa.Engine,
                                                  db_url: str) -> None:
    @app.task(retry=ONE_TRY)
    def sneaky(ctx: Context) -> None:
        ctx.session.execute(sa.text("INSERT INTO ledger VALUES (1, 1, 'x')"))
        ctx.session.commit()

    enqueue(ledger, sneaky)
    run_until_idle(app, db_url)
    row = only_row(ledger)
    assert row.status == "dead"
    assert row.last_error.startswith("ContextError: ctx.session is committed by flowq")
    assert "do not call commit()" in row.last_error
    assert ledger_rows(ledger) == []


def test_handler_without_ctx_session_opens_no_session(app: flowq.FlowQ, ledger: sa.Engine,
                                                     db_url: str) -> None:
    @app.task()
    def plain(ctx: Context) -> None:
        pass

    @app.task()
    def writer(ctx: Context) -> None:
        ctx.session.execute(sa.text("INSERT INTO ledger VALUES (1, 1, 'x')"))

    for _ in range(5):
        enqueue(ledger, plain)
    w = Worker(app, db_url, WorkerConfig(poll_interval=0.1, concurrency=4))
    checkouts: list[object] = []
    sa.event.listen(w.engines["session"], "checkout", lambda *a: checkouts.append(a))
    w.run(install_signals=False, until_idle=True)
    assert len(job_rows(ledger, where="status = 'succeeded'")) == 5
    assert checkouts == []

    enqueue(ledger, writer)
    w = Worker(app, db_url, WorkerConfig(poll_interval=0.1))
    sa.event.listen(w.engines["session"], "checkout", lambda *a: checkouts.append(a))
    w.run(install_signals=False, until_idle=True)
    assert len(checkouts) == 1  # the listener sees the one session that was used


# -- control flow and failures ----------------------------------------------------------


def test_retry_step_reschedules_without_sleeping(app: flowq.FlowQ, engine: sa.Engine,
                                                 db_url: str) -> None:
    @app.task()
    def later(ctx: Context) -> None:
        raise flowq.RetryStep(after=120, reason="not yet")

    enqueue(engine, later)
    run_until_idle(app, db_url)
    row = only_row(engine, "run_at > now() + interval '100 seconds'")
    assert (row.status, row.attempts) == ("pending", 1)
    assert row.last_error == "RetryStep: not yet"
    assert row.locked_by is None


def test_retry_step_ends_dead_at_the_attempt_cap(app: flowq.FlowQ, engine: sa.Engine,
                                                 db_url: str) -> None:
    calls: list[int] = []

    @app.task(retry=flowq.Retry(stop=stop_after_attempt(3)))
    def again(ctx: Context) -> None:
        calls.append(ctx.attempt)
        raise flowq.RetryStep()

    enqueue(engine, again)
    run_until_idle(app, db_url)
    row = only_row(engine)
    assert calls == [1, 2, 3]
    assert (row.status, row.attempts) == ("dead", 3)
    assert row.last_error.startswith("RetryStep")


def test_cancel_run_ends_the_job_cancelled(app: flowq.FlowQ, engine: sa.Engine,
                                           db_url: str) -> None:
    pipe = app.pipeline("p")

    @pipe.step()
    def first(ctx: Context) -> None:
        raise flowq.CancelRun("customer left")

    @pipe.step()
    def second(ctx: Context) -> None:  # pragma: no cover - must not run
        raise AssertionError("ran after CancelRun")

    enqueue(engine, pipe)
    run_until_idle(app, db_url)
    row = only_row(engine)  # no successor row
    assert (row.status, row.attempts) == ("cancelled", 1)
    assert row.last_error == "CancelRun: customer left"
    assert row.finished_at is not None


def test_exhausted_attempts_end_dead_with_the_error(app: flowq.FlowQ, engine: sa.Engine,
                                                   db_url: str) -> None:
    @app.task(retry=flowq.Retry(stop=stop_after_attempt(3), wait=wait_fixed(0)))
    def broken(ctx: Context) -> None:
        raise ValueError(f"bad input on attempt {ctx.attempt}")

    enqueue(engine, broken)
    run_until_idle(app, db_url)
    row = only_row(engine)
    assert (row.status, row.attempts) == ("dead", 3)
    assert row.last_error.startswith("ValueError: bad input on attempt 3")
    assert "Traceback" in row.last_error and "in broken" in row.last_error


def test_failure_schedules_the_retry_by_policy(app: flowq.FlowQ, engine: sa.Engine,
                                               db_url: str) -> None:
    @app.task(retry=flowq.Retry(wait=wait_fixed(300)))
    def flaky(ctx: Context) -> None:
        raise ConnectionError("reset")

    enqueue(engine, flaky)
    run_until_idle(app, db_url)
    row = only_row(engine, "run_at BETWEEN now() + interval '290 s' AND now() + interval '300 s'")
    assert (row.status, row.attempts) == ("pending", 1)
    assert row.last_error.startswith("ConnectionError: reset")


def test_step_timeout_frees_the_slot_while_the_stuck_thread_sleeps(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    release = threading.Event()
    stuck = threading.Event()
    ran_while_stuck: list[bool] = []

    @app.task(timeout=0.3, retry=ONE_TRY)
    def slow(ctx: Context) -> str:
        stuck.set()
        release.wait(30)
        return "late"

    @app.task()
    def quick(ctx: Context) -> None:
        ran_while_stuck.append(stuck.is_set() and not release.is_set())

    enqueue(engine, slow, priority=-1)  # claimed first, into the only slot
    enqueue(engine, quick)
    try:
        run_until_idle(app, db_url, concurrency=1)
    finally:
        release.set()
    rows = {r.task: r for r in job_rows(engine)}
    assert ran_while_stuck == [True]
    assert rows["quick"].status == "succeeded"
    assert rows["slow"].status == "dead"
    assert rows["slow"].last_error.startswith("StepTimeout: ")
    assert "exceeded its timeout" in rows["slow"].last_error


def test_async_step_timeout_fails_the_attempt(app: flowq.FlowQ, engine: sa.Engine,
                                              db_url: str) -> None:
    @app.task(timeout=0.2, retry=ONE_TRY)
    async def slow(ctx: Context) -> None:
        await asyncio.sleep(30)

    enqueue(engine, slow)
    run_until_idle(app, db_url)
    row = only_row(engine)
    assert row.status == "dead" and row.last_error.startswith("StepTimeout: ")


@pytest.mark.parametrize(("value", "reason"), [
    ({1, 2}, "builtins.set, which is not JSON"),
    (math.nan, "nan, which JSON cannot represent"),
    ({"s": "a\x00b"}, "NUL character"),
])
def test_non_json_result_fails_the_attempt_with_the_reason(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str, value: Any, reason: str) -> None:
    @app.task(retry=ONE_TRY)
    def weird(ctx: Context) -> Any:
        return value

    enqueue(engine, weird)
    run_until_idle(app, db_url)
    row = only_row(engine)
    assert row.status == "dead"
    assert row.last_error.startswith("InvalidResultError: step 'weird' returned a value")
    assert reason in row.last_error
    assert row.result is None


def test_unknown_task_is_retried_later_with_a_clear_error(app: flowq.FlowQ, engine: sa.Engine,
                                                         db_url: str) -> None:
    @app.task()
    def known(ctx: Context) -> None:
        pass

    enqueue(engine, "from_a_newer_producer", queue="default", x=1)
    run_until_idle(app, db_url, horizon=0)  # do not wait for the retry
    row = only_row(engine, "run_at > now()")
    assert (row.status, row.attempts) == ("pending", 1)
    assert row.last_error.startswith("UnknownTaskError: no task or pipeline named "
                                     "'from_a_newer_producer'")
    assert "retried" in row.last_error


def test_removed_step_ends_dead_with_the_mismatch_and_the_fix(app: flowq.FlowQ,
                                                             engine: sa.Engine,
                                                             db_url: str) -> None:
    """No live worker serves a definition with the step: never a silent wait (issue 23)."""
    pipe = app.pipeline("p")

    @pipe.step()
    def kept(ctx: Context) -> None:
        pass

    with engine.begin() as conn:  # a row written before a deploy removed its step
        conn.execute(sa.text("INSERT INTO flowq.jobs (task, step, step_index) "
                             "VALUES ('p', 'gone', 1)"))
    run_until_idle(app, db_url, horizon=0)
    row = only_row(engine)
    assert (row.status, row.attempts) == ("dead", 1)
    assert row.last_error.startswith("UnknownTaskError: run 1 (started under an unrecorded "
                                     "definition) cannot continue on this worker's pipeline "
                                     "'p' version 1 (")
    assert "step 'gone' was removed" in row.last_error
    assert "`flowq runs fork 1`" in row.last_error


# -- claiming ------------------------------------------------------------------------------


def test_worker_claims_only_its_queues(app: flowq.FlowQ, engine: sa.Engine,
                                       db_url: str) -> None:
    @app.task(queue="a")
    def on_a(ctx: Context) -> None:
        pass

    @app.task(queue="b")
    def on_b(ctx: Context) -> None:
        pass

    enqueue(engine, on_a)
    enqueue(engine, on_b)
    enqueue(engine, on_a, queue="c")
    run_until_idle(app, db_url, queues=["a"])
    assert {r.queue: r.status for r in job_rows(engine)} == {
        "a": "succeeded", "b": "pending", "c": "pending"}
    run_until_idle(app, db_url)  # default: every queue the app's tasks use (a and b)
    assert {r.queue: r.status for r in job_rows(engine)} == {
        "a": "succeeded", "b": "succeeded", "c": "pending"}


def test_jobs_run_in_priority_order(app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    order: list[int] = []

    @app.task()
    def job(ctx: Context, p: int) -> None:
        order.append(p)

    for p in (5, -3, 0, 10, -7):
        enqueue(engine, job, p=p, priority=p)
    run_until_idle(app, db_url, concurrency=1)
    assert order == [-7, -3, 0, 5, 10]


def test_future_jobs_are_not_claimed_early(app: flowq.FlowQ, engine: sa.Engine,
                                           db_url: str) -> None:
    @app.task()
    def job(ctx: Context) -> None:
        pass

    enqueue(engine, job, delay=3600)
    enqueue(engine, job)
    run_until_idle(app, db_url)
    assert sorted((r.status, r.attempts) for r in job_rows(engine)) == [
        ("pending", 0), ("succeeded", 1)]


def test_claims_are_batched(app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    @app.task()
    def job(ctx: Context, n: int) -> None:
        pass

    with engine.begin() as conn:
        flowq.enqueue_many(conn, job, [{"n": n} for n in range(100)])
    w = Worker(app, db_url, WorkerConfig(poll_interval=0.1, concurrency=8))
    w.run(install_signals=False, until_idle=True)
    assert w.claimed == 100
    assert len(job_rows(engine, where="status = 'succeeded'")) == 100
    # One statement per job is the slow path; claims wait for a batch of free slots.
    claims = w.claim_conn.statements
    assert claims <= 40, f"{claims} claim statements for 100 jobs"


def test_running_worker_wakes_on_notify_and_stops_cleanly(app: flowq.FlowQ, engine: sa.Engine,
                                                          db_url: str) -> None:
    @app.task()
    def job(ctx: Context) -> None:
        pass

    # A long poll interval: only the NOTIFY sent at commit can wake the worker in time.
    with running_worker(app, db_url, poll_interval=60.0) as w:
        assert w.listener is not None
        wait_until(w.listener.connected.is_set, 10, message="LISTEN connection")
        before = w.claimed
        enqueue(engine, job)
        wait_until(lambda: job_rows(engine, where="status = 'succeeded'"), 10,
                   message="the notified job to succeed")
        assert w.claimed == before + 1
    assert job_rows(engine, where="status = 'running'") == []


def test_stop_releases_unfinished_jobs_without_burning_the_attempt(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    release = threading.Event()
    started = threading.Event()

    @app.task()
    def hold(ctx: Context) -> None:
        started.set()
        release.wait(30)

    enqueue(engine, hold)
    try:
        with running_worker(app, db_url, shutdown_grace=0.2):
            wait_until(started.is_set, 10, message="the handler to start")
    finally:
        release.set()
    row = only_row(engine)
    assert (row.status, row.attempts, row.locked_by) == ("pending", 0, None)


# -- fencing in-process: a slow handler that lost its claim changes nothing ---------------


def test_timed_out_handler_session_writes_roll_back(app: flowq.FlowQ, ledger: sa.Engine,
                                                    db_url: str) -> None:
    release = threading.Event()
    finished = threading.Event()

    @app.task(timeout=0.3, retry=ONE_TRY)
    def slow(ctx: Context) -> None:
        try:
            ctx.session.execute(sa.text("INSERT INTO ledger VALUES (:j, 1, 'late')"),
                                {"j": ctx.job_id})
            release.wait(30)
        finally:
            finished.set()

    enqueue(ledger, slow)
    with running_worker(app, db_url, concurrency=1, maintenance=False):
        wait_until(lambda: job_rows(ledger, where="status = 'dead'"), 10,
                   message="the timed-out job to die")
        release.set()
        wait_until(finished.is_set, 10, message="the stuck handler to return")
    assert ledger_rows(ledger) == []
    assert only_row(ledger).last_error.startswith("StepTimeout")


def test_reaped_handler_cannot_complete_and_its_writes_roll_back(
        app: flowq.FlowQ, ledger: sa.Engine, db_url: str) -> None:
    from flowq.worker.reaper import Reaper

    release = threading.Event()
    first_started = threading.Event()

    @app.task()
    def pay(ctx: Context) -> str:
        ctx.session.execute(sa.text("INSERT INTO ledger VALUES (:j, :a, 'paid')"),
                            {"j": ctx.job_id, "a": ctx.attempt})
        if ctx.attempt == 1:
            first_started.set()
            release.wait(30)  # a zombie: presumed dead by the reaper meanwhile
        return f"attempt {ctx.attempt}"

    job_id = enqueue(ledger, pay)
    # No heartbeat during the test: it could refresh the row between our UPDATE and the reap.
    with running_worker(app, db_url, concurrency=2, maintenance=False,
                        heartbeat_interval=60, stale_after=121) as w:
        wait_until(first_started.is_set, 10, message="attempt 1 to start")
        with ledger.begin() as conn:
            conn.execute(sa.text("UPDATE flowq.jobs SET heartbeat_at = now() - interval '1 h'"))
            # and its worker's entry: the worker looks dead (its beat keeps either alive)
            conn.execute(sa.text("UPDATE flowq.workers SET heartbeat_at = now() - "
                                 "interval '1 h'"))
        assert Reaper(ledger, "flowq", stale_after=30).run_once() == 1
        wait_until(lambda: job_rows(ledger, where="status = 'succeeded'"), 10,
                   message="attempt 2 to succeed in the other slot")
        release.set()
        wait_until(lambda: w.executor.in_flight == 0, 10, message="the zombie to settle")
        w.completer.flush(10)
    row = only_row(ledger)
    assert (row.status, row.attempts, row.result) == ("succeeded", 2, "attempt 2")
    assert [(r.job_id, r.attempt) for r in ledger_rows(ledger)] == [(job_id, 2)]


def test_cancel_requested_while_running_creates_no_successor(app: flowq.FlowQ,
                                                             engine: sa.Engine,
                                                             db_url: str) -> None:
    release = threading.Event()
    started = threading.Event()
    pipe = app.pipeline("p")

    @pipe.step()
    def first(ctx: Context) -> dict[str, int]:
        started.set()
        release.wait(30)
        return {"n": 1}

    @pipe.step()
    def second(ctx: Context, n: int) -> None:  # pragma: no cover - must not run
        raise AssertionError("ran after cancel")

    enqueue(engine, pipe)
    with running_worker(app, db_url, maintenance=False) as w:
        wait_until(started.is_set, 10, message="the step to start")
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE flowq.jobs SET cancel_requested = true"))
        release.set()
        wait_until(lambda: w.executor.in_flight == 0, 10, message="the step to finish")
        w.completer.flush(10)
    row = only_row(engine)  # no row for the second step
    assert row.step == "first" and row.status == "succeeded"


def test_async_handler_can_use_ctx_session(app: flowq.FlowQ, ledger: sa.Engine,
                                           db_url: str) -> None:
    @app.task()
    async def book(ctx: Context) -> None:
        ctx.session.execute(sa.text("INSERT INTO ledger VALUES (:j, :a, 'async')"),
                            {"j": ctx.job_id, "a": ctx.attempt})

    job_id = enqueue(ledger, book)
    run_until_idle(app, db_url)
    assert only_row(ledger).status == "succeeded"
    assert [(r.job_id, r.note) for r in ledger_rows(ledger)] == [(job_id, "async")]


def test_a_stalled_completer_throttles_claiming(app: flowq.FlowQ, engine: sa.Engine,
                                                db_url: str) -> None:
    """Outcomes the completer cannot write yet are claims still held: the worker stops claiming
    instead of turning the whole backlog into `running` rows that all need heartbeats."""
    @app.task()
    def quick(ctx: Context) -> None:
        pass

    with engine.begin() as conn:
        flowq.enqueue_many(conn, quick, [{} for _ in range(200)])
    w = Worker(app, db_url, WorkerConfig(poll_interval=0.05, concurrency=4, shutdown_grace=5))
    gate = threading.Event()
    send = w.completer.store.run

    def stalled(statement: Any, params: Any) -> Rows:
        gate.wait(30)
        return send(statement, params)

    w.completer.store.run = stalled
    t = threading.Thread(target=w.run, kwargs={"install_signals": False}, daemon=True)
    t.start()
    try:
        wait_until(lambda: w.completer.queued >= 8, 10, message="outcomes to pile up")
        for _ in range(10):  # give the claim loop every chance to over-claim
            w.producer.wake()
            threading.Event().wait(0.05)
        running = len(job_rows(engine, where="status = 'running'"))
        # in flight (4) + queued (up to 2 x 4) + the batch stuck in the write (up to 2 x 4)
        assert 8 <= running <= 20
    finally:
        gate.set()
    wait_until(lambda: len(job_rows(engine, where="status = 'succeeded'")) == 200, 30,
               message="the backlog to drain once the completer recovers")
    w.stop()
    t.join(30)
    assert not t.is_alive()


def test_connection_settings_of_each_role(app: flowq.FlowQ, db_url: str) -> None:
    """Hot-path connections never seq-scan and plan every execution, and a claim or completion
    that runs away is cancelled after minutes (and sent again) rather than wedging the worker;
    maintenance passes are cancelled after 30 s, rather than holding their locks."""
    @app.task()
    def noop(ctx: Context) -> None:
        pass

    w = Worker(app, db_url, WorkerConfig())
    try:
        settings = "SELECT current_setting('enable_seqscan'), current_setting('plan_cache_mode'), " \
                   "current_setting('statement_timeout'), current_setting('jit')"
        assert w.claim_conn.execute(sa.text(settings), {}) == [
            ("off", "force_custom_plan", "5min", "off")]
        with w.engines["maintain"].connect() as conn:
            assert tuple(conn.execute(sa.text(settings)).one()) == ("off", "auto", "30s", "off")
    finally:
        w.claim_conn.close()
        for engine in w.engines.values():
            engine.dispose()


def test_a_prune_waiting_on_a_lock_does_not_delay_heartbeats(app: flowq.FlowQ,
                                                             engine: sa.Engine,
                                                             db_url: str) -> None:
    """The pruner waits on a row lock (here: an operator's SELECT ... FOR UPDATE) for up to its
    statement timeout; the heartbeat has its own thread and connection, so the live job is
    not reaped meanwhile (issue 9, #12)."""
    import time

    from flowq.worker.reaper import Reaper

    @app.task()
    def hold(ctx: Context, seconds: float) -> None:
        time.sleep(seconds)

    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO flowq.jobs (task, step, status, finished_at) "
                             "VALUES ('old', 'old', 'succeeded', now() - interval '10 days')"))
    job = enqueue(engine, hold, seconds=10)
    reaper = Reaper(engine, "flowq", stale_after=2.0)
    with engine.connect() as blocker, running_worker(
            app, db_url, heartbeat_interval=0.5, stale_after=2.0, prune_interval=0.5,
            retention=60.0, reap_interval=60.0):
        blocker.execute(sa.text("SELECT id FROM flowq.job_history WHERE task = 'old' FOR UPDATE"))
        wait_until(lambda: only_row(engine, "id = :id", id=job).status == "running",
                   timeout=10, message="the job to start")
        # A fresh transaction per look: pg_stat_activity is a snapshot taken once per
        # transaction, so one open transaction would never see the pruner start waiting.
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM pg_stat_activity "
                                          "WHERE wait_event_type = 'Lock' "
                                          "AND application_name LIKE 'flowq maintain%'"),
                   timeout=15, message="the pruner to wait on the lock")
        reaped = 0
        deadline = time.monotonic() + 4.0  # two stale periods while the pruner is stuck
        while time.monotonic() < deadline:
            reaped += reaper.run_once()
            time.sleep(0.25)
        blocker.rollback()
        assert reaped == 0
        wait_until(lambda: only_row(engine, "id = :id", id=job).status == "succeeded",
                   timeout=20, message="the job to finish")
    assert only_row(engine, "id = :id", id=job).attempts == 1


def test_a_worker_warns_at_start_of_its_tasks_stranded_on_other_queues(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Enqueued by name with a queue none of the app's steps uses, a job would wait forever:
    the worker says so when it starts (issue 10)."""
    import logging

    @app.task(queue="fast")
    def fast(ctx: Context, n: int) -> None: ...

    with engine.begin() as conn:
        flowq.enqueue(conn, "fast", queue="default", n=21)  # the producer guessed wrong
        flowq.enqueue(conn, fast, n=1)  # on its own queue: not stranded
    w = Worker(app, db_url, WorkerConfig())
    try:
        with caplog.at_level(logging.WARNING, logger="flowq"):
            assert w.warn_stranded() == 1
    finally:
        for e in w.engines.values():
            e.dispose()
    [line] = [r.getMessage() for r in caplog.records if "no worker of this app" in r.getMessage()]
    assert "queue=default" in line and "task=fast" in line and "jobs=1" in line


@pytest.mark.parametrize("driver", ["postgresql+asyncpg", "postgresql+psycopg2", "postgres"])
def test_a_worker_takes_the_url_an_app_already_has(app: flowq.FlowQ, engine: sa.Engine,
                                                   db_url: str, driver: str) -> None:
    """FastAPI apps keep a `postgresql+asyncpg://` DATABASE_URL; the worker uses psycopg for its
    own connections whatever driver the URL names (issue 10)."""
    @app.task()
    def ping(ctx: Context) -> dict[str, bool]:
        ctx.session.execute(sa.text("SELECT 1"))
        return {"pong": True}

    job = enqueue(engine, ping)
    run_until_idle(app, sa.make_url(db_url).set(drivername=driver).render_as_string(
        hide_password=False))
    assert only_row(engine, "run_id = :r", r=job).result == {"pong": True}


def test_a_worker_registers_beats_and_leaves_the_registry(app: flowq.FlowQ, engine: sa.Engine,
                                                          db_url: str) -> None:
    """`flowq.workers` says who serves what; a crashed worker's entry expires, and a worker
    whose entry expired while it stalled enters again (issue 10: unserved jobs)."""
    from flowq.worker.registry import WorkerExpirer

    @app.task(queue="reg")
    def noop(ctx: Context) -> None: ...

    def entries() -> list[Any]:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(
                "SELECT name, queues, tasks, concurrency, pid FROM flowq.workers")))

    with engine.begin() as conn:  # a worker that crashed long ago
        conn.execute(sa.text(
            "INSERT INTO flowq.workers (name, host, pid, queues, tasks, concurrency, version, "
            "heartbeat_at) VALUES ('dead', 'h', 1, '{reg}', '{noop}', 1, 'x', "
            "now() - interval '1 hour')"))
    with running_worker(app, db_url, heartbeat_interval=0.2, stale_after=1.0) as w:
        mine = wait_until(lambda: [e for e in entries() if e.name == w.config.name],
                          timeout=10, message="the worker's entry")
        assert (mine[0].queues, mine[0].tasks, mine[0].concurrency) == (["reg"], ["noop"], 10)
        WorkerExpirer(engine, "flowq", stale=2.0).run_once()  # or the worker's own
        assert [e.name for e in entries()] == [w.config.name]  # the dead one expired
        with engine.begin() as conn:  # as if it stalled past the expiry
            conn.execute(sa.text("DELETE FROM flowq.workers"))
        wait_until(lambda: [e.name for e in entries()] == [w.config.name], timeout=10,
                   message="the worker to enter the registry again")
    assert entries() == []  # a clean stop leaves it


def test_a_worker_refuses_a_schema_behind_its_revision(app: flowq.FlowQ, engine: sa.Engine,
                                                       db_url: str) -> None:
    from flowq.db.migrations import HEAD_REVISION, downgrade

    @app.task()
    def noop(ctx: Context) -> None: ...

    downgrade(engine, revision="0002")
    w = Worker(app, db_url, WorkerConfig())
    try:
        with pytest.raises(flowq.SchemaMissingError,
                           match=f"is at revision 0002, and this flowq needs {HEAD_REVISION}: "
                                 "run `flowq migrate` first"):
            w.check_database()
    finally:
        for e in w.engines.values():
            e.dispose()


def test_an_abandoned_attempt_releases_its_row_locks_at_once(app: flowq.FlowQ,
                                                              engine: sa.Engine,
                                                              db_url: str) -> None:
    """Attempt 1 updates a row through ctx.session, then hangs past its timeout. Its open
    transaction is ended when it is abandoned, so attempt 2 is not blocked on its row lock
    (it used to be, until every attempt timed out and the job ended dead; review finding 2)."""
    import time

    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE counter (id int PRIMARY KEY, n int)"))
        conn.execute(sa.text("INSERT INTO counter VALUES (1, 0)"))

    @app.task(retry=flowq.Retry(stop=stop_after_attempt(3), wait=wait_fixed(0)), timeout=1.0)
    def bump(ctx: Context) -> None:
        ctx.session.execute(sa.text("UPDATE counter SET n = n + 1 WHERE id = 1"))
        if ctx.attempt == 1:
            time.sleep(15)  # holds the row lock, unless its transaction is ended

    job = enqueue(engine, bump)
    with running_worker(app, db_url):
        wait_until(lambda: only_row(engine, "run_id = :r", r=job).status != "pending"
                   and only_row(engine, "run_id = :r", r=job).status != "running",
                   timeout=20, message="the job to end")
    row = only_row(engine, "run_id = :r", r=job)
    assert (row.status, row.attempts) == ("succeeded", 2), row.last_error
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT n FROM counter")).scalar() == 1


@pytest.mark.parametrize("knob", ["poll_interval", "heartbeat_interval", "stale_after",
                                  "shutdown_grace", "retention"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_worker_settings_must_be_finite(knob: str, value: float) -> None:
    config = WorkerConfig(**{knob: value})  # type: ignore[arg-type]
    with pytest.raises(flowq.ConfigurationError, match=knob):
        config.validate()


def test_a_beat_that_writes_no_job_still_tells_the_handler_it_was_cancelled(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    """With only this release's workers registered, a beat writes the worker's entry and only
    reads the jobs: the handler still learns of the cancellation at the next beat, and the
    reaper leaves the job alone however old its own heartbeat."""
    from flowq.ops.runs import cancel_run
    from flowq.worker.reaper import Reaper

    started, saw = threading.Event(), threading.Event()

    @app.task()
    def long(ctx: Context) -> None:
        started.set()
        wait_until(lambda: ctx.cancelled, timeout=30, interval=0.02, message="ctx.cancelled")
        saw.set()

    run_id = enqueue(engine, long)
    with running_worker(app, db_url, heartbeat_interval=0.1, stale_after=1.0,
                        maintenance=False):
        assert started.wait(30)
        with engine.begin() as conn:  # as a long job's own heartbeat is: its claim's
            conn.execute(sa.text("UPDATE flowq.jobs SET heartbeat_at = now() - interval '1 h'"))
        since = scalar(engine, "SELECT clock_timestamp()")
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM flowq.workers WHERE "
                                  "heartbeat_at > :t", t=since), timeout=10,
                   message="a beat since")  # the beats go on: none writes the job
        assert only_row(engine).heartbeat_at < datetime.now(UTC) - timedelta(minutes=30)
        assert Reaper(engine, "flowq", stale_after=1.0).run_once() == 0
        cancel_run(engine, run_id)
        assert saw.wait(10)
        wait_until(lambda: job_rows(engine, where="status <> 'running'"), timeout=10,
                   message="the job to end")
