"""Retry policies: tenacity strategies evaluated durably, turned into the next `run_at`.

A `Retry` holds tenacity's `stop`, `wait` and `retry` strategies. flowq never sleeps on them:
after a failed attempt the worker builds a tenacity `RetryCallState` from the row (attempt
number from `attempts`, elapsed time from database timestamps, the exception) and asks the
strategies whether to try again and after how long; the answer becomes `run_at`.

Defaults (`Retry()`): at most `DEFAULT_MAX_ATTEMPTS` (10) attempts, exponential backoff with
jitter from 1 s up to 10 minutes. The attempt cap is also stored on each row (`max_attempts`)
so the reaper, which runs SQL only, can send a job that crashes every worker to `dead`; a
worker that knows the step judges by the live policy instead (which cap wins, and why:
`flowq.worker.attempt`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import tenacity
from tenacity import RetryCallState
from tenacity.retry import retry_base
from tenacity.stop import stop_base
from tenacity.wait import wait_base

__all__ = ["DEFAULT_MAX_ATTEMPTS", "Retry"]

DEFAULT_MAX_ATTEMPTS: Final = 10
DEFAULT_WAIT: Final = tenacity.wait_exponential_jitter(initial=1, max=600, jitter=1)


def _max_attempts_of(stop: Any) -> int | None:
    """The attempt cap a tenacity stop strategy implies, when it can be read off it."""
    if isinstance(stop, tenacity.stop_after_attempt):
        return int(stop.max_attempt_number)
    if isinstance(stop, tenacity.stop_any):  # stops when any stops: the smallest cap wins
        caps = [c for c in (_max_attempts_of(s) for s in stop.stops) if c is not None]
        return min(caps) if caps else None
    if isinstance(stop, tenacity.stop_all):
        all_caps = [_max_attempts_of(s) for s in stop.stops]
        known = [c for c in all_caps if c is not None]
        return max(known) if known and len(known) == len(all_caps) else None
    return None


@dataclass(frozen=True)
class Retry:
    """A step's retry policy, in tenacity's vocabulary, executed durably in the database.

    `stop` decides when to give up (default: none beyond the attempt cap), `wait` how long to
    wait before the next attempt (default: exponential with jitter, 1 s to 10 min), `retry`
    which failures are worth retrying (default: every exception). `max_attempts` is a hard cap
    that also bounds crashes and timeouts; it defaults to the cap read off `stop`, else 10, so
    `Retry(max_attempts=20)` alone means 20 attempts.
    """

    stop: stop_base | Any = None
    wait: wait_base | Any = DEFAULT_WAIT
    retry: retry_base | Any = field(default_factory=lambda: tenacity.retry_if_exception_type())
    max_attempts: int | None = None

    @property
    def attempt_cap(self) -> int:
        """The most attempts a job with this policy gets, crashes and timeouts included."""
        if self.max_attempts is not None:
            return max(1, int(self.max_attempts))
        cap = _max_attempts_of(self.stop)
        return cap if cap is not None else DEFAULT_MAX_ATTEMPTS

    def next_delay(self, attempt: int, error: BaseException, elapsed: float) -> float | None:
        """Seconds to wait before the next attempt, or None to give up.

        `attempt` is the attempt that just failed (1-based), `elapsed` the seconds since the
        step's first attempt was created, measured on the database clock.
        """
        if attempt >= self.attempt_cap:
            return None
        state = RetryCallState(retry_object=tenacity.Retrying(), fn=None, args=(), kwargs={})
        state.attempt_number = attempt
        state.start_time = 0.0
        state.outcome_timestamp = max(0.0, elapsed)
        future = tenacity.Future(attempt)
        future.set_exception(error)
        state.outcome = future
        if not self.retry(state):
            return None
        if self.stop is not None and self.stop(state):
            return None
        return max(0.0, float(self.wait(state)))
