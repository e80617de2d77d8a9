"""The service base: a loop that makes one pass (`run_once() -> int`) every `interval` seconds
on a thread of its own, until `stop()`.

Every background loop of the worker is one: the heartbeat, the reaper, the pruner, the waits'
expiry, the workers registry's beat and expiry, the scheduler and the supervisor watch. A
service owns its options, its one pass and its thread; tests call `run_once()` directly
instead of sleeping, and the pass returns how much it did (jobs reaped, rows pruned, ...).

Options: `interval` (seconds between the end of one pass and the start of the next),
`first_delay` (before the first pass; default `interval`), `stopping` (the event that ends
the loop: a service's own by default, or one shared with the worker so that they all stop
claiming work at the moment it starts shutting down).

One failing pass never ends the loop: a database error is logged at WARNING (first line
only), any other exception at ERROR (its repr), once per failed pass, and the pass is tried
again after `failure_delay(failures)` (default: the interval; so a service that keeps failing
logs at most once per interval). `BaseException`s that are not `Exception`s (a
`KeyboardInterrupt`, `SystemExit`) are not caught.
"""

from __future__ import annotations

import threading
from typing import Final

from flowq.worker.connection import DB_ERRORS, Outage
from flowq.worker.logs import ERROR, log_event

__all__ = ["STOP_TIMEOUT", "Service"]

# How long `stop()` waits for a pass in progress to end before it lets the thread go (it is a
# daemon: a pass stuck on the network must not keep the process from exiting).
STOP_TIMEOUT: Final = 5.0


class Service:
    """A loop of `run_once()` every `interval` seconds on its own thread (see the module
    docstring). Subclasses set `name` (the thread is `flowq-<name>`, log lines say it) and
    implement `run_once()`."""

    name = "service"

    def __init__(self, *, interval: float, first_delay: float | None = None,
                 stopping: threading.Event | None = None) -> None:
        self.interval = interval
        self.first_delay = interval if first_delay is None else first_delay
        self.stopping = stopping if stopping is not None else threading.Event()
        self.passes = 0  # passes that ran to the end
        self.failures = 0  # passes that raised in a row (0 after one that did not)
        self._thread: threading.Thread | None = None
        # Where database failures are told (the worker's, shared by its parts: one line per
        # outage); a service of its own has one of its own.
        self.outage = Outage()

    def run_once(self) -> int:
        """One pass; how much it did (what it counts is the service's to say)."""
        raise NotImplementedError

    def next_delay(self) -> float:
        """Seconds from the end of a pass that succeeded to the next (default: `interval`)."""
        return self.interval

    def failure_delay(self, failures: int) -> float:
        """Seconds from the end of the `failures`-th failed pass in a row to the next try."""
        return self.interval

    def run_guarded(self) -> int | None:
        """One pass as the loop makes it: what `run_once()` returned, or None when it raised
        (the failure logged, never propagated)."""
        try:
            done = self.run_once()
        except DB_ERRORS as exc:
            self.failures += 1
            self.outage.failed(self.name, exc,
                               retry_in_s=round(self.failure_delay(self.failures), 2))
            return None
        except Exception as exc:  # a bug: say so loudly, and keep the loop alive
            self.failures += 1
            log_event(ERROR, f"{self.name} crashed; will retry", error=repr(exc),
                      retry_in_s=round(self.failure_delay(self.failures), 2))
            return None
        self.failures = 0
        self.passes += 1
        self.outage.ok()
        return done

    def start(self) -> None:
        """Run passes on a daemon thread until `stop()` (or `stopping` is set)."""
        self._thread = threading.Thread(target=self._loop, name=f"flowq-{self.name}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """End the loop: a pass in progress finishes (waited for up to `timeout`)."""
        self.stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        delay = self.first_delay
        while not self.stopping.wait(delay):
            if self.run_guarded() is None:
                delay = self.failure_delay(self.failures)
            else:
                delay = self.next_delay()
