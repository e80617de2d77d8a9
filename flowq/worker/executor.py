"""Executor: runs attempts, sync handlers on threads and `async def` ones on an event loop it
owns, in at most `concurrency` slots, and hands each outcome to the completer.

What an attempt does and how its outcome is judged is `flowq.worker.attempt` (shared with the
test kit); the executor decides where and when it runs. A job claimed while every slot is
busy waits in the claim-ahead buffer and starts as soon as a slot frees, without a round trip
to the database. Nothing a handler does can take a slot away. Attempts are keyed by their
claim, (job id, lease): a job reaped and claimed again by this same worker while its old
attempt still runs is simply another attempt.

Timeouts (found by `flowq.worker.watchdog`): a sync handler cannot be killed, so it is
abandoned: a new thread takes its slot, whatever it returns later is discarded, and its open
`ctx.session` transaction is ended on the server at once (`end_backend`, see
`flowq.worker.sessions`). An async handler is cancelled, and abandoned the same way if it
ignores that. A blocked event loop is replaced by a fresh one; the other attempts left on it
are retried at once (counting against the cap).

Callbacks, given at construction: `on_slot_free(in_flight)` after each attempt settles,
`on_start(job, waited)` as each starts (the seconds it waited claimed ahead: the metrics'
pickup delay), `end_backend(pid)` ends a server process (None, e.g. behind PgBouncer: an
abandoned attempt's transaction ends when its handler does). Tracing (`flowq.tracing`): each
attempt is a CONSUMER span, current while the handler runs, ended with the outcome.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flowq import tracing
from flowq.db.rows import Claim, ClaimedJob
from flowq.define.app import FlowQ
from flowq.durable.session import StepSession
from flowq.storable import describe, first_line
from flowq.worker.attempt import SUMMARY_CHARS, Attempt, arun_attempt, run_attempt
from flowq.worker.completer import Completer
from flowq.worker.logs import ERROR, INFO, WARNING, log_event
from flowq.worker.model import Failed, Outcome, Succeeded
from flowq.worker.resolution import Elsewhere
from flowq.worker.sessions import close_quietly, end_transaction
from flowq.worker.watchdog import EventLoop, Watchdog

__all__ = ["Executor"]


@dataclass(eq=False)
class _Running:
    attempt: Attempt
    queued: float  # when it was handed over (monotonic): its age in the claim-ahead
    deadline: float | None = None  # set as it starts, from its step's timeout
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False  # set once, by whoever finishes first: the handler or the watchdog
    loop: EventLoop | None = None  # async attempts: the loop running them
    task: asyncio.Task[None] | None = None  # async attempts, once begun on their loop
    began: bool = False  # its coroutine began: cancelling its task now reaches its code
    span: Any = None  # the attempt's CONSUMER span when tracing (flowq.tracing)

    @property
    def job(self) -> ClaimedJob:
        return self.attempt.job


class Executor:
    """Runs up to `concurrency` handlers at once and reports each finished slot."""

    def __init__(self, app: FlowQ, completer: Completer, *, concurrency: int,
                 session_factory: Callable[[], StepSession],
                 on_slot_free: Callable[[int], None],
                 on_start: Callable[[ClaimedJob, float], None] | None = None,
                 end_backend: Callable[[int], None] | None = None,
                 elsewhere: Callable[[], Elsewhere] | None = None) -> None:
        self.app = app
        self.elsewhere = elsewhere  # what other workers serve (`attempt.resolve`)
        self.completer = completer
        self.concurrency = concurrency
        self.session_factory = session_factory
        self.on_slot_free = on_slot_free
        self.on_start = on_start
        self.end_backend = end_backend
        self._work: queue.SimpleQueue[_Running | None] = queue.SimpleQueue()
        self._running: dict[Claim, _Running] = {}  # every claim held: running or ready
        self._ready: collections.deque[_Running] = collections.deque()  # claimed ahead
        self._active = 0  # handlers started and not finished: at most `concurrency`
        self.finished = 0  # attempts finished so far (the worker sizes its claim-ahead on it)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._loop: EventLoop | None = None
        self.watchdog = Watchdog(unsettled=self._unsettled, abandon=self._abandon,
                                 current_loop=self._current_loop,
                                 replace_loop=self._replace_loop)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        for _ in range(self.concurrency):
            self.spawn_thread()
        self.watchdog.start()

    def spawn_thread(self) -> None:
        """Start one more handler thread (at start, and in place of a stuck one)."""
        t = threading.Thread(target=self._thread_main, name="flowq-handler", daemon=True)
        self._threads.append(t)
        t.start()

    def _ensure_loop(self) -> EventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = EventLoop.new()
            return self._loop

    def _current_loop(self) -> EventLoop | None:
        with self._lock:
            return self._loop

    def stop(self) -> None:
        for _ in self._threads:
            self._work.put(None)
        loop = self._current_loop()
        if loop is not None:
            loop.stop()
        self.watchdog.stop()

    @property
    def in_flight(self) -> int:
        """Claims held: running handlers and jobs ready in the claim-ahead buffer."""
        with self._lock:
            return len(self._running)

    @property
    def active(self) -> int:
        """Handlers running (at most `concurrency`)."""
        with self._lock:
            return self._active

    @property
    def ready(self) -> int:
        """Jobs claimed ahead, waiting for a handler to finish."""
        with self._lock:
            return len(self._ready)

    def running_claims(self) -> list[Claim]:
        with self._lock:
            return list(self._running)

    def unsettled_claims(self) -> list[Claim]:
        """The claims whose handler has not finished (nor been abandoned) yet."""
        with self._lock:
            return [c for c, r in self._running.items() if not r.done]

    def _unsettled(self) -> list[_Running]:
        with self._lock:
            return [r for r in self._running.values() if not r.done]

    def cancel(self, claims: list[Claim]) -> None:
        """Tell the handlers of `claims` that their run was cancelled: `ctx.cancelled` turns
        True, and an `async def` handler's task is cancelled."""
        with self._lock:
            recs = [r for c in claims if (r := self._running.get(c)) is not None and not r.done]
        for rec in recs:
            if rec.attempt.cancelled:
                continue
            rec.attempt.cancelled = True
            if rec.loop is not None:
                rec.loop.call(self._cancel_task, rec)
            log_event(INFO, "run cancelled; told the running handler", job_id=rec.job.id,
                      task=rec.job.task, step=rec.job.step)

    # -- dispatch ---------------------------------------------------------------------------

    def submit(self, job: ClaimedJob) -> None:
        """Start `job` now if fewer than `concurrency` handlers run, else keep it ready (the
        claim-ahead buffer): it starts as soon as a handler finishes, on that handler's
        thread's hand-off, without a round trip to the database."""
        attempt = Attempt(self.app, job, read=self._read, session_factory=self.session_factory,
                          elsewhere=self.elsewhere() if self.elsewhere is not None else None)
        rec = _Running(attempt, queued=time.monotonic())
        with self._lock:
            self._running[job.claim] = rec
            start = self._active < self.concurrency
            if start:
                self._active += 1
            else:
                self._ready.append(rec)
        if start and not self._start(rec):
            self._finish_slot(rec)

    def _start(self, rec: _Running) -> bool:
        """Run `rec` (its slot is counted in `_active`): the attempt's clock starts here.
        False if it could not start: the caller frees its slot."""
        job, step = rec.job, rec.attempt.step
        rec.attempt.started = now = time.monotonic()
        rec.deadline = now + step.timeout if step is not None and step.timeout else None
        if self.on_start is not None:
            try:
                self.on_start(job, now - rec.queued)
            except Exception as exc:
                log_event(ERROR, "start callback crashed", error=repr(exc))
        if tracing.ENABLED:
            rec.span = tracing.start_attempt(job, step.name if step is not None else job.step)
        try:
            if step is not None and step.is_async:
                loop = self._ensure_loop()
                loop.loop.call_soon_threadsafe(self._begin_async, rec, loop)
                rec.loop = loop  # after: a cancel sent through it follows the beginning
            else:
                self._work.put(rec)
        except BaseException as exc:
            # Not started: forget it, so that it is neither heartbeated nor holding a slot
            # (the claim runs out and the reaper requeues the job).
            if rec.span is not None:
                tracing.end_attempt(rec.span, None)
            log_event(ERROR, "could not start a claimed job", job_id=job.id,
                      error=first_line(describe(exc)))
            rec.done = True
            return False
        return True

    def take_ready(self, older_than: float | None = None) -> list[Claim]:
        """Take jobs out of the claim-ahead buffer: all of them (at shutdown), or those
        waiting longer than `older_than` seconds. They never start here; the caller hands
        their claims back."""
        cutoff = None if older_than is None else time.monotonic() - older_than
        taken: list[_Running] = []
        with self._lock:
            while self._ready and (cutoff is None or self._ready[0].queued < cutoff):
                rec = self._ready.popleft()
                self._running.pop(rec.job.claim, None)
                taken.append(rec)
        return [rec.job.claim for rec in taken]

    def oldest_ready_age(self) -> float:
        """Seconds the oldest job claimed ahead has waited (0 when none)."""
        with self._lock:
            return time.monotonic() - self._ready[0].queued if self._ready else 0.0

    def _read(self, statement: Any, params: dict[str, Any]) -> list[Any]:
        """Rows of one workflow read, on a short session of its own (no claim is held by it)."""
        with self.session_factory() as session:
            return list(session.execute(statement, params))

    # -- running a handler ------------------------------------------------------------------

    def _thread_main(self) -> None:
        while True:
            rec = self._work.get()
            if rec is None:
                return
            try:
                outcome = run_attempt(rec.attempt, span=rec.span)
            except BaseException as exc:  # a flowq bug: the attempt fails, the thread lives
                log_event(ERROR, "handler thread crashed; the attempt fails", job_id=rec.job.id,
                          error=first_line(describe(exc)))
                text = describe(exc)
                outcome = Failed(text, None, first_line(text)[:SUMMARY_CHARS])
            if not self._settle(rec, outcome):
                return  # abandoned after a timeout: a replacement thread holds the slot

    def _begin_async(self, rec: _Running, loop: EventLoop) -> None:
        """On the loop: start `rec`'s task, unless it was abandoned or its loop is stopping
        (then no coroutine is made: one made and never run would be left un-awaited)."""
        if not rec.done and not loop.stopping:
            rec.task = loop.loop.create_task(self._run_async(rec))

    def _cancel_task(self, rec: _Running) -> None:
        """On the loop: cancel `rec`'s task once its coroutine began (a task cancelled before
        its first step never runs the code that settles its attempt)."""
        task = rec.task
        if task is None or task.done():
            return
        if rec.began:
            task.cancel()
        else:
            asyncio.get_running_loop().call_soon(self._cancel_task, rec)

    async def _run_async(self, rec: _Running) -> None:
        rec.began = True
        outcome = await arun_attempt(rec.attempt, span=rec.span)
        if rec.done:  # abandoned by the watchdog: nothing to write, no thread needed
            self._settle(rec, outcome)
            return
        # Completion may block on the database: not on the loop, where other handlers run.
        await asyncio.to_thread(self._settle, rec, outcome)

    def _settle(self, rec: _Running, outcome: Outcome) -> bool:
        """Hand the outcome on, unless the watchdog got there first; False if it did."""
        with rec.lock:
            abandoned, rec.done = rec.done, True
        attempt = rec.attempt
        duration = attempt.elapsed()
        session = attempt.ctx.opened_session if attempt.ctx is not None else None
        try:
            if abandoned:
                close_quietly(session, "rollback")
                log_event(WARNING, "late result of an abandoned attempt discarded",
                          job_id=rec.job.id, task=rec.job.task, step=rec.job.step,
                          duration_ms=round(duration * 1000, 2))
                return False
            if session is not None and isinstance(outcome, Succeeded):
                try:
                    self.completer.submit(rec.job, outcome, duration, session=session)
                except BaseException as exc:  # the handler's writes failed at commit
                    outcome = attempt.failure(exc, duration)
                    self.completer.submit(rec.job, outcome, duration)
            else:
                close_quietly(session, "rollback")
                self.completer.submit(rec.job, outcome, duration)
        finally:
            close_quietly(session, "close")
            if not abandoned:
                if rec.span is not None:
                    tracing.end_attempt(rec.span, outcome, attempt.error)
                self._finish_slot(rec)
        return True

    # -- abandoning -------------------------------------------------------------------------

    def _abandon(self, rec: _Running, outcome: Outcome) -> bool:
        """Settle `rec` from outside its handler (the watchdog); False if it had settled.

        The slot is freed first: nothing after that point may cost it. The abandoned
        attempt's `ctx.session` transaction is ended on the server at once (its connection
        is terminated), so its row locks do not block the next attempt of the same step."""
        with rec.lock:
            if rec.done:
                return False
            rec.done = True
            # Under the lock: the handler's thread cannot settle (and hand its connection back
            # to the pool, where another attempt could take it) before this is done.
            end_transaction(rec.attempt, self.end_backend)
        self.completer.submit(rec.job, outcome, rec.attempt.elapsed())
        if rec.span is not None:
            tracing.end_attempt(rec.span, outcome, rec.attempt.error)
        self._finish_slot(rec)
        if rec.loop is not None:
            rec.loop.call(self._cancel_task, rec)
        else:
            try:
                self.spawn_thread()  # the stuck thread keeps its OS thread; the slot gets a new one
            except Exception as exc:  # e.g. "can't start new thread": fewer threads, not a leak
                log_event(ERROR, "could not start a replacement handler thread",
                          error=first_line(describe(exc)))
        return True

    def _replace_loop(self, stuck: EventLoop, now: float) -> None:
        with self._lock:
            if self._loop is stuck:
                self._loop = None  # the next async attempt starts a fresh loop
            left = [r for r in self._running.values() if r.loop is stuck and not r.done]
        stuck.stop()  # if it ever unblocks
        log_event(ERROR, "event loop blocked by a handler; replaced by a fresh loop",
                  blocked_s=round(now - stuck.last_tick, 1),
                  retried_job_ids=",".join(str(r.job.id) for r in left))
        reason = "EventLoopBlocked: a handler blocked the event loop this attempt ran on"
        for rec in left:
            self._abandon(rec, rec.attempt.retried(0.0, reason, failed_as=reason,
                                                   summary="EventLoopBlocked"))

    def _finish_slot(self, rec: _Running) -> None:
        """Free `rec`'s slot, or pass it on to the next job claimed ahead (`_active` then
        stays as it is)."""
        with self._lock:
            self._running.pop(rec.job.claim, None)
            self.finished += 1
        while True:
            with self._lock:
                following = self._ready.popleft() if self._ready else None
                if following is None:
                    self._active -= 1
            if following is None or self._start(following):
                break
            with self._lock:  # could not start: forgotten, the reaper requeues it
                self._running.pop(following.job.claim, None)
        with self._lock:
            in_flight = len(self._running)
        try:
            self.on_slot_free(in_flight)
        except Exception as exc:
            log_event(ERROR, "slot callback crashed", error=repr(exc))

