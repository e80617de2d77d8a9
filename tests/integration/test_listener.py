"""The listener against a real PostgreSQL: what wakes the claimer, and when."""

from __future__ import annotations

from collections.abc import Iterator

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
