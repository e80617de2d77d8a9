"""The executor in-process: how each attempt's outcome is decided, and that no handler can take
a slot away. Outcomes are captured from a real `Completer` whose writer thread is not started
(the writes themselves are tested in test_completer and the acceptance tests)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from tenacity import retry_if_exception, stop_after_attempt, wait_fixed

import flowq
from flowq.db import normalize_url
from flowq.db.rows import ClaimedJob
from flowq.durable.context import Context
from flowq.durable.session import StepSession
from flowq.testing import wait_until
from flowq.worker.completer import Completer
from flowq.worker.connection import DedicatedConnection
from flowq.worker.executor import Executor
from flowq.worker.model import Cancelled, Failed, Outcome, Retried, Succeeded

TWO = flowq.Retry(stop=stop_after_attempt(2), wait=wait_fixed(1))


class Recorder(Completer):
    """A Completer that keeps the outcomes it is given instead of writing them."""

    def __init__(self) -> None:
        super().__init__(DedicatedConnection(normalize_url("postgresql://unused/none"),
                                             "unused"), "flowq")
        self.outcomes: dict[int, Outcome] = {}

    def submit(self, job: ClaimedJob, outcome: Outcome, duration: float = 0.0,
               session: StepSession | None = None) -> None:
        self.outcomes[job.id] = outcome


@pytest.fixture
def run(app: flowq.FlowQ) -> Iterator[Any]:
    recorder = Recorder()
    freed: list[int] = []
    executor = Executor(app, recorder, concurrency=2, on_slot_free=freed.append,
                        session_factory=lambda: StepSession())
    executor.start()
    ids = iter(range(1, 1000))

    def go(task: flowq.Pipeline, attempts: int = 1, **args: Any) -> Outcome:
        job_id = next(ids)
        executor.submit(ClaimedJob(job_id, job_id, job_id, task.name, task.first.name, 0,
                                   "default", 0, attempts, 10, json.dumps(args), False, 0.0))
        wait_until(lambda: job_id in recorder.outcomes, timeout=15, message="an outcome")
        return recorder.outcomes[job_id]

    go.executor = executor  # type: ignore[attr-defined]
    yield go
    executor.stop()


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


def test_an_exception_that_cannot_be_printed_fails_the_attempt(app: flowq.FlowQ,
                                                               run: Any) -> None:
    @app.task(retry=TWO)
    def bad(ctx: Context) -> None:
        raise Unprintable()

    out = run(bad)
    assert isinstance(out, Failed) and out.retry_in == 1.0
    assert out.text.startswith("Unprintable: <Unprintable>")
    assert run.executor.in_flight == 0  # the slot came back


@pytest.mark.parametrize("exc", [SystemExit(2), KeyboardInterrupt(), GeneratorExit()])
def test_base_exceptions_fail_the_attempt_and_keep_the_thread(app: flowq.FlowQ, run: Any,
                                                              exc: BaseException) -> None:
    @app.task(retry=TWO)
    def exits(ctx: Context) -> None:
        raise exc

    @app.task()
    def fine(ctx: Context) -> dict[str, int]:
        return {"ok": 1}

    out = run(exits)
    assert isinstance(out, Failed) and out.retry_in is None  # not an Exception: not retried
    assert out.text.startswith(type(exc).__name__)
    for _ in range(4):  # both threads still serve
        assert isinstance(run(fine), Succeeded)


def test_a_retry_policy_that_raises_ends_the_step_with_both_errors(app: flowq.FlowQ,
                                                                   run: Any) -> None:
    @app.task(retry=flowq.Retry(retry=retry_if_exception(lambda e: e.code >= 500)))  # type: ignore[attr-defined]
    def coded(ctx: Context) -> None:
        raise ValueError("no code here")

    out = run(coded)
    assert isinstance(out, Failed) and out.retry_in is None
    assert out.text.startswith("ValueError: no code here")
    assert "retry policy raised" in out.text and "AttributeError" in out.text


@pytest.mark.parametrize(("after", "expected"), [
    (0.2, 0.2), (1e300, 366 * 86400.0), (float("inf"), 366 * 86400.0), (-5, 0.0),
    (float("-inf"), 0.0), (10**400, 366 * 86400.0)])
def test_retry_step_delays_are_clamped(app: flowq.FlowQ, run: Any, after: Any,
                                       expected: float) -> None:
    @app.task(retry=TWO)
    def again(ctx: Context) -> None:
        raise flowq.RetryStep(after=after, reason="x\x00y")

    out = run(again)
    assert isinstance(out, Retried) and out.delay == pytest.approx(expected)
    assert out.reason == "x\\x00y"


@pytest.mark.parametrize("after", [float("nan"), "soon"])
def test_retry_step_with_no_time_is_a_failure(app: flowq.FlowQ, run: Any, after: Any) -> None:
    @app.task(retry=TWO)
    def again(ctx: Context) -> None:
        raise flowq.RetryStep(after=after)

    out = run(again)
    assert isinstance(out, Failed) and out.retry_in == 1.0
    assert out.text.startswith("ValueError: RetryStep(after=")


def test_retry_step_at_the_cap_ends_the_step(app: flowq.FlowQ, run: Any) -> None:
    @app.task(retry=TWO)
    def again(ctx: Context) -> None:
        raise flowq.RetryStep(after=1)

    out = run(again, attempts=2)
    assert isinstance(out, Failed) and out.retry_in is None
    assert "attempt cap of 2" in out.text


def test_cancel_run_reason_is_made_storable(app: flowq.FlowQ, run: Any) -> None:
    @app.task()
    def stop(ctx: Context) -> None:
        raise flowq.CancelRun("a\udcffb\x00")

    out = run(stop)
    assert isinstance(out, Cancelled) and out.reason == "a\\udcffb\\x00"


def test_a_result_that_cannot_be_stored_is_not_retried(app: flowq.FlowQ, run: Any) -> None:
    @app.task(retry=TWO)
    def weird(ctx: Context) -> Any:
        return {"a": [1, {"b": float("nan")}]}

    out = run(weird)
    assert isinstance(out, Failed) and out.retry_in is None
    assert out.text.startswith("InvalidResultError:") and "['a'][1]['b']" in out.text


def test_an_async_handler_that_ignores_cancellation_is_abandoned(app: flowq.FlowQ,
                                                                 run: Any) -> None:
    @app.task(retry=TWO, timeout=0.3)
    async def stubborn(ctx: Context) -> None:
        for _ in range(50):
            try:
                await asyncio.sleep(0.1)
            except asyncio.CancelledError:
                continue

    started = time.monotonic()
    out = run(stubborn)
    assert isinstance(out, Failed) and out.text.startswith("StepTimeout:")
    assert out.retry_in == 1.0
    assert time.monotonic() - started < 4.0  # abandoned, not waited for (5 s)
    assert run.executor.in_flight == 0


def test_a_blocked_event_loop_is_replaced(app: flowq.FlowQ, run: Any) -> None:
    @app.task(retry=TWO, timeout=0.5)
    async def blocker(ctx: Context) -> None:
        time.sleep(3)

    @app.task()
    async def fine(ctx: Context) -> dict[str, int]:
        await asyncio.sleep(0.01)
        return {"ok": 1}

    out = run(blocker)
    assert isinstance(out, Failed) and out.text.startswith("StepTimeout:")
    assert isinstance(run(fine), Succeeded)  # on a fresh loop, while the old one is blocked


def test_a_loop_blocked_long_is_replaced_even_without_deadlines(app: flowq.FlowQ,
                                                                run: Any) -> None:
    """The blocker's own timeout fired before the loop counted as blocked; the attempts that
    queued behind it must not wait (and be heartbeated) for as long as it blocks. One at its
    attempt cap ends instead of running past it (review findings 1 and 6)."""
    run.executor.watchdog.loop_blocked_for = 1.0

    @app.task(retry=TWO, timeout=0.2)
    async def blocker(ctx: Context) -> None:
        time.sleep(4)

    @app.task(retry=TWO)
    async def quick(ctx: Context) -> None:
        await asyncio.sleep(0.01)

    assert isinstance(run(blocker), Failed)
    executor = run.executor
    recorder = executor.completer
    for job_id, attempts in ((900, 1), (901, 2)):
        executor.submit(ClaimedJob(job_id, job_id, job_id, "quick", "quick", 0, "default", 0,
                                   attempts, 2, "{}", False, 0.0))
    wait_until(lambda: {900, 901} <= recorder.outcomes.keys(), timeout=15,
               message="the attempts behind the blocker to be settled")
    retried, capped = recorder.outcomes[900], recorder.outcomes[901]
    assert isinstance(retried, Retried) and retried.reason.startswith("EventLoopBlocked")
    assert isinstance(capped, Failed) and capped.retry_in is None
    wait_until(lambda: executor.in_flight == 0, timeout=5, message="the slots back")


def test_attempts_left_on_a_replaced_loop_leave_no_coroutine_unawaited(app: flowq.FlowQ,
                                                                       run: Any) -> None:
    """An async attempt's coroutine is made on its loop, only when the loop starts it: those
    queued behind a blocker on a loop that is replaced, and stops once it unblocks, leave none
    un-awaited (the `coroutine ... was never awaited` warning seen in test_lifecycle)."""
    import gc
    import warnings

    executor = run.executor
    executor.watchdog.loop_blocked_for = 1.0

    @app.task(retry=TWO, timeout=0.2)
    async def blocker(ctx: Context) -> None:
        time.sleep(2.5)

    @app.task(retry=TWO)
    async def quick(ctx: Context) -> None:
        await asyncio.sleep(0.01)

    def submit(job_id: int, task: str) -> None:
        executor.submit(ClaimedJob(job_id, job_id, job_id, task, task, 0, "default", 0, 1, 2,
                                   "{}", False, 0.0))

    submit(800, "blocker")
    old = [wait_until(executor.watchdog.current_loop, timeout=5, message="the loop")]
    wait_until(lambda: time.monotonic() - old[0].last_tick > 0.3, timeout=5,
               message="the blocker to block the loop")
    submit(801, "quick")
    submit(802, "quick")
    recorder = executor.completer
    wait_until(lambda: {800, 801, 802} <= recorder.outcomes.keys(), timeout=15,
               message="the three settled")
    assert isinstance(recorder.outcomes[801], Retried)
    thread = old.pop().thread  # and no reference to the loop is left here
    wait_until(lambda: not thread.is_alive(), timeout=10, message="the replaced loop to stop")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []


def test_a_policy_wait_without_max_is_clamped(app: flowq.FlowQ, run: Any) -> None:
    from tenacity import wait_exponential

    @app.task(retry=flowq.Retry(wait=wait_exponential(), max_attempts=100))
    def grows(ctx: Context) -> None:
        raise ValueError("again")

    out = run(grows, attempts=50)
    assert isinstance(out, Failed) and out.retry_in == 366 * 86400.0


def test_a_slot_is_not_lost_when_scheduling_or_spawning_fails(
        app: flowq.FlowQ, run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Held until the test ends, then let go at once: its late result is logged here, not
    # during a later test whose command logs to stderr (seen in test_secrets).
    release = threading.Event()

    @app.task(timeout=0.2)
    def stuck(ctx: Context) -> None:
        release.wait(10)

    @app.task()
    async def later(ctx: Context) -> None: ...

    executor = run.executor

    def no_thread() -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(executor, "spawn_thread", no_thread)
    assert isinstance(run(stuck), Failed)  # abandoned; the replacement thread failed
    wait_until(lambda: executor.in_flight == 0, timeout=5, message="the slot back")

    def no_loop(*args: Any) -> Any:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(asyncio, "new_event_loop", no_loop)
    # Not started: logged and forgotten (the claim runs out, the reaper requeues the job).
    executor.submit(ClaimedJob(950, 950, 950, "later", "later", 0, "default", 0, 1, 10,
                               "{}", False, 0.0))
    assert executor.in_flight == 0 and executor.unsettled_claims() == []
    assert executor.active == 0
    release.set()


def _frames(text: str) -> list[str]:
    """The files of a stored traceback's frames, in order."""
    return [line.split('"')[1] for line in text.splitlines()
            if line.lstrip().startswith('File "')]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_stored_traceback_starts_at_the_handler(app: flowq.FlowQ, run: Any,
                                                  kind: str) -> None:
    """The executor's, the attempt's and tracing's frames that called the handler are left
    out of `last_error`; the chain (`raise ... from`) and its own frames stay."""
    def lookup(sku: str) -> int:
        return {"mug": 1}[sku]

    if kind == "sync":
        @app.task(name="fails", retry=TWO)
        def fails(ctx: Context, sku: str) -> None:
            try:
                lookup(sku)
            except KeyError as exc:
                raise ValueError(f"no such sku {sku}") from exc
        task = fails
    else:
        @app.task(name="fails", retry=TWO)
        async def afails(ctx: Context, sku: str) -> None:
            try:
                lookup(sku)
            except KeyError as exc:
                raise ValueError(f"no such sku {sku}") from exc
        task = afails

    out = run(task, sku="teapot")
    assert isinstance(out, Failed)
    assert out.text.startswith("ValueError: no such sku teapot")
    assert "The above exception was the direct cause" in out.text
    files = _frames(out.text)
    assert files and all(f == __file__ for f in files), files
    assert "lookup" in out.text and "KeyError: 'teapot'" in out.text


def test_an_error_flowq_raises_keeps_its_frames(app: flowq.FlowQ, run: Any) -> None:
    """A traceback without a user frame (a result flowq cannot store) is kept whole."""
    @app.task()
    def returns_a_set(ctx: Context) -> Any:
        return {1, 2}

    out = run(returns_a_set)
    assert isinstance(out, Failed) and out.retry_in is None
    assert _frames(out.text) and all("flowq" in f for f in _frames(out.text))
