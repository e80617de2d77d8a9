"""flowq.Retry: tenacity strategies evaluated against the attempt count and database time."""

from __future__ import annotations

import pytest
from tenacity import (
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    stop_all,
    stop_any,
    wait_exponential,
    wait_fixed,
)

from flowq.define.retry import DEFAULT_MAX_ATTEMPTS, Retry

ERR = RuntimeError("boom")


def test_defaults_cap_attempts_and_back_off_exponentially_with_jitter() -> None:
    r = Retry()
    assert DEFAULT_MAX_ATTEMPTS == 10
    assert r.attempt_cap == 10
    for attempt in range(1, 10):
        base = 2 ** (attempt - 1)
        delays = {r.next_delay(attempt, ERR, elapsed=0.0) for _ in range(30)}
        assert all(d is not None and base <= d <= base + 1 for d in delays), (attempt, delays)
        assert len(delays) > 1, "the default wait has jitter"
    assert r.next_delay(10, ERR, elapsed=0.0) is None


def test_default_wait_is_capped_at_ten_minutes() -> None:
    r = Retry(stop=stop_after_attempt(100))
    delay = r.next_delay(40, ERR, elapsed=0.0)
    assert delay is not None and delay <= 600


def test_stop_after_attempt_is_read_as_the_cap() -> None:
    r = Retry(stop=stop_after_attempt(3), wait=wait_fixed(2))
    assert r.attempt_cap == 3
    assert r.next_delay(1, ERR, 0.0) == 2
    assert r.next_delay(2, ERR, 0.0) == 2
    assert r.next_delay(3, ERR, 0.0) is None


def test_combined_stops_and_explicit_cap() -> None:
    assert Retry(stop=stop_any(stop_after_attempt(4), stop_after_attempt(7))).attempt_cap == 4
    assert Retry(stop=stop_all(stop_after_attempt(4), stop_after_attempt(7))).attempt_cap == 7
    # A cap cannot be read off a time limit: the default cap bounds crashes.
    assert Retry(stop=stop_after_delay(60)).attempt_cap == DEFAULT_MAX_ATTEMPTS
    assert Retry(stop=stop_after_attempt(3), max_attempts=2).attempt_cap == 2
    assert Retry(max_attempts=0).attempt_cap == 1
    assert Retry(max_attempts=1).next_delay(1, ERR, 0.0) is None


def test_stop_after_delay_uses_the_elapsed_database_time() -> None:
    r = Retry(stop=stop_after_delay(60), wait=wait_fixed(1))
    assert r.next_delay(2, ERR, elapsed=10.0) == 1
    assert r.next_delay(2, ERR, elapsed=59.0) == 1
    assert r.next_delay(2, ERR, elapsed=61.0) is None


def test_retry_if_exception_type_filters_failures() -> None:
    r = Retry(retry=retry_if_exception_type(ConnectionError), wait=wait_fixed(3))
    assert r.next_delay(1, ConnectionError("reset"), 0.0) == 3
    assert r.next_delay(1, ValueError("bad input"), 0.0) is None  # not retryable: dead


@pytest.mark.parametrize(("attempt", "expected"), [(1, 2), (2, 2), (3, 4), (4, 8), (5, 10), (9, 10)])
def test_wait_exponential_follows_the_attempt_number(attempt: int, expected: float) -> None:
    # tenacity's formula: multiplier * 2 ** (attempt_number - 1), clamped to [min, max]
    r = Retry(stop=stop_after_attempt(20), wait=wait_exponential(multiplier=1, min=2, max=10))
    assert r.next_delay(attempt, ERR, 0.0) == expected


def test_wait_fixed() -> None:
    r = Retry(wait=wait_fixed(7))
    assert [r.next_delay(a, ERR, 0.0) for a in (1, 5, 9)] == [7, 7, 7]


def test_custom_callables_are_tenacity_strategies() -> None:
    seen = []

    def wait(state: object) -> float:
        seen.append(state.attempt_number)  # type: ignore[attr-defined]
        return -5.0  # a negative wait is clamped: run_at is never in the past

    r = Retry(stop=lambda state: False, wait=wait, retry=lambda state: True)
    assert r.next_delay(4, ERR, 0.0) == 0.0
    assert seen == [4]


def _judge_retry_step(after: object) -> object:
    """The outcome the worker's attempt judge gives `RetryStep(after=after)` (no server)."""
    import json

    import flowq
    from flowq.db.rows import ClaimedJob
    from flowq.worker.attempt import Attempt

    app = flowq.FlowQ()

    @app.task(retry=Retry(stop=stop_after_attempt(3), wait=wait_fixed(1)))
    def again(ctx: flowq.Context) -> None: ...

    job = ClaimedJob(1, 1, 1, again.name, again.first.name, 0, "default", 0, 1, 3,
                     json.dumps({}), False, 0.0)
    return Attempt(app, job).judge_exception(flowq.RetryStep(after=after), 0.0)


def test_retry_step_after_infinity_is_clamped_like_any_huge_delay() -> None:
    from flowq.storable import MAX_DELAY
    from flowq.worker.model import Retried

    outcomes = {after: _judge_retry_step(after)
                for after in (float("inf"), 1e300, 10**400, MAX_DELAY + 1)}
    assert all(isinstance(o, Retried) and o.delay == MAX_DELAY for o in outcomes.values()), \
        outcomes
    # Minus infinity is a negative delay like any other: retried at once.
    for after in (float("-inf"), -1e300, -5):
        out = _judge_retry_step(after)
        assert isinstance(out, Retried) and out.delay == 0.0, (after, out)


def test_retry_step_after_nan_fails_the_attempt_with_a_clear_error() -> None:
    from flowq.worker.model import Failed

    out = _judge_retry_step(float("nan"))
    assert isinstance(out, Failed) and out.retry_in == 1.0  # judged by the step's policy
    assert out.text.startswith("ValueError: RetryStep(after=nan) is not a delay")
