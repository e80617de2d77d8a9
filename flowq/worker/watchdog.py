"""The timeout watchdog: fails every attempt past its step's `timeout`, and tells when a
handler blocks the executor's event loop.

A thread wakes every `WATCH_INTERVAL` (so a timeout fires that late at most) and runs
`run_once()`: each unsettled attempt past its deadline is failed with `StepTimeout` and
handed to the executor's `abandon` (a sync handler cannot be killed: its slot gets a new
thread and whatever it returns later is discarded; an async one is cancelled). The executor's
`EventLoop` ticks every `LOOP_TICK`: a loop whose last tick is older than `LOOP_STALL` when one
of its attempts times out is blocked (a handler calling `time.sleep` inside `async def`), and
so is a loop that has not ticked for `loop_blocked_for` (`LOOP_BLOCKED_FOR`, 10 s: long
enough for an async handler's honest blocking call) while attempts wait on it, deadline or
not. A blocked loop is handed to the executor's `replace_loop`.

Callbacks, given at construction: `unsettled()` the attempts running now, `abandon(record,
outcome)` settles one from outside its handler (False if it had settled), `current_loop()`
the executor's loop (None before the first async attempt), `replace_loop(loop, now)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Generic, Protocol, TypeVar

from flowq.worker.attempt import Attempt
from flowq.worker.logs import ERROR, log_event
from flowq.worker.model import Outcome

__all__ = ["LOOP_BLOCKED_FOR", "LOOP_STALL", "LOOP_TICK", "WATCH_INTERVAL", "EventLoop",
           "StepTimeout", "Watchdog", "Watched"]

WATCH_INTERVAL: Final = 0.1
LOOP_TICK: Final = 0.1
LOOP_STALL: Final = 1.0
LOOP_BLOCKED_FOR: Final = 10.0


class StepTimeout(Exception):
    """The handler ran longer than its step's timeout."""


@dataclass(eq=False)
class EventLoop:
    """An event loop on its own thread, ticking so that the watchdog can tell it is blocked.

    `stopping` is set before the loop is asked to stop: what is handed to it after that must
    not start (a coroutine created and never run would be left un-awaited)."""

    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    last_tick: float = field(default_factory=time.monotonic)
    stopping: bool = False

    @classmethod
    def new(cls) -> EventLoop:
        """A new loop, running on its own thread until it is stopped, then closed."""
        loop = asyncio.new_event_loop()
        started = cls(loop, threading.Thread(target=cls._run, args=(loop,),
                                             name="flowq-asyncio", daemon=True))
        loop.call_soon_threadsafe(started._tick)
        started.thread.start()
        return started

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.run_forever()
        finally:
            # Tasks left on it stay unfinished (their attempts were settled or released): a
            # closed loop drops them, and a thread finishing for one of them finds it closed.
            loop.close()

    def call(self, fn: Callable[..., object], *args: object) -> None:
        """Run `fn(*args)` on the loop soon, from any thread; nothing once it is closed."""
        with contextlib.suppress(RuntimeError):  # "Event loop is closed"
            self.loop.call_soon_threadsafe(fn, *args)

    def _tick(self) -> None:
        self.last_tick = time.monotonic()
        self.loop.call_later(LOOP_TICK, self._tick)

    def blocked(self, now: float) -> bool:
        return now - self.last_tick > LOOP_STALL

    def stop(self) -> None:
        """Stop the loop (once it runs again, if a handler blocks it)."""
        self.stopping = True
        self.call(self.loop.stop)


class Watched(Protocol):
    """One running attempt, as the watchdog reads it."""

    @property
    def attempt(self) -> Attempt: ...

    @property
    def deadline(self) -> float | None: ...

    @property
    def loop(self) -> EventLoop | None: ...


W = TypeVar("W", bound=Watched)


class Watchdog(Generic[W]):
    """Fails attempts past their deadline and finds blocked loops; see the module."""

    def __init__(self, *, unsettled: Callable[[], list[W]],
                 abandon: Callable[[W, Outcome], bool],
                 current_loop: Callable[[], EventLoop | None],
                 replace_loop: Callable[[EventLoop, float], None],
                 interval: float = WATCH_INTERVAL,
                 loop_blocked_for: float = LOOP_BLOCKED_FOR) -> None:
        self.unsettled = unsettled
        self.abandon = abandon
        self.current_loop = current_loop
        self.replace_loop = replace_loop
        self.interval = interval
        self.loop_blocked_for = loop_blocked_for
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="flowq-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _watch(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                self.run_once()
            except Exception as exc:  # a bug here must not end the watching
                log_event(ERROR, "timeout watchdog crashed; continuing", error=repr(exc))

    def run_once(self) -> int:
        """Fail every attempt past its deadline, replace blocked loops; how many attempts
        were abandoned."""
        now = time.monotonic()
        abandoned = 0
        blocked: set[EventLoop] = set()
        for rec in self.unsettled():
            if rec.deadline is None or rec.deadline > now:
                continue
            attempt, job = rec.attempt, rec.attempt.job
            exc = StepTimeout(f"step {job.step!r} of {job.task!r} exceeded its timeout "
                              f"of {rec.deadline - attempt.started:.1f}s")
            if self.abandon(rec, attempt.failure(exc, now - attempt.started)):
                abandoned += 1
                if rec.loop is not None and rec.loop.blocked(now):
                    blocked.add(rec.loop)
        # A loop blocked for long with attempts waiting on it is replaced even when none of
        # them has a deadline (or the blocker's was so short that it was abandoned before the
        # loop counted as blocked): otherwise those attempts would hold their slots, and be
        # heartbeated, for as long as the blocker blocks.
        current = self.current_loop()
        if (current is not None and now - current.last_tick > self.loop_blocked_for
                and any(r.loop is current for r in self.unsettled())):
            blocked.add(current)
        for stuck in blocked:
            self.replace_loop(stuck, now)
        return abandoned
