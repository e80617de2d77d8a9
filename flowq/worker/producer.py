"""The producer: the claim loop, what wakes it, and how much it claims (the claim-ahead).

The loop claims (through the `Claimer`) what the free slots allow, then sleeps until one of
its wake-ups: a NOTIFY (`notified`, from the listener), a batch's worth of slots freed
(`slot_freed`, from the executor) or an outcome written (`wake`, from the completer), a job
due soon (`wake_at`: a retry this worker scheduled, or a delayed job whose NOTIFY it saw;
kept in a heap of at most `MAX_WAKE_TIMES`), and the poll (`poll_interval`, default 5 s: the
safety net, which also re-reads the queues' pauses and limits). It never sleeps longer than
`MAX_SLEEP` at a time, so a stop or a signal is acted on within that. A database error backs
off from 0.1 s, doubling up to `DB_BACKOFF_MAX` (5 s).

Free slots are the handlers, plus the claim-ahead, less the claims held (running, ready, and
past a concurrency's worth, outcomes the completer has not written yet: a slow database
throttles claiming instead of piling up `running` rows that all need heartbeats).

Claim-ahead: a worker claims, beyond its free handlers, what it would start within
`CLAIM_AHEAD_HORIZON` (20 ms) at the rate its handlers have been finishing (measured every
`RATE_WINDOW`, 0.2 s, smoothed), at most `CLAIM_AHEAD_MAX_FACTOR` (4) x concurrency, or the
`claim_ahead` cap of the config (0: off). Handlers of 1 s at -c 10 finish 10 per second:
nothing is claimed ahead, so an idle worker gets its share; no-op handlers finishing 10,000
per second keep a buffer that makes claims large at any concurrency. A job claimed ahead that
has not started after `CLAIM_AHEAD_MAX_WAIT` (0.25 s) is handed back (the handlers turned
slow: the rate measured no longer holds), so that an idle worker can start it. A limited
queue is never claimed ahead (only for handlers free now): its limits count claims, and a
job that started later than its claim would let a rate window see more starts than it allows.
"""

from __future__ import annotations

import heapq
import math
import random
import threading
import time
from collections.abc import Callable
from typing import Final, Protocol

from flowq.db.rows import Claim, ClaimedJob
from flowq.storable import first_line
from flowq.worker.claimer import Claimer
from flowq.worker.config import WorkerConfig
from flowq.worker.connection import DB_BACKOFF_MAX, DB_ERRORS, Outage
from flowq.worker.logs import ERROR, INFO, WARNING, log_event

__all__ = ["CLAIM_AHEAD_HORIZON", "CLAIM_AHEAD_MAX_FACTOR", "CLAIM_AHEAD_MAX_WAIT",
           "LIMITED_RETRY", "MAX_WAKE_TIMES", "RATE_WINDOW", "Producer"]

CLAIM_AHEAD_HORIZON: Final = 0.02
CLAIM_AHEAD_MAX_FACTOR: Final = 4
RATE_WINDOW: Final = 0.2
CLAIM_AHEAD_MAX_WAIT: Final = 0.25
# How soon a worker looks again at a queue whose limits held due jobs back (jittered, so
# workers do not take the queue's lock in lockstep): capacity frees as jobs end anywhere.
LIMITED_RETRY: Final = 0.05
# Retry wake-ups remembered at once; beyond that the poll picks retries up.
MAX_WAKE_TIMES: Final = 10_000
# The longest one sleep of the loop: how long a stop or a signal may wait to be acted on.
MAX_SLEEP: Final = 0.25
# With `until_idle`, how often the loop looks whether it is idle.
IDLE_CHECK: Final = 0.05
# How long `until_idle` waits for the completer to write the last outcomes.
IDLE_FLUSH: Final = 30.0


class Slots(Protocol):
    """What the producer reads of the executor."""

    finished: int

    @property
    def in_flight(self) -> int: ...

    def oldest_ready_age(self) -> float: ...

    def take_ready(self, older_than: float | None = None) -> list[Claim]: ...


class Outcomes(Protocol):
    """What the producer reads of the completer."""

    @property
    def queued(self) -> int: ...

    def flush(self, timeout: float) -> bool: ...


