"""The listener against a real PostgreSQL: what wakes the claimer, and when."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from flowq.db import normalize_url
from flowq.testing import wait_until
from flowq.worker.listener import Listener


class Wakes:
    def __init__(self) -> None:
        self.now = 0
        self.later: list[float] = []

    def wake(self) -> None:
        self.now += 1

    def wake_in(self, seconds: float) -> None:
        self.later.append(seconds)


@pytest.fixture
def listening(db_url: str) -> Iterator[tuple[Listener, Wakes]]:
    wakes = Wakes()
    conninfo = normalize_url(db_url).set(drivername="postgresql").render_as_string(
        hide_password=False)
    listener = Listener(conninfo, "flowq", ["a", "b"], wakes.wake, wake_in=wakes.wake_in)
    listener.start()
    assert listener.connected.wait(10)
    wait_until(lambda: wakes.now == 1, timeout=5, message="the wake-up after connecting")
    yield listener, wakes
    listener.stop()


def test_notifications_of_its_queues_wake_now_or_when_due(
        engine: sa.Engine, listening: tuple[Listener, Wakes]) -> None:
    _, wakes = listening
    with engine.begin() as conn:
        for payload in ("a", "other", "b@1.25", "a@soon", "other@3"):
            conn.execute(sa.text("SELECT pg_notify('flowq', :p)"), {"p": payload})
    wait_until(lambda: wakes.now == 3 and wakes.later == [1.25], timeout=10,
               message="two wake-ups now (a, and the unparsable a@soon) and one later")


def test_a_dropped_connection_reconnects_and_wakes(engine: sa.Engine,
                                                   listening: tuple[Listener, Wakes]) -> None:
    listener, wakes = listening
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                             "WHERE query LIKE 'LISTEN%'"))
    # Notifications sent while it was away are lost: it wakes the claimer once reconnected.
    wait_until(lambda: wakes.now >= 2 and listener.connected.is_set(), timeout=15,
               message="the reconnect")


def test_a_notify_with_no_time_wakes_now(engine: sa.Engine,
                                         listening: tuple[Listener, Wakes]) -> None:
    """Anyone may NOTIFY: `a@NaN` or `a@inf` must not enter the wake-up schedule, where a NaN
    would sit at the top for good (review finding 5)."""
    _, wakes = listening
    with engine.begin() as conn:
        for payload in ("a@NaN", "a@inf", "a@-inf"):
            conn.execute(sa.text("SELECT pg_notify('flowq', :p)"), {"p": payload})
    wait_until(lambda: wakes.now == 4, timeout=10, message="three wake-ups now")
    assert wakes.later == []



def listen_backends(engine: sa.Engine) -> list[int]:
    """The backends of this database named as a LISTEN connection of this test (a
    transaction of its own each time: one reads pg_stat_activity once and keeps it)."""
    with engine.connect() as conn:
        return list(conn.execute(sa.text(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name IN ('flowq wait_run', 'flowq listen shared')")).scalars())


def test_a_worker_and_a_wait_run_share_one_listen_connection_and_its_reconnect(
        engine: sa.Engine, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process's one LISTEN connection serves the worker's wake-ups and a waiter's run
    end; after pg_terminate_backend of it, both are served by the new one. The poll of each
    is an hour away, so what starts a job and ends a wait is a notification."""
    import threading

    import flowq
    from flowq.durable.context import Context
    from flowq.ops import results
    from flowq.ops.waiters import RunEndListener
    from flowq.worker import Worker, WorkerConfig

    monkeypatch.setattr(results, "FALLBACK_POLL", 3600.0)
    monkeypatch.setattr(results, "RECHECK", 3600.0)
    app = flowq.FlowQ()
    started, go = threading.Semaphore(0), threading.Semaphore(0)

    @app.task()
    def gated(ctx: Context, n: int) -> dict[str, int]:
        started.release()
        assert go.acquire(timeout=60)
        return {"n": 3 * n}

    def waiters() -> int:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM flowq.run_waiters")).scalar()
                       or 0)

    def served(n: int) -> None:
        """A job started by the worker's wake-up, and its end heard by a waiter."""
        with engine.begin() as conn:
            run_id = flowq.enqueue(conn, gated, n=n).id
        assert started.acquire(timeout=60), "the worker was not woken"
        out: dict[str, Any] = {}

        def wait() -> None:
            try:
                out["value"] = flowq.wait_run(engine, run_id, timeout=120)
            except BaseException as exc:  # reported by the test
                out["error"] = exc

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        wait_until(lambda: waiters() == 1, message="the waiter registered")
        before = ends.notified
        go.release()
        thread.join(timeout=60)
        assert out.get("value") is not None and out["value"].result == {"n": 3 * n}, out
        assert ends.notified == before + 1  # woken by the run's end: its poll is an hour off

    ends = RunEndListener.shared(engine)
    worker = Worker(app, db_url, WorkerConfig(poll_interval=3600, name="shared"))
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False},
                              daemon=True)
    runner.start()
    try:
        assert worker.listener is not None
        listener = worker.listener
        assert listener.connected.wait(30)
        served(1)
        pid = ends.backend_pid
        assert pid is not None and listen_backends(engine) == [pid]
        served(2)

        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            conn.commit()
        # The worker's subscription reconnects (the waiters', with nobody waiting, leaves:
        # the next waiter subscribes again, to the connection the worker opened).
        wait_until(lambda: listen_backends(engine) not in ([], [pid])
                   and listener.connected.is_set(), timeout=30,
                   message="one new LISTEN connection")
        served(3)
        assert ends.up and listen_backends(engine) == [ends.backend_pid]
    finally:
        worker.stop()
        runner.join(30)
        ends.close()
    wait_until(lambda: not listen_backends(engine), timeout=30,
               message="the connection closed once nobody listens")


def test_a_subscriber_that_raises_does_not_deafen_the_others(engine: sa.Engine,
                                                            db_url: str) -> None:
    """Subscriptions are counted per channel: the one left after another leaves still hears,
    and one whose callback raises is skipped (logged) while the others hear."""
    import psycopg

    from flowq.db.listener import SharedListener, Subscription

    conninfo = normalize_url(db_url).set(drivername="postgresql").render_as_string(
        hide_password=False)
    heard: list[str] = []

    def broken(payload: str) -> None:
        raise RuntimeError("a subscriber's bug")

    shared = SharedListener.of(conninfo, lambda: psycopg.connect(conninfo, autocommit=True))
    loud, leaving, kept = (Subscription("chan", broken), Subscription("chan", heard.append),
                           Subscription("chan", lambda p: heard.append(f"kept {p}")))
    try:
        assert shared.subscribe(loud) and shared.subscribe(leaving) and shared.subscribe(kept)
        shared.unsubscribe(leaving)
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_notify('chan', 'x')"))
        wait_until(lambda: heard == ["kept x"], timeout=10, message="the kept subscriber")
    finally:
        shared.unsubscribe(loud)
        shared.unsubscribe(kept)
    assert not shared.up
