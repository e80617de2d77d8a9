"""Executor: runs handlers, sync ones on threads and `async def` ones on an event loop it owns,
and decides each attempt's outcome.

It turns a claimed job into an outcome: it resolves the task and step from the app (an
unknown name or a removed step is a failure to retry later, not a crash), builds the
context, calls the handler, checks the result, and asks the step's retry policy what a
failure means (retry after how long, or `dead`). The completer only writes what it is given.

Nothing a handler does can take a slot away: any `BaseException` (`SystemExit` and
`KeyboardInterrupt` included) fails the attempt, an exception whose `__str__` raises is
described by its type, and a retry policy that raises fails the attempt for good with both
errors in `last_error`. A result flowq cannot store fails the step for good (`dead`): running
the handler again would repeat its side effects and return the same value.

Attempts are keyed by their claim, (job id, lease): a job reaped and claimed again by this
same worker while its old attempt still runs is simply another attempt.

Timeouts: a watchdog thread (every `WATCH_INTERVAL`) fails every attempt past its step's
`timeout`, sync or async. A sync handler cannot be killed, so it is abandoned: a replacement
thread takes its slot, and whatever the stuck thread returns later is discarded (its
`ctx.session` writes roll back). An async handler is cancelled; if it ignores cancellation it
is abandoned the same way. If the event loop itself is blocked past a deadline (a handler
calling `time.sleep` inside `async def`), the loop is replaced by a fresh one and the other
attempts left on the blocked loop are retried at once (the attempt counts against the cap).

Tracing (`flowq.tracing`, only when OpenTelemetry is installed): each attempt is a CONSUMER
span, started at submit, current while the handler runs, ended with the outcome handed on.
"""

from __future__ import annotations

import asyncio
import collections
import json
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final

from flowq import tracing
from flowq.context import Context, StepSession
from flowq.db.rows import Claim, ClaimedJob
from flowq.db.sql import queries
from flowq.define.app import FlowQ
from flowq.define.pipeline import Pipeline
from flowq.define.retry import Retry
from flowq.define.step import Step
from flowq.define.workflows import Each
from flowq.errors import (
    CancelRun,
    InvalidArgumentsError,
    RetryStep,
    SignalTimeout,
    UnknownTaskError,
    WorkflowError,
)
from flowq.jsonargs import JSONError, dumps_checked
from flowq.storable import clamp_delay, delay_of, describe, first_line, safe_str, storable_text
from flowq.worker.completer import Completer
from flowq.worker.logs import ERROR, INFO, WARNING, log_event
from flowq.worker.model import Cancelled, Failed, Outcome, Retried, Spawn, Succeeded

__all__ = ["Executor", "InvalidResultError", "StepTimeout"]

# How often the watchdog looks for attempts past their deadline: a timeout fires this late
# at most.
WATCH_INTERVAL: Final = 0.1
# The event loop schedules a tick this often; a loop whose last tick is older than
# LOOP_STALL when one of its attempts passes its deadline is blocked, and is replaced.
LOOP_TICK: Final = 0.1
LOOP_STALL: Final = 1.0
# A loop that has not ticked for this long while attempts wait on it is replaced, deadline or
# not. Long enough for an async handler's honest blocking call (a slow ctx.session query).
LOOP_BLOCKED_FOR: Final = 10.0
_DEFAULT_RETRY: Final = Retry()
SUMMARY_CHARS: Final = 300  # of an error, in log lines (last_error keeps MAX_TEXT_CHARS)


class StepTimeout(Exception):
    """The handler ran longer than its step's timeout."""


class InvalidResultError(Exception):
    """The handler's result cannot be stored or does not fit the next step."""


@dataclass(eq=False)
class _Loop:
    """An event loop on its own thread, with the time of its last tick (to tell it is blocked)."""

    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    last_tick: float = field(default_factory=time.monotonic)

    def tick(self) -> None:
        self.last_tick = time.monotonic()
        self.loop.call_later(LOOP_TICK, self.tick)

    def blocked(self, now: float) -> bool:
        return now - self.last_tick > LOOP_STALL