class Producer:
    """Claims for the free slots of `slots` whenever woken (see the module docstring), until
    `stopping` is set or `interrupted()` says so."""

    def __init__(self, config: WorkerConfig, claimer: Claimer, slots: Slots,
                 outcomes: Outcomes, *,
                 wake: threading.Event, stopping: threading.Event,
                 interrupted: Callable[[], bool] = lambda: False,
                 outage: Outage | None = None) -> None:
        self.config = config
        self.outage = outage or Outage()
        self.claimer = claimer
        self.conn = claimer.conn  # the loop's own connection: it also releases and checks
        self.slots = slots
        self.outcomes = outcomes
        self._wake = wake
        self._stopping = stopping
        self.interrupted = interrupted
        self._notified = False
        self._due: list[float] = []  # monotonic times of retries this worker scheduled (heap)
        self._due_lock = threading.Lock()
        # Claim-ahead (see the module docstring): the jobs held beyond the handlers, resized
        # from the finishing rate every RATE_WINDOW.
        self.ahead = 0
        self.rate = 0.0
        self.rate_at = time.monotonic()
        self._rate_finished = 0
        self.batch_threshold = max(1, config.concurrency // 2)
        self.idle_horizon = 0.0

    @property
    def claimed(self) -> int:
        return self.claimer.claimed

    # -- wake-ups (called from the parts' threads) ----------------------------------------------

    def wake(self) -> None:
        """Look now (an outcome was written, capacity freed, a stop)."""
        self._wake.set()

    def notified(self) -> None:
        """A NOTIFY for one of our queues: claim even without a batch's worth of free slots."""
        self._notified = True
        self._wake.set()

    def wake_at(self, delay: float) -> None:
        """A job is due in `delay` seconds (a retry this worker wrote, or a delayed job whose
        NOTIFY it saw): claim then, not at the next poll, so a 0.2 s retry runs 0.2 s later
        whatever the poll interval."""
        if not math.isfinite(delay) or delay <= 0:
            self._wake.set()  # now (NaN or infinity name no time: a hostile NOTIFY)
            return
        if delay >= self.config.poll_interval:
            return  # the poll comes first anyway
        with self._due_lock:
            if len(self._due) < MAX_WAKE_TIMES:
                heapq.heappush(self._due, time.monotonic() + delay)
        self._wake.set()

    def slot_freed(self, in_flight: int) -> None:
        # Wake the loop only when it would claim: a batch's worth of free slots, or none
        # busy. Waking it per finished job would cost a wake-up per job for nothing.
        if in_flight == 0 or (self.config.concurrency + self.ahead - in_flight
                              >= self.batch_threshold):
            self._wake.set()

    def take_due(self, now: float) -> tuple[bool, float]:
        """(whether a scheduled retry is due now, when the next one is)."""
        due = False
        with self._due_lock:
            while self._due and self._due[0] <= now:
                heapq.heappop(self._due)
                due = True
            return due, self._due[0] if self._due else math.inf

    # -- sizing ---------------------------------------------------------------------------------

    def free_slots(self) -> int:
        """Slots a claim may fill: the handlers, plus the claim-ahead, less the claims held."""
        c = self.config.concurrency
        return c + self.ahead - self.slots.in_flight - max(0, self.outcomes.queued - c)

    def free_handlers(self) -> int:
        """Handlers free now: a job claimed for one starts at once (limited queues only
        claim that many, never ahead: see `Claimer.run_once`)."""
        return max(0, self.config.concurrency - self.slots.in_flight)

    def size_claim_ahead(self, now: float) -> None:
        """Resize the claim-ahead from the rate handlers finished at since the last window;
        hand back what waited in it too long (and start measuring afresh)."""
        c = self.config
        if self.slots.oldest_ready_age() > CLAIM_AHEAD_MAX_WAIT:
            stale = self.slots.take_ready(older_than=CLAIM_AHEAD_MAX_WAIT)
            if stale:
                self.release(stale, "handed back jobs claimed ahead that did not start in "
                             f"{CLAIM_AHEAD_MAX_WAIT}s (handlers slowed down)", INFO)
            self.rate, self.ahead = 0.0, 0
            self.batch_threshold = max(1, c.concurrency // 2)
        if now - self.rate_at < RATE_WINDOW:
            return
        finished = self.slots.finished
        rate = (finished - self._rate_finished) / (now - self.rate_at)
        self.rate = rate if rate > self.rate else 0.5 * (self.rate + rate)
        self.rate_at, self._rate_finished = now, finished
        cap = (c.concurrency * CLAIM_AHEAD_MAX_FACTOR if c.claim_ahead is None
               else c.claim_ahead)
        self.ahead = min(cap, int(self.rate * CLAIM_AHEAD_HORIZON))
        self.batch_threshold = max(1, (c.concurrency + self.ahead) // 2)

    # -- claiming -------------------------------------------------------------------------------

    def claim(self, limit: int) -> list[ClaimedJob]:
        """Claim up to `limit` due jobs without running them (the bench measures claims)."""
        got: list[ClaimedJob] = []
        self.claimer.run_once(limit, submit=got.append)
        return got

    def has_due_jobs(self) -> bool:
        """Whether a job of our queues is due within `idle_horizon` seconds."""
        return self.claimer.store.due_jobs_exist(self.claimer.queues, self.idle_horizon)

    def run(self, until_idle: bool = False) -> None:
        """The claim loop: until `stopping` or `interrupted()`, or with `until_idle` until no
        job is due within `idle_horizon` seconds and nothing is running."""
        c = self.config
        next_poll = 0.0
        backlog = True
        backoff = 0.1
        while not self._stopping.is_set():
            if self.interrupted():
                break
            now = time.monotonic()
            self.size_claim_ahead(now)
            batch_threshold = self.batch_threshold
            free = self.free_slots()
            notified, self._notified = self._notified, False
            retry_due, next_due = self.take_due(now)
            due_poll = now >= next_poll
            # `held_back`: the last claim found due jobs a queue's limits held back; capacity
            # frees as jobs end (ours wake this loop; others' are seen at the quick re-poll).
            if free > 0 and (notified or due_poll or retry_due or self.claimer.held_back
                             or (backlog and free >= batch_threshold)):
                try:
                    if due_poll:  # pauses and limits others set: seen within a poll
                        self.claimer.refresh()
                    got = self.claimer.run_once(free, free_handlers=self.free_handlers())
                    backoff = 0.1
                    self.outage.ok()
                except DB_ERRORS as exc:
                    self.outage.failed("claim", exc, retry_in_s=round(backoff, 2))
                    self._stopping.wait(backoff)
                    backoff = min(backoff * 2, DB_BACKOFF_MAX)
                    continue
                if due_poll:
                    next_poll = now + c.poll_interval
                if self.claimer.held_back:  # a limit, not an empty queue, stopped the claim
                    next_poll = min(next_poll, now + LIMITED_RETRY * (0.5 + random.random()))
                backlog = got == free
                if until_idle and not got and self.slots.in_flight == 0:
                    if self.outcomes.flush(IDLE_FLUSH) and not self.has_due_jobs():
                        return
                    continue
                if backlog and self.free_slots() >= batch_threshold:
                    continue
            timeout = max(0.0, min(next_poll, next_due) - time.monotonic())
            if until_idle:
                timeout = min(timeout, IDLE_CHECK)
            self._wake.wait(min(timeout, MAX_SLEEP))
            self._wake.clear()

    def release(self, claims: list[Claim],
                note: str = "released unfinished jobs at shutdown (attempt not counted)",
                level: int = WARNING) -> None:
        """Hand `claims` back (pending again, the attempt not counted), and say so."""
        try:
            # The claim loop's connection: the loop (or the shutdown after it) is the caller.
            # The store locks them in id order, the lock order of heartbeats and completions.
            released = self.claimer.store.release(claims)
            log_event(level, note, job_ids=",".join(str(i) for i in released))
        except DB_ERRORS as exc:
            log_event(ERROR, "could not release unfinished jobs; the reaper will requeue them",
                      error=first_line(exc))
