"""flowq.wait_run / await_run / get_result: woken by the run-end notification, the poll as
the fallback, against a real PostgreSQL.

Runs are completed by the test kit's `drain` in a transaction of the test's own (so the test
decides when the run's end commits) or by an in-process worker. Whether a waiter was woken
by a notification is read from counters (`RunEndListener.notified`, the reads a waiter
made), never from a clock.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from support import enqueue_id as enqueue

import flowq
from flowq.db.schema import run_end_channel
from flowq.durable.context import Context
from flowq.ops import results, waiters
from flowq.ops.results import RunEndListener
from flowq.testing import drain, run_until_idle, wait_until

app = flowq.FlowQ()


@app.task()
def double(ctx: Context, n: int) -> dict[str, int]:
    return {"n": 2 * n}


@app.task(retry=flowq.Retry(max_attempts=1))
def explode(ctx: Context) -> None:
    raise RuntimeError("boom\nsecond line")


chain = app.pipeline("results_chain")


@chain.step()
def first(ctx: Context, n: int) -> dict[str, int]:
    return {"n": n + 1}


@chain.step()
def second(ctx: Context, n: int) -> dict[str, int]:
    return {"total": n * 10}


started, go = threading.Event(), threading.Event()


@app.task()
def nap(ctx: Context) -> None:
    started.set()
    go.wait(30)
    ctx.sleep(3600)  # its run was cancelled meanwhile: the job ends cancelled here


class Reads:
    """Counts the reads of runs `flowq.ops.results` makes (wraps its `read_run`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = results.read_run

        def counted(*args: Any, **kwargs: Any) -> Any:
            found = real(*args, **kwargs)
            self.count += 1
            return found

        monkeypatch.setattr(results, "read_run", counted)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    return Reads(monkeypatch)


@pytest.fixture
def slow_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fallback poll (and a re-read after registering) so rare that a waiter that returns
    was woken by its notification."""
    monkeypatch.setattr(results, "FALLBACK_POLL", 600.0)
    monkeypatch.setattr(results, "RECHECK", 600.0)


@pytest.fixture
def listener(engine: sa.Engine) -> Iterator[RunEndListener]:
    found = RunEndListener.shared(engine)
    yield found
    found.close()


def waiting(target: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = target(*args, **kwargs)
        except BaseException as exc:  # reported by the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_wait_run_is_woken_by_the_run_end_notification(
        engine: sa.Engine, reads: Reads, slow_poll: None, listener: RunEndListener) -> None:
    run_id = enqueue(engine, double, n=21)
    thread, out = waiting(flowq.wait_run, engine, run_id, timeout=120)
    wait_until(lambda: reads.count == 1, message="the waiter's first read")
    assert listener.up
    before = listener.notified
    with engine.begin() as conn:
        assert drain(conn, app).succeeded == 1
    thread.join(timeout=120)
    assert "error" not in out, out
    run = out["value"]
    assert run.status == "succeeded" and run.result == {"n": 42}
    # Woken by the notification (the poll comes every 600 s), then one read decided it.
    assert listener.notified == before + 1
    assert reads.count == 2


def test_one_listen_connection_serves_every_waiter_of_the_process(
        engine: sa.Engine, reads: Reads, slow_poll: None, listener: RunEndListener) -> None:
    run_ids = [enqueue(engine, double, n=i) for i in range(5)]
    waiters = [waiting(flowq.wait_run, engine, r, timeout=120) for r in run_ids]
    wait_until(lambda: reads.count == 5, message="every waiter's first read")
    with engine.connect() as conn:
        listening = conn.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'flowq wait_run' "
            "AND datname = current_database()")).scalar()
    assert listening == 1
    before = listener.notified
    with engine.begin() as conn:
        drain(conn, app)  # one transaction: the runs end together
    for thread, out in waiters:
        thread.join(timeout=120)
        assert out["value"].status == "succeeded", out
    assert sorted(out["value"].result["n"] for _, out in waiters) == [0, 2, 4, 6, 8]
    assert listener.notified == before + 5


def test_a_pipeline_wakes_its_waiter_at_its_last_step_only(
        engine: sa.Engine, db_url: str, reads: Reads, slow_poll: None,
        listener: RunEndListener) -> None:
    run_id = enqueue(engine, chain, n=1)
    thread, out = waiting(flowq.wait_run, engine, run_id, timeout=120)
    wait_until(lambda: reads.count == 1, message="the waiter's first read")
    run_until_idle(app, db_url)
    thread.join(timeout=120)
    assert out["value"].status == "succeeded" and out["value"].result == {"total": 20}
    # The first step's success created the second: it named no ended run.
    assert reads.count == 2


def test_await_run_is_woken_by_the_notification(
        engine: sa.Engine, reads: Reads, slow_poll: None, listener: RunEndListener) -> None:
    run_id = enqueue(engine, double, n=5)

    async def main() -> Any:
        task = asyncio.create_task(flowq.await_run(engine, run_id, timeout=120))
        while reads.count < 1:
            await asyncio.sleep(0.01)
        before = listener.notified
        with engine.begin() as conn:
            drain(conn, app)
        run = await task
        return run, listener.notified - before

    run, woken = asyncio.run(main())
    assert run.status == "succeeded" and run.result == {"n": 10}
    assert woken == 1 and reads.count == 2


def test_a_dead_run_wakes_its_waiter_and_get_result_says_why(
        engine: sa.Engine, reads: Reads, slow_poll: None, listener: RunEndListener) -> None:
    run_id = enqueue(engine, explode)
    thread, out = waiting(flowq.wait_run, engine, run_id, timeout=120)
    wait_until(lambda: reads.count == 1, message="the waiter's first read")
    with engine.begin() as conn:
        assert drain(conn, app, raise_on_dead=False).dead == 1
    thread.join(timeout=120)
    assert out["value"].status == "dead"
    with pytest.raises(flowq.RunStateError) as caught:
        flowq.get_result(engine, run_id)
    message = str(caught.value)
    assert f"run {run_id} is dead" in message and "'explode'" in message
    assert "RuntimeError: boom" in message and "second line" not in message
    assert f"flowq runs retry {run_id}" in message


def test_cancelling_a_run_wakes_its_waiter(
        engine: sa.Engine, reads: Reads, slow_poll: None, listener: RunEndListener) -> None:
    run_id = enqueue(engine, double, n=1)
    thread, out = waiting(flowq.wait_run, engine, run_id, timeout=120)
    wait_until(lambda: reads.count == 1, message="the waiter's first read")
    before = listener.notified
    flowq.runs.cancel_run(engine, run_id)
    thread.join(timeout=120)
    assert out["value"].status == "cancelled"
    assert listener.notified == before + 1
    with pytest.raises(flowq.RunStateError, match="was cancelled, so it has no result"):
        flowq.get_result(engine, run_id)


def test_get_result(engine: sa.Engine) -> None:
    run_id = enqueue(engine, double, n=4)
    with pytest.raises(flowq.RunStateError) as caught:
        flowq.get_result(engine, run_id)
    assert "has no result yet: it is pending" in str(caught.value)
    assert f"flowq.wait_run(engine, {run_id}" in str(caught.value)
    with engine.begin() as conn:
        drain(conn, app)
    assert flowq.get_result(engine, run_id) == {"n": 8}
    with engine.connect() as conn:  # a Connection works as well
        assert flowq.get_result(conn, run_id) == {"n": 8}
    with pytest.raises(flowq.RunNotFoundError, match="no run 999999 exists"):
        flowq.get_result(engine, 999999)


def test_wait_run_polls_when_listen_is_unavailable(
        engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, reads: Reads) -> None:
    def refused(conninfo: str) -> psycopg.Connection[Any]:
        raise psycopg.OperationalError("LISTEN is not available here (transaction pooling)")

    monkeypatch.setattr(waiters, "listener_connection", refused)
    run_id = enqueue(engine, double, n=3)
    thread, out = waiting(flowq.wait_run, engine, run_id, timeout=120)
    wait_until(lambda: reads.count >= 1, message="the waiter's first read")
    with engine.begin() as conn:
        drain(conn, app)
    thread.join(timeout=120)
    assert out["value"].result == {"n": 6}
    listener = RunEndListener.shared(engine)
    assert not listener.up and listener.notified == 0
    assert reads.count >= 2  # found by a poll


def test_wait_run_polls_when_listen_hears_nothing(
        engine: sa.Engine, db_url: str, server_url: str, monkeypatch: pytest.MonkeyPatch,
        reads: Reads) -> None:
    """PgBouncer in transaction mode accepts a LISTEN and never delivers: a listener on
    another database stands for it. The fallback poll still returns the run."""
    from flowq.db.urls import normalize_url, to_conninfo

    deaf = to_conninfo(normalize_url(server_url))
    monkeypatch.setattr(waiters, "listener_connection",
                        lambda conninfo: psycopg.connect(deaf, autocommit=True))
    monkeypatch.setattr(results, "FALLBACK_POLL", 0.2)
    run_id = enqueue(engine, double, n=7)
    thread, out = waiting(flowq.wait_run, engine, run_id, timeout=120)
    wait_until(lambda: reads.count >= 1, message="the waiter's first read")
    with engine.begin() as conn:
        drain(conn, app)
    thread.join(timeout=120)
    listener = RunEndListener.shared(engine)
    try:
        assert out["value"].result == {"n": 14}
        assert listener.up and listener.notified == 0
    finally:
        listener.close()


def test_listen_false_only_polls(engine: sa.Engine) -> None:
    run_id = enqueue(engine, double, n=1)
    with engine.begin() as conn:
        drain(conn, app)
    assert flowq.wait_run(engine, run_id, timeout=5, listen=False).result == {"n": 2}


@pytest.mark.parametrize("timeout", [math.nan, -1, -0.001, True, "5", [1]])
def test_hostile_timeouts_are_refused(engine: sa.Engine, timeout: Any) -> None:
    run_id = enqueue(engine, double, n=1)
    with pytest.raises(flowq.InvalidArgumentsError, match="timeout must be"):
        flowq.wait_run(engine, run_id, timeout=timeout)
    with pytest.raises(flowq.InvalidArgumentsError, match="timeout must be"):
        asyncio.run(flowq.await_run(engine, run_id, timeout=timeout))


def test_a_timeout_of_zero_looks_once_and_infinity_is_no_limit(engine: sa.Engine) -> None:
    run_id = enqueue(engine, double, n=1)
    with pytest.raises(TimeoutError, match=f"run {run_id} is still pending after 0s"):
        flowq.wait_run(engine, run_id, timeout=0)
    with pytest.raises(TimeoutError):
        asyncio.run(flowq.await_run(engine, run_id, timeout=0.01))
    assert registrations(engine) == []  # a wait that timed out left nothing behind
    with engine.begin() as conn:
        drain(conn, app)
    assert flowq.wait_run(engine, run_id, timeout=math.inf).status == "succeeded"
    assert flowq.wait_run(engine, run_id, timeout=0).status == "succeeded"


@pytest.mark.parametrize("run_id", [424242, 2**70, 0, -1, True, "1"])
def test_a_run_that_does_not_exist_is_a_clear_error(engine: sa.Engine, run_id: Any) -> None:
    with pytest.raises(flowq.RunNotFoundError):
        flowq.wait_run(engine, run_id, timeout=1)
    with pytest.raises(flowq.RunNotFoundError):
        asyncio.run(flowq.await_run(engine, run_id, timeout=1))
    assert registrations(engine) == []


def test_the_run_end_channel_fits_any_schema_name() -> None:
    assert run_end_channel("flowq") == "flowq:runs"
    long = "s" * 63
    channel = run_end_channel(long)
    assert len(channel) <= 63 and channel.startswith("flowq:runs:")
    assert channel != run_end_channel("t" * 63)


def test_an_overlong_batch_names_no_run_and_wakes_every_waiter(
        engine: sa.Engine, reads: Reads, slow_poll: None, listener: RunEndListener) -> None:
    """A notification whose payload is not a list of ids (an overlong batch sends '') wakes
    every waiter of its channel, which reads its run again."""
    run_id = enqueue(engine, double, n=1)
    thread, out = waiting(flowq.wait_run, engine, run_id, timeout=120)
    wait_until(lambda: reads.count == 1, message="the waiter's first read")
    with engine.begin() as conn:
        drain(conn, app)
    thread.join(timeout=120)
    run_id = enqueue(engine, double, n=2)
    thread, out = waiting(flowq.wait_run, engine, run_id, timeout=120)
    wait_until(lambda: reads.count == 3, message="the second waiter's first read")
    before = listener.notified
    for n, payload in enumerate(["", "\u00b2,1", "x" * 7000], 1):  # and hostile ones
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_notify(:c, :p)"),
                         {"c": run_end_channel("flowq"), "p": payload})
            conn.commit()
        wait_until(lambda n=n: reads.count == 3 + n, message=f"a read after {payload[:9]!r}")
        assert listener.notified == before + n and listener.up
    with engine.begin() as conn:
        drain(conn, app)
    thread.join(timeout=120)
    assert out["value"].status == "succeeded"


def registrations(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT run_id FROM flowq.run_waiters")).scalars())


def test_only_a_run_somebody_waits_for_is_announced(engine: sa.Engine) -> None:
    """A completion notifies the run-end channel only for runs a waiter registered: a run
    nobody waits for costs no NOTIFY (whose commit queues on a database-wide lock)."""
    awaited = enqueue(engine, double, n=1)
    enqueue(engine, double, n=2)  # nobody waits for this one
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO flowq.run_waiters (run_id, token, pid) "
                             "VALUES (:r, 't', pg_backend_pid())"), {"r": awaited})
    with psycopg.connect(engine.url.render_as_string(hide_password=False).replace(
            "postgresql+psycopg", "postgresql"), autocommit=True) as ear:
        ear.execute(f'LISTEN "{run_end_channel("flowq")}"')
        with engine.begin() as conn:
            assert drain(conn, app).succeeded == 2
        heard = [n.payload for n in ear.notifies(timeout=2, stop_after=1)]
    assert heard == [str(awaited)]


def test_a_waiter_registers_and_deletes_its_registration(
        engine: sa.Engine, reads: Reads, slow_poll: None, listener: RunEndListener) -> None:
    run_id = enqueue(engine, double, n=4)
    thread, out = waiting(flowq.wait_run, engine, run_id, timeout=120)
    wait_until(lambda: reads.count == 1, message="the waiter's first read")
    assert registrations(engine) == [run_id]
    with engine.begin() as conn:
        drain(conn, app)
    thread.join(timeout=120)
    assert out["value"].result == {"n": 8}
    assert registrations(engine) == []


def test_a_run_ended_by_a_statement_begun_before_the_registration_is_read_again(
        engine: sa.Engine, reads: Reads, monkeypatch: pytest.MonkeyPatch,
        listener: RunEndListener) -> None:
    """A completion whose statement began before the waiter registered sends nothing: the
    waiter's re-read `RECHECK` after registering finds the run (not the fallback poll)."""
    monkeypatch.setattr(results, "FALLBACK_POLL", 600.0)
    monkeypatch.setattr(results, "RECHECK", 1.0)
    run_id = enqueue(engine, double, n=5)
    with engine.begin() as conn:
        assert drain(conn, app).succeeded == 1  # completed, not yet committed
        thread, out = waiting(flowq.wait_run, engine, run_id, timeout=120)
        wait_until(lambda: reads.count == 1, message="the waiter's first read")
    thread.join(timeout=120)
    assert out["value"].result == {"n": 10}
    assert reads.count == 2 and listener.notified == 0


def test_the_pruner_deletes_registrations_whose_connection_is_gone(
        engine: sa.Engine) -> None:
    from flowq.worker.pruner import Pruner

    with engine.connect() as conn:
        conn.execute(sa.text("INSERT INTO flowq.run_waiters (run_id, token, pid) VALUES "
                             "(1, 'gone', 2147483647), (2, 'here', pg_backend_pid())"))
        conn.commit()
        # ours is alive while this connection is: the pruner runs on another one
        Pruner(engine, "flowq").run_once()
        assert conn.execute(sa.text(
            "SELECT token FROM flowq.run_waiters ORDER BY token")).scalars().all() == ["here"]


def terminate(engine: sa.Engine, application_name: str) -> int:
    """pg_terminate_backend every connection of `application_name` to this database."""
    with engine.connect() as conn:
        killed = conn.execute(sa.text(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = :a AND datname = current_database()"),
            {"a": application_name}).scalar()
        conn.commit()
    return int(killed or 0)


def test_a_waiter_whose_connections_are_terminated_registers_again_and_is_woken(
        engine: sa.Engine, reads: Reads, slow_poll: None, listener: RunEndListener) -> None:
    """The LISTEN connection killed mid-wait (pg_terminate_backend): the waiter LISTENs and
    registers again under the new connection and is woken by the notification. The
    registrations' connection killed while idle (idle_session_timeout does the same): the
    waiter's last write still deletes its row."""
    run_id = enqueue(engine, double, n=6)
    thread, out = waiting(flowq.wait_run, engine, run_id, timeout=120)
    wait_until(lambda: reads.count == 1, message="the waiter's first read")
    first = listener.backend_pid
    assert terminate(engine, "flowq wait_run") == 1

    def pids() -> list[int]:
        with engine.connect() as conn:
            return list(conn.execute(sa.text("SELECT pid FROM flowq.run_waiters")).scalars())

    wait_until(lambda: listener.up and listener.backend_pid != first
               and pids() == [listener.backend_pid], message="registered anew")
    assert terminate(engine, "flowq wait_run registrations") == 1
    before = listener.notified
    with engine.begin() as conn:
        drain(conn, app)
    thread.join(timeout=120)
    assert out["value"].result == {"n": 12}
    assert listener.notified == before + 1
    assert registrations(engine) == []


def test_a_waiter_killed_mid_wait_is_pruned_and_the_others_still_hear_the_end(
        engine: sa.Engine, db_url: str, reads: Reads, slow_poll: None,
        listener: RunEndListener) -> None:
    """SIGKILL leaves the killed process's registration; once its LISTEN connection's backend
    is gone the pruner deletes it, and a waiter of another process still hears the end."""
    from flowq.worker.pruner import Pruner

    run_id = enqueue(engine, double, n=7)
    doomed = subprocess.Popen(
        [sys.executable, "-c", "import sys, sqlalchemy as sa, flowq; flowq.wait_run("
         "sa.create_engine(sys.argv[1]), int(sys.argv[2]), timeout=120)", db_url, str(run_id)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        thread, out = waiting(flowq.wait_run, engine, run_id, timeout=120)
        wait_until(lambda: len(registrations(engine)) == 2 and listener.up,
                   message="both waiters registered")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=30)
    finally:
        doomed.kill()
    def others() -> list[Any]:
        # A transaction of its own each time: a transaction reads pg_stat_activity once and
        # keeps what it read (polled in one, the killed backend never left).
        with engine.connect() as conn:
            return list(conn.execute(sa.text(
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'flowq wait_run' "
                "AND datname = current_database() AND pid <> :mine"),
                {"mine": listener.backend_pid}).all())

    wait_until(lambda: not others(), message="its backend gone")
    Pruner(engine, "flowq").run_once()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT pid FROM flowq.run_waiters")).scalars().all() == [
            listener.backend_pid]
    before = listener.notified
    with engine.begin() as conn:
        drain(conn, app)
    thread.join(timeout=120)
    assert out["value"].result == {"n": 14} and listener.notified == before + 1
    assert registrations(engine) == []


def test_hundreds_of_waiters_on_one_run_and_on_many_runs_are_each_woken_once(
        engine: sa.Engine, reads: Reads, slow_poll: None, listener: RunEndListener) -> None:
    shared = enqueue(engine, double, n=0)
    many = [enqueue(engine, double, n=i) for i in range(1, 151)]
    targets = [shared] * 100 + many
    waiters = [waiting(flowq.wait_run, engine, r, timeout=120) for r in targets]
    wait_until(lambda: reads.count == len(targets), message="every waiter's first read")
    assert len(registrations(engine)) == len(targets)
    before = listener.notified
    with engine.begin() as conn:
        drain(conn, app)  # one transaction: the runs end together
    for thread, _ in waiters:
        thread.join(timeout=120)
    found = [out.get("value") for _, out in waiters]
    assert [r.result["n"] for r in found if r is not None] == [0] * 100 + [
        2 * i for i in range(1, 151)]
    assert listener.notified == before + len(targets)
    assert reads.count == 2 * len(targets)  # woken by the notification, one read each
    assert registrations(engine) == []


def test_a_batch_ending_more_awaited_runs_than_a_payload_holds_sends_one_empty_one(
        engine: sa.Engine, db_url: str) -> None:
    """`notify_ended` over a batch: the awaited ids only, joined; a list that would pass the
    payload's 8000-byte limit (an error inside the completion) is sent as '' instead."""
    from flowq.db.sql.fragments import Statements, notify_ended

    big = 10**17  # 18 digits: 420 ids fill a payload
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO flowq.run_waiters (run_id, token, pid) SELECT "
                             "g, 't', pg_backend_pid() FROM generate_series(:a, :b) g"),
                     {"a": big, "b": big + 999})

    def ended(first: int, last: int) -> str:
        return f"SELECT g AS run_id FROM generate_series({first}, {last}) g"

    with psycopg.connect(db_url.replace("postgresql+psycopg", "postgresql"),
                         autocommit=True) as ear:
        ear.execute(f'LISTEN "{run_end_channel("flowq")}"')
        for first, last in [(big - 5, big + 2), (big, big + 414), (big, big + 999)]:
            with engine.begin() as conn:
                conn.execute(Statements("flowq").sql(f"SELECT {notify_ended(ended(first, last))}"))
        heard = [n.payload for n in ear.notifies(timeout=5, stop_after=3)]
    assert heard[0] == ",".join(str(big + i) for i in range(3))
    assert len(heard[1]) == 415 * 19 - 1 and heard[2] == ""