@dataclass(eq=False)
class _Running:
    job: ClaimedJob
    started: float
    deadline: float | None
    resolved: tuple[Pipeline, Step[Any, Any]] | Exception  # resolved once, at submit
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False  # set once, by whoever finishes first: the handler or the watchdog
    loop: _Loop | None = None  # async attempts: the loop running them
    future: Future[None] | None = None
    ctx: Context | None = None  # once prepared: its session's connection, to end on abandon
    cancelled: bool = False  # the run was cancelled while it ran (seen by the heartbeat)
    span: Any = None  # the attempt's CONSUMER span when tracing (flowq.tracing)
    error: BaseException | None = None  # what failed it, for the span (tracing only)
    queued: float = 0.0  # when it was handed over (monotonic): its age in the claim-ahead

    @property
    def step(self) -> Step[Any, Any] | None:
        return self.resolved[1] if isinstance(self.resolved, tuple) else None


class Executor:
    """Runs up to `concurrency` handlers at once and reports each finished slot."""

    def __init__(self, app: FlowQ, completer: Completer, *, concurrency: int,
                 session_factory: Callable[[], StepSession],
                 on_slot_free: Callable[[int], None]) -> None:
        self.app = app
        self.completer = completer
        self.concurrency = concurrency
        self.session_factory = session_factory
        self.on_slot_free = on_slot_free
        self._work: queue.SimpleQueue[_Running | None] = queue.SimpleQueue()
        self._running: dict[Claim, _Running] = {}  # every claim held: running or ready
        self._ready: collections.deque[_Running] = collections.deque()  # claimed ahead
        self._active = 0  # handlers started and not finished: at most `concurrency`
        self.finished = 0  # attempts finished so far (the worker sizes its claim-ahead on it)
        # Called as each attempt starts, with the seconds it waited claimed ahead (the
        # metrics' pickup delay).
        self.on_start: Callable[[ClaimedJob, float], None] | None = None
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._loop: _Loop | None = None
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None
        # Ends a database backend by pid (the worker's maintenance pool): how an abandoned
        # attempt's open transaction is rolled back at once. None: left to the stuck thread.
        self.end_backend: Callable[[int], None] | None = None
        self.loop_blocked_for = LOOP_BLOCKED_FOR
        # How workflow reads (a join's mapped inputs, a late signal) reach the database.
        self.read: Callable[[Any, dict[str, Any]], list[Any]] | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        for _ in range(self.concurrency):
            self._spawn()
        self._watchdog = threading.Thread(target=self._watch, name="flowq-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def _spawn(self) -> None:
        t = threading.Thread(target=self._thread_main, name="flowq-handler", daemon=True)
        self._threads.append(t)
        t.start()

    def _ensure_loop(self) -> _Loop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                t = threading.Thread(target=loop.run_forever, name="flowq-asyncio",
                                     daemon=True)
                self._loop = _Loop(loop, t)
                loop.call_soon_threadsafe(self._loop.tick)
                t.start()
            return self._loop

    def stop(self) -> None:
        self._stopping.set()
        for _ in self._threads:
            self._work.put(None)
        if self._loop is not None:
            self._loop.loop.call_soon_threadsafe(self._loop.loop.stop)
        if self._watchdog is not None:
            self._watchdog.join(timeout=2.0)

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

    def cancel(self, claims: list[Claim]) -> None:
        """Tell the handlers of `claims` that their run was cancelled: `ctx.cancelled` turns
        True, and an `async def` handler's task is cancelled."""
        with self._lock:
            recs = [r for c in claims if (r := self._running.get(c)) is not None and not r.done]
        for rec in recs:
            if rec.cancelled:
                continue
            rec.cancelled = True
            if rec.ctx is not None:
                rec.ctx._cancelled = True
            if rec.future is not None:
                rec.future.cancel()
            log_event(INFO, "run cancelled; told the running handler", job_id=rec.job.id,
                      task=rec.job.task, step=rec.job.step)

    # -- dispatch ---------------------------------------------------------------------------

    def submit(self, job: ClaimedJob) -> None:
        """Start `job` now if fewer than `concurrency` handlers run, else keep it ready (the
        claim-ahead buffer): it starts as soon as a handler finishes, on that handler's
        thread's hand-off, without a round trip to the database."""
        rec = _Running(job, 0.0, None, self._resolve(job), queued=time.monotonic())
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
        job, resolved = rec.job, rec.resolved
        timeout = resolved[1].timeout if isinstance(resolved, tuple) else None
        rec.started = now = time.monotonic()
        rec.deadline = now + timeout if timeout else None
        if self.on_start is not None:
            try:
                self.on_start(job, now - rec.queued)
            except Exception as exc:
                log_event(ERROR, "start callback crashed", error=repr(exc))
        if tracing.ENABLED:
            rec.span = tracing.start_attempt(
                job, resolved[1].name if isinstance(resolved, tuple) else job.step)
        coro = None
        try:
            if isinstance(resolved, tuple) and resolved[1].is_async:
                rec.loop = self._ensure_loop()
                coro = self._run_async(rec, *resolved)
                rec.future = asyncio.run_coroutine_threadsafe(coro, rec.loop.loop)
            else:
                self._work.put(rec)
        except BaseException as exc:
            # Not started: forget it, so that it is neither heartbeated nor holding a slot
            # (the claim runs out and the reaper requeues the job).
            if coro is not None:
                coro.close()
            if rec.span is not None:
                tracing.end_attempt(rec.span, None)
            # The claim runs out and the reaper requeues the job.
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

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL):
            try:
                self.check_timeouts()
            except Exception as exc:  # a bug here must not end the watching
                log_event(ERROR, "timeout watchdog crashed; continuing", error=repr(exc))

    def check_timeouts(self) -> int:
        """Fail every attempt past its deadline; returns how many were abandoned."""
        now = time.monotonic()
        with self._lock:
            late = [r for r in self._running.values()
                    if r.deadline is not None and r.deadline <= now and not r.done]
        abandoned = 0
        blocked: set[_Loop] = set()
        for rec in late:
            assert rec.deadline is not None
            exc = StepTimeout(f"step {rec.job.step!r} of {rec.job.task!r} exceeded its timeout "
                              f"of {rec.deadline - rec.started:.1f}s")
            if self._abandon(rec, self._failure(rec, exc, now - rec.started)):
                abandoned += 1
                if rec.loop is not None and rec.loop.blocked(now):
                    blocked.add(rec.loop)
        # A loop blocked for long with attempts waiting on it is replaced even when none of
        # them has a deadline (or the blocker's was so short that it was abandoned before the
        # loop counted as blocked): otherwise those attempts would hold their slots, and be
        # heartbeated, for as long as the blocker blocks.
        with self._lock:
            current = self._loop
            waiting = current is not None and any(
                r.loop is current and not r.done for r in self._running.values())
        if current is not None and waiting and now - current.last_tick > self.loop_blocked_for:
            blocked.add(current)
        for stuck in blocked:
            self._replace_loop(stuck, now)
        return abandoned

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
            self._end_transaction(rec)
        self.completer.submit(rec.job, outcome, time.monotonic() - rec.started)
        if rec.span is not None:
            tracing.end_attempt(rec.span, outcome, rec.error)
        self._finish_slot(rec)
        if rec.future is not None:
            rec.future.cancel()  # thread-safe: cancels the task on its loop
        else:
            try:
                self._spawn()  # the stuck thread keeps its OS thread; the slot gets a new one
            except Exception as exc:  # e.g. "can't start new thread": fewer threads, not a leak
                log_event(ERROR, "could not start a replacement handler thread",
                          error=first_line(describe(exc)))
        return True

    def _end_transaction(self, rec: _Running) -> None:
        pid = _backend_pid(rec.ctx)
        if pid is None or self.end_backend is None:
            return
        try:
            self.end_backend(pid)
        except Exception as exc:
            log_event(WARNING, "could not end an abandoned attempt's transaction",
                      job_id=rec.job.id, error=first_line(describe(exc)))

    def _replace_loop(self, stuck: _Loop, now: float) -> None:
        with self._lock:
            if self._loop is stuck:
                self._loop = None  # the next async attempt starts a fresh loop
            left = [r for r in self._running.values() if r.loop is stuck and not r.done]
        stuck.loop.call_soon_threadsafe(stuck.loop.stop)  # if it ever unblocks
        log_event(ERROR, "event loop blocked by a handler; replaced by a fresh loop",
                  blocked_s=round(now - stuck.last_tick, 1),
                  retried_job_ids=",".join(str(r.job.id) for r in left))
        for rec in left:
            reason = "EventLoopBlocked: a handler blocked the event loop this attempt ran on"
            cap = rec.step.retry.attempt_cap if rec.step is not None else rec.job.max_attempts
            self._abandon(rec, Retried(0.0, reason) if rec.job.attempts < cap
                          else Failed(f"{reason} (the attempt cap of {cap} is reached)", None,
                                      "EventLoopBlocked"))

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

    # -- deciding outcomes ------------------------------------------------------------------

    def _resolve(self, job: ClaimedJob) -> tuple[Pipeline, Step[Any, Any]] | Exception:
        pipeline = self.app.get(job.task)
        if pipeline is None:
            return UnknownTaskError(
                f"no task or pipeline named {job.task!r} is registered in this worker's app "
                "(enqueued by a newer producer, or renamed?); it will be retried")
        step = pipeline.step_named(job.step) if job.step else pipeline.first
        if step is None:
            return UnknownTaskError(
                f"pipeline {job.task!r} has no step named {job.step!r} (removed or renamed in "
                "a deploy?); it will be retried")
        return pipeline, step

    def _failure(self, rec: _Running, exc: BaseException, duration: float, *,
                 permanent: bool = False) -> Failed:
        """The outcome of a failed attempt: when to retry it by its step's policy, or dead."""
        job, text = rec.job, describe(exc)
        summary = first_line(text)[:SUMMARY_CHARS]
        if rec.span is not None:
            rec.error = exc
        step = rec.step
        # Running again would fail the same way; a missed signal is retried only by a policy
        # the step was given.
        if permanent or isinstance(exc, WorkflowError) or (
                isinstance(exc, SignalTimeout) and not (step is not None and step.retry_given)):
            return Failed(text, None, summary)
        policy = step.retry if step is not None else None
        try:
            if policy is not None:
                # The step's policy knows its own cap; the row's copy may be stale (enqueued by
                # name without the definition, or the policy changed in a deploy).
                delay = policy.next_delay(job.attempts, exc, job.age + duration)
            elif job.attempts < job.max_attempts:
                delay = _DEFAULT_RETRY.next_delay(job.attempts, exc, job.age + duration)
            else:
                delay = None
        except BaseException as policy_error:  # a predicate like `e.code >= 500` on a ValueError
            text = storable_text(f"{text}\n\nThe step's retry policy raised while judging this "
                                 f"failure, so it is not retried:\n{describe(policy_error)}")
            return Failed(text, None, summary)
        # A wait without a `max` grows past any date (wait_exponential at attempt 50): clamp.
        return Failed(text, None if delay is None else clamp_delay(delay), summary)

    def _prepare(self, rec: _Running, step: Step[Any, Any]) -> tuple[Context, dict[str, Any]]:
        job = rec.job
        try:
            args = json.loads(job.args)
            if not isinstance(args, dict):
                raise InvalidArgumentsError("the stored arguments are not a JSON object")
            if job.joined:
                self._gather(job, step, args)
            if step.wait_for is not None and step.wait_for not in args:
                self._receive(job, step, args)
            step.check_arguments(args, what=f"stored arguments of job {job.id}")
        except ValueError as exc:
            raise InvalidArgumentsError(f"job {job.id}: {exc}") from None
        ctx = Context(job_id=job.id, run_id=job.run_id, task=job.task, step=step.name,
                      attempt=job.attempts, queue=job.queue,
                      _session_factory=self.session_factory, map_index=job.map_index,
                      _scheduled_at=job.scheduled_at,
                      _cancelled=rec.cancelled or job.cancel_requested)
        rec.ctx = ctx
        return ctx, args

    def _read(self, statement: Any, params: dict[str, Any]) -> list[Any]:
        """Rows of one workflow read, on a short session of its own (no claim is held by it),
        unless `read` was given one (the test kit reads in the test's transaction)."""
        if self.read is not None:
            return self.read(statement, params)
        with self.session_factory() as session:
            return list(session.execute(statement, params))

    def _gather(self, job: ClaimedJob, step: Step[Any, Any], args: dict[str, Any]) -> None:
        """A join's inputs: the static parents' results came with the row; a mapped parent's
        are its instances' results, read now, in item order (none: it mapped `[]`)."""
        q = queries(self.app.schema)
        for parent in step.parents:
            if parent not in args:
                rows = self._read(q.select_map_results, {"run_id": job.run_id, "step": parent})
                args[parent] = [r[0] for r in rows]

    def _receive(self, job: ClaimedJob, step: Step[Any, Any], args: dict[str, Any]) -> None:
        """A waiting step that runs without its payload: its timeout passed, unless the signal
        came while it was between attempts."""
        assert step.wait_for is not None
        rows = self._read(queries(self.app.schema).find_signal,
                          {"run_id": job.run_id, "name": step.wait_for})
        if not rows:
            raise SignalTimeout(f"signal {step.wait_for!r} did not arrive within "
                                f"{step.wait_timeout:g}s (run {job.run_id}, step {step.name!r})")
        args[step.wait_for] = rows[0][0]

    def _start_outcome(self, rec: _Running, pipeline: Pipeline) -> Outcome | None:
        """A run enqueued by name, without the definition, is one row for its first step
        (''). A pipeline with several roots, or a root that waits or is delayed, has that row
        start them all instead: it succeeds at once and spawns every root."""
        roots = pipeline.roots
        if rec.job.step or (len(roots) == 1 and roots[0].wait_for is None
                            and not roots[0].delay):
            return None
        try:
            args = json.loads(rec.job.args)
            for root in roots:
                check = dict(args)
                if root.wait_for is not None:
                    check[root.wait_for] = None
                root.check_arguments(check, what=f"stored arguments of job {rec.job.id}")
        except (ValueError, InvalidArgumentsError) as exc:
            return self._failure(rec, exc, 0.0)
        return Succeeded("null", tuple(Spawn(r, pipeline.name, args=rec.job.args)
                                       for r in roots))

    def _outcome_of_result(self, rec: _Running, pipeline: Pipeline, step: Step[Any, Any],
                           result: Any, duration: float) -> Outcome:
        try:
            if isinstance(result, Each):
                return Succeeded(result.json, self._map(pipeline, step, rec.job, result))
            try:
                text = dumps_checked(result, "the result")
            except JSONError as exc:
                raise InvalidResultError(
                    f"step {step.name!r} returned a value flowq cannot store (not retried: it "
                    f"would run again and return the same): {exc}") from None
            return Succeeded(text, self._successors(pipeline, step, rec.job, result, text))
        except (InvalidResultError, WorkflowError) as exc:
            return self._failure(rec, exc, duration, permanent=True)

    def _successors(self, pipeline: Pipeline, step: Step[Any, Any], job: ClaimedJob,
                    result: Any, text: str) -> tuple[Spawn, ...]:
        """What a success does to each child: create it (its only parent, a plain step), or
        count towards it (a join, or any child of a map instance)."""
        spawn: list[Spawn] = []
        for child in pipeline.children(step):
            if job.map_index is not None:
                spawn.append(Spawn(child, pipeline.name, parents=len(child.parents), delta=-1))
                continue
            if len(child.parents) > 1:
                spawn.append(Spawn(child, pipeline.name, parents=len(child.parents), delta=-1,
                                   parent=step.name, input=text))
                continue
            if result is not None and not isinstance(result, dict):
                raise InvalidResultError(
                    f"step {step.name!r} returned a {type(result).__name__}, but a step "
                    f"followed by {child.name!r} must return a dict (its keyword arguments) "
                    "or None")
            check = dict(result or {})
            if child.wait_for is not None:
                check[child.wait_for] = None
            try:
                child.check_arguments(check, what=f"the result of step {step.name!r}")
            except InvalidArgumentsError as exc:
                raise InvalidResultError(safe_str(exc)) from None
            spawn.append(Spawn(child, pipeline.name, args=text if result else "{}"))
        return tuple(spawn)

    def _map(self, pipeline: Pipeline, step: Step[Any, Any], job: ClaimedJob,
             items: Each) -> tuple[Spawn, ...]:
        """The instances of the mapped child, and the joins after it: each counts n units."""
        children = pipeline.children(step)
        if job.map_index is not None:
            raise WorkflowError(f"step {step.name!r} is itself a map instance: an instance "
                                "cannot map again (map over a list of lists in one step)")
        if len(children) != 1:
            raise WorkflowError(
                f"step {step.name!r} returned flowq.each(...), which runs its child step once "
                f"per item, but it has {len(children)} child steps (it needs exactly one)")
        child = children[0]
        if len(child.parents) != 1:
            raise WorkflowError(
                f"step {child.name!r} is mapped over the items of {step.name!r}, so it can have "
                f"no other parent (it has {', '.join(child.parents)})")
        if child.wait_for is not None:
            raise WorkflowError(f"step {child.name!r} waits for a signal, so it cannot be "
                                "mapped (a signal is delivered to one step of a run)")
        for i, item in enumerate(items.items):
            try:
                child.check_arguments(item, what=f"item {i} of flowq.each()")
            except InvalidArgumentsError as exc:
                raise WorkflowError(safe_str(exc)) from None
        n = len(items.items)
        spawn = [Spawn(child, pipeline.name, args=t, map_index=i)
                 for i, t in enumerate(items.texts)]
        spawn += [Spawn(g, pipeline.name, parents=len(g.parents), delta=n - 1)
                  for g in pipeline.children(child)]
        return tuple(spawn)

    def _exception_outcome(self, rec: _Running, exc: BaseException, duration: float) -> Outcome:
        if rec.cancelled and isinstance(exc, asyncio.CancelledError):
            return Cancelled("the run was cancelled while this step ran")
        if isinstance(exc, RetryStep):
            try:
                delay = delay_of(exc.after)
            except ValueError as bad:
                return self._failure(rec, bad, duration)
            reason = storable_text(exc.reason or "retry requested by the handler")
            step = rec.step
            cap = step.retry.attempt_cap if step is not None else rec.job.max_attempts
            if rec.job.attempts >= cap:
                return Failed(f"RetryStep: {reason} (the attempt cap of {cap} is reached)",
                              None, f"RetryStep: {first_line(reason)[:SUMMARY_CHARS]}")
            return Retried(delay, reason)
        if isinstance(exc, CancelRun):
            return Cancelled(storable_text(exc.reason or "cancelled by the handler"))
        return self._failure(rec, exc, duration)

    # -- running a handler ------------------------------------------------------------------

    def _thread_main(self) -> None:
        while True:
            rec = self._work.get()
            if rec is None:
                return
            try:
                outcome, ctx = self._run_sync(rec)
            except BaseException as exc:  # a flowq bug: the attempt fails, the thread lives
                log_event(ERROR, "handler thread crashed; the attempt fails", job_id=rec.job.id,
                          error=first_line(describe(exc)))
                text = describe(exc)
                outcome, ctx = Failed(text, None, first_line(text)[:SUMMARY_CHARS]), None
            if not self._settle(rec, ctx, outcome):
                return  # abandoned after a timeout: a replacement thread holds the slot

    def _run_sync(self, rec: _Running) -> tuple[Outcome, Context | None]:
        if not isinstance(rec.resolved, tuple):
            return self._failure(rec, rec.resolved, 0.0), None
        pipeline, step = rec.resolved
        started = self._start_outcome(rec, pipeline)
        if started is not None:
            return started, None
        try:
            ctx, args = self._prepare(rec, step)
        except (InvalidArgumentsError, SignalTimeout) as exc:
            return self._failure(rec, exc, 0.0), None
        try:
            result = (step.fn(ctx, **args) if rec.span is None
                      else tracing.called_in(rec.span, step.fn, ctx, **args))
        except BaseException as exc:  # handlers may raise anything; the worker survives
            return self._exception_outcome(rec, exc, time.monotonic() - rec.started), ctx
        return self._outcome_of_result(rec, pipeline, step, result,
                                       time.monotonic() - rec.started), ctx

    async def _run_async(self, rec: _Running, pipeline: Pipeline, step: Step[Any, Any]) -> None:
        ctx: Context | None = None
        try:
            started = self._start_outcome(rec, pipeline)
            if started is not None:
                await asyncio.to_thread(self._settle, rec, None, started)
                return
            if rec.job.joined or step.wait_for is not None:  # reads the database
                ctx, args = await asyncio.to_thread(self._prepare, rec, step)
            else:
                ctx, args = self._prepare(rec, step)
            try:
                result = await (step.fn(ctx, **args) if rec.span is None
                                else tracing.awaited_in(rec.span, step.fn(ctx, **args)))
            except BaseException as exc:  # CancelledError too: the watchdog settled it
                outcome = self._exception_outcome(rec, exc, time.monotonic() - rec.started)
            else:
                outcome = self._outcome_of_result(rec, pipeline, step, result,
                                                  time.monotonic() - rec.started)
        except BaseException as exc:
            outcome = self._failure(rec, exc, time.monotonic() - rec.started)
        if rec.done:  # abandoned by the watchdog: nothing to write, no thread needed
            self._settle(rec, ctx, outcome)
            return
        # Completion may block on the database: not on the loop, where other handlers run.
        await asyncio.to_thread(self._settle, rec, ctx, outcome)

    def _settle(self, rec: _Running, ctx: Context | None, outcome: Outcome) -> bool:
        """Hand the outcome on, unless the watchdog got there first; False if it did."""
        with rec.lock:
            abandoned, rec.done = rec.done, True
        duration = time.monotonic() - rec.started
        session = ctx._session if ctx is not None else None
        try:
            if abandoned:
                _quietly(session, "rollback")
                log_event(WARNING, "late result of an abandoned attempt discarded",
                          job_id=rec.job.id, task=rec.job.task, step=rec.job.step,
                          duration_ms=round(duration * 1000, 2))
                return False
            if session is not None and isinstance(outcome, Succeeded):
                try:
                    self.completer.complete_in_session(rec.job, outcome, session, duration)
                except BaseException as exc:  # the handler's writes failed at commit
                    outcome = self._failure(rec, exc, duration)
                    self.completer.submit(rec.job, outcome, duration)
            else:
                _quietly(session, "rollback")
                self.completer.submit(rec.job, outcome, duration)
        finally:
            _quietly(session, "close")
            if not abandoned:
                if rec.span is not None:
                    tracing.end_attempt(rec.span, outcome, rec.error)
                self._finish_slot(rec)
        return True


def _quietly(session: StepSession | None, method: str) -> None:
    """Roll back or close a handler's session; a dead connection must not cost the slot."""
    if session is None:
        return
    try:
        getattr(session, method)()
    except Exception as exc:
        log_event(WARNING, f"ctx.session {method} failed", error=first_line(safe_str(exc)))


def _backend_pid(ctx: Context | None) -> int | None:
    """The server process of an attempt's open `ctx.session` transaction, if it has one."""
    session = ctx._session if ctx is not None else None
    pid = getattr(session, "backend_pid", None)
    return pid if isinstance(pid, int) else None
