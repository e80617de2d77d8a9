"""The service base (`flowq.worker.services.Service`): one pass every interval on its own
thread; a failing pass is logged and the loop goes on; `stop()` ends it promptly. Pure
Python: the passes here touch no database."""

from __future__ import annotations

import logging
import threading
import time

import psycopg
import pytest

from flowq.testing import wait_until
from flowq.worker.services import Service


class Counting(Service):
    """Returns 1, 2, 3, ... from its passes; raises what `failures` holds first."""

    name = "counting"

    def __init__(self, *, interval: float = 0.01, failures: list[BaseException] | None = None,
                 **options: object) -> None:
        super().__init__(interval=interval, **options)  # type: ignore[arg-type]
        self.calls = 0
        self.to_raise = list(failures or [])
        self.ran = threading.Event()

    def run_once(self) -> int:
        self.calls += 1
        self.ran.set()
        if self.to_raise:
            raise self.to_raise.pop(0)
        return self.calls


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_run_once_is_one_pass_and_returns_what_it_did() -> None:
    service = Counting()
    assert [service.run_once(), service.run_once()] == [1, 2]
    assert service.run_guarded() == 3
    assert service.passes == 1  # run_guarded counts the passes the loop makes
    with pytest.raises(NotImplementedError):
        Service(interval=1.0).run_once()


def test_a_failing_pass_is_logged_and_the_loop_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    service = Counting(failures=[psycopg.OperationalError("server closed the connection\n"
                                                          "detail"),
                                 ValueError("a bug")])
    with caplog.at_level(logging.WARNING, logger="flowq"):
        service.start()
        try:
            wait_until(lambda: service.passes >= 2, timeout=10, message="two good passes")
        finally:
            service.stop()
    assert service.calls >= 4 and service.failures == 0
    [warning] = messages(caplog, logging.WARNING)
    # A lost connection is an outage, told once (flowq.worker.connection.Outage).
    assert warning.startswith("database connection lost; reconnecting part=counting")
    assert "server closed the connection" in warning and "detail" not in warning  # first line
    [error] = messages(caplog, logging.ERROR)
    assert error.startswith("counting crashed; will retry") and "ValueError('a bug')" in error


def test_failures_in_a_row_are_counted_and_the_delay_is_the_services_to_choose() -> None:
    delays: list[int] = []

    class Backing(Counting):
        def failure_delay(self, failures: int) -> float:
            delays.append(failures)
            return 0.001

    service = Backing(interval=60.0, first_delay=0.0,
                      failures=[RuntimeError("1"), RuntimeError("2"), RuntimeError("3")])
    service.start()
    try:
        wait_until(lambda: service.passes == 1, timeout=10, message="a pass after 3 failures")
    finally:
        service.stop()
    # Each failure is asked its delay twice: once for the log line, once for the wait.
    assert sorted(set(delays)) == [1, 2, 3] and service.failures == 0


def test_stop_ends_the_loop_promptly_even_with_a_long_interval() -> None:
    service = Counting(interval=3600.0, first_delay=0.0)
    service.start()
    assert service.ran.wait(10)
    assert service.alive
    started = time.monotonic()
    service.stop()
    assert time.monotonic() - started < 1.0
    assert not service.alive
    assert service.calls == 1  # the next pass was an hour away


def test_the_first_pass_waits_its_first_delay() -> None:
    service = Counting(interval=0.01, first_delay=3600.0)
    service.start()
    try:
        assert not service.ran.wait(0.2)
    finally:
        service.stop()
    assert service.calls == 0


def test_services_sharing_a_stopping_event_stop_together() -> None:
    stopping = threading.Event()
    services = [Counting(first_delay=0.0, stopping=stopping) for _ in range(2)]
    for s in services:
        s.start()
    wait_until(lambda: all(s.passes for s in services), timeout=10, message="both running")
    stopping.set()
    wait_until(lambda: not any(s.alive for s in services), timeout=5, message="both stopped")


def test_a_base_exception_is_not_swallowed() -> None:
    """KeyboardInterrupt and SystemExit are not a failed pass: they end the loop."""
    service = Counting(failures=[SystemExit(3)])
    with pytest.raises(SystemExit):
        service.run_guarded()
    assert service.failures == 0


def test_the_supervisor_watch_tells_once_when_the_supervisor_is_gone() -> None:
    import os

    from flowq.worker.supervisor import SupervisorWatch

    told: list[bool] = []
    assert SupervisorWatch(str(os.getppid()), lambda: told.append(True)).run_once() == 0
    assert told == []
    gone = SupervisorWatch("not-a-pid", lambda: told.append(True))
    assert [gone.run_once(), gone.run_once()] == [1, 0]
    assert told == [True] and gone.orphaned