def test_an_await_run_cancelled_while_it_registers_leaves_no_registration(
        engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, listener: RunEndListener) -> None:
    """`asyncio.wait_for(await_run(...))` or a request handler cancelled on disconnect: the
    registration (written in a thread) may still be on its way when the cancelled task cleans
    up; it must not outlive the wait (its LISTEN connection lives on, so no pruner takes it)."""
    run_id = enqueue(engine, double, n=1)
    writing, release = threading.Event(), threading.Event()
    real = RunEndListener.register

    def slow(self: RunEndListener, *args: Any) -> int | None:
        writing.set()
        release.wait(30)
        return real(self, *args)

    monkeypatch.setattr(RunEndListener, "register", slow)

    async def main() -> None:
        task = asyncio.create_task(flowq.await_run(engine, run_id, timeout=120))
        await asyncio.to_thread(writing.wait, 30)
        task.cancel()
        await asyncio.sleep(0)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())  # which waits for its threads (the registration's)
    assert registrations(engine) == []
    assert listener.watching == 0


def test_a_run_cancelled_while_its_step_runs_wakes_its_waiter_when_the_step_sleeps(
        engine: sa.Engine, db_url: str, reads: Reads, slow_poll: None,
        listener: RunEndListener) -> None:
    """The cancel leaves the running step running (nothing ended: no notification); the
    step's durable sleep then ends it `cancelled`, and that announces the run's end."""
    started.clear()
    go.clear()
    run_id = enqueue(engine, nap)
    thread, out = waiting(flowq.wait_run, engine, run_id, timeout=120)
    wait_until(lambda: reads.count == 1, message="the waiter's first read")
    worker = threading.Thread(target=run_until_idle, args=(app, db_url), daemon=True)
    worker.start()
    assert started.wait(30)
    flowq.runs.cancel_run(engine, run_id)
    before = listener.notified
    go.set()
    worker.join(timeout=60)
    thread.join(timeout=20)
    assert out.get("value") is not None, "not woken by the step's end"
    assert out["value"].status == "cancelled" and listener.notified == before + 1


def test_a_listener_lost_while_the_waiter_registers_is_not_slept_through(
        engine: sa.Engine, reads: Reads, slow_poll: None, monkeypatch: pytest.MonkeyPatch,
        listener: RunEndListener) -> None:
    """The LISTEN connection dies between the waiter's registration and its read: the wake
    its reader sends on the way out must not be cleared by the waiter, which would then
    sleep a whole fallback poll with nobody listening."""
    run_id = enqueue(engine, double, n=8)
    real = RunEndListener.register
    lost: list[int] = []

    def register_then_lose(self: RunEndListener, *args: Any) -> int | None:
        pid = real(self, *args)
        if not lost:
            lost.append(terminate(engine, "flowq wait_run"))
            wait_until(lambda: not self.up, message="the reader gone")
        return pid

    monkeypatch.setattr(RunEndListener, "register", register_then_lose)
    thread, out = waiting(flowq.wait_run, engine, run_id, timeout=120)
    wait_until(lambda: lost and listener.up and reads.count >= 2
               and registrations(engine) == [run_id], message="listening again")
    with engine.begin() as conn:
        drain(conn, app)
    thread.join(timeout=20)
    assert out.get("value") is not None and out["value"].result == {"n": 16}
