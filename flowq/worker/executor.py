"""Executor: runs handlers, sync ones on threads and `async def` ones on an event loop it owns.

It turns a claimed job into an outcome: it resolves the task and step from the app (an
unknown name or a removed step is a failure to retry later, not a crash), builds the
context, calls the handler, checks the result is JSON and fits the next step, and hands the
outcome to the completer.

Timeouts: a sync handler past its step's `timeout` cannot be killed, so it is abandoned: the
attempt is failed at once, a replacement thread takes its slot, and whatever the stuck thread
returns later is discarded (its `ctx.session` writes roll back). Async handlers are
cancelled by `asyncio.wait_for`.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from flowq.app import FlowQ, Pipeline, Step
from flowq.context import Context, StepSession
from flowq.errors import CancelRun, InvalidArgumentsError, RetryStep, UnknownTaskError
from flowq.jsonargs import JSONError, dumps_checked
from flowq.worker.completer import Completer
from flowq.worker.logs import log_event
from flowq.worker.model import (
    Cancelled,
    ClaimedJob,
    Failed,
    NextStep,
    Outcome,
    Retried,
    Succeeded,
)

__all__ = ["Executor", "StepTimeout"]

WARNING = 30


class StepTimeout(Exception):
    """The handler ran longer than its step's timeout."""


class InvalidResultError(Exception):
    """The handler's result cannot be stored or does not fit the next step."""


@dataclass(eq=False)
class _Running:
    job: ClaimedJob
    started: float
    deadline: float | None
    resolved: tuple[Pipeline, Step[Any, Any]] | Failed  # resolved once, at submit
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False  # set once, by whoever finishes first: the handler or the watchdog


def _format_error(exc: BaseException) -> str:
    """`Type: message` first (what `last_error` is read for), then the traceback."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).strip()
    return f"{type(exc).__name__}: {exc}\n\n{tb}"


def _delay_of(after: float | timedelta | datetime | None) -> float:
    if after is None:
        return 0.0
    if isinstance(after, timedelta):
        return max(0.0, after.total_seconds())
    if isinstance(after, datetime):
        now = datetime.now(timezone.utc)
        aware = after if after.tzinfo else after.replace(tzinfo=timezone.utc)
        return max(0.0, (aware - now).total_seconds())
    return max(0.0, float(after))


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
        self._running: dict[int, _Running] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        for _ in range(self.concurrency):
            self._spawn()

    def _spawn(self) -> None:
        t = threading.Thread(target=self._thread_main, name="flowq-handler", daemon=True)
        self._threads.append(t)
        t.start()

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            t = threading.Thread(target=loop.run_forever, name="flowq-asyncio", daemon=True)
            t.start()
            self._loop, self._loop_thread = loop, t
        return self._loop

    def stop(self) -> None:
        for _ in self._threads:
            self._work.put(None)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._running)

    def running_claims(self) -> list[tuple[int, int]]:
        with self._lock:
            return [(r.job.id, r.job.attempts) for r in self._running.values()]

    def unsettled_claims(self) -> list[tuple[int, int]]:
        """The claims whose handler has not finished (nor been abandoned) yet."""
        with self._lock:
            return [(r.job.id, r.job.attempts) for r in self._running.values() if not r.done]

    # -- dispatch ---------------------------------------------------------------------------

    def submit(self, job: ClaimedJob) -> None:
        resolved = self._resolve(job)
        timeout = resolved[1].timeout if isinstance(resolved, tuple) else None
        now = time.monotonic()
        rec = _Running(job, now, now + timeout if timeout else None, resolved)
        with self._lock:
            self._running[job.id] = rec
        if isinstance(resolved, tuple) and resolved[1].is_async:
            rec.deadline = None  # asyncio.wait_for enforces it
            asyncio.run_coroutine_threadsafe(self._run_async(rec, *resolved), self._ensure_loop())
        else:
            self._work.put(rec)

    def check_timeouts(self) -> int:
        """Fail every sync handler past its deadline; returns how many were abandoned."""
        now = time.monotonic()
        with self._lock:
            late = [r for r in self._running.values() if r.deadline and r.deadline <= now]
        abandoned = 0
        for rec in late:
            with rec.lock:
                if rec.done:
                    continue
                rec.done = True
            abandoned += 1
            duration = now - rec.started
            exc = StepTimeout(f"step {rec.job.step!r} of {rec.job.task!r} exceeded its timeout "
                              f"of {rec.deadline - rec.started:.1f}s" if rec.deadline else "")
            policy = rec.resolved[1].retry if isinstance(rec.resolved, tuple) else None
            self.completer.submit(rec.job, Failed(exc, f"StepTimeout: {exc}", retry=policy),
                                  duration)
            self._spawn()  # the stuck thread keeps its OS thread; the slot gets a new one
            self._finish_slot(rec)
        return abandoned

    def _finish_slot(self, rec: _Running) -> None:
        with self._lock:
            self._running.pop(rec.job.id, None)
            in_flight = len(self._running)
        self.on_slot_free(in_flight)

    # -- running a handler ------------------------------------------------------------------

    def _resolve(self, job: ClaimedJob) -> tuple[Pipeline, Step[Any, Any]] | Failed:
        pipeline = self.app.get(job.task)
        if pipeline is None:
            exc: Exception = UnknownTaskError(
                f"no task or pipeline named {job.task!r} is registered in this worker's app "
                "(enqueued by a newer producer, or renamed?); it will be retried")
            return Failed(exc, f"UnknownTaskError: {exc}")
        step = pipeline.step_named(job.step) if job.step else pipeline.first
        if step is None:
            exc = UnknownTaskError(
                f"pipeline {job.task!r} has no step named {job.step!r} (removed or renamed in "
                "a deploy?); it will be retried")
            return Failed(exc, f"UnknownTaskError: {exc}")
        return pipeline, step

    def _prepare(self, rec: _Running, pipeline: Pipeline, step: Step[Any, Any]
                 ) -> tuple[Context, dict[str, Any]] | Failed:
        job = rec.job
        try:
            args = json.loads(job.args)
            if not isinstance(args, dict):
                raise InvalidArgumentsError("the stored arguments are not a JSON object")
            step.check_arguments(args, what=f"stored arguments of job {job.id}")
        except (InvalidArgumentsError, ValueError) as exc:
            return Failed(exc, _format_error(exc), retry=step.retry)
        ctx = Context(job_id=job.id, run_id=job.run_id, task=job.task, step=step.name,
                      attempt=job.attempts, queue=job.queue,
                      _session_factory=self.session_factory)
        return ctx, args

    def _outcome_of_result(self, pipeline: Pipeline, step: Step[Any, Any],
                           result: Any) -> Outcome:
        nxt = pipeline.next_after(step)
        try:
            text = dumps_checked(result, "the result")
        except JSONError as exc:
            err = InvalidResultError(f"step {step.name!r} returned a value flowq cannot store: "
                                     f"{exc}")
            return Failed(err, f"InvalidResultError: {err}", retry=step.retry)
        if nxt is None:
            return Succeeded(text)
        if result is not None and not isinstance(result, dict):
            err = InvalidResultError(
                f"step {step.name!r} returned a {type(result).__name__}, but a step followed by "
                f"{nxt.name!r} must return a dict (its keyword arguments) or None")
            return Failed(err, f"InvalidResultError: {err}", permanent=True)
        try:
            nxt.check_arguments(result or {}, what=f"the result of step {step.name!r}")
        except InvalidArgumentsError as exc:
            return Failed(exc, f"InvalidResultError: {exc}", permanent=True)
        return Succeeded(text, NextStep(nxt, pipeline.name, dumps_checked(result or {}, "r")))

    def _exception_outcome(self, exc: BaseException, step: Step[Any, Any]) -> Outcome:
        if isinstance(exc, RetryStep):
            return Retried(_delay_of(exc.after), exc.reason)
        if isinstance(exc, CancelRun):
            return Cancelled(exc.reason or "cancelled by the handler")
        return Failed(exc, _format_error(exc), retry=step.retry)

    def _thread_main(self) -> None:
        while True:
            rec = self._work.get()
            if rec is None:
                return
            resolved = rec.resolved
            if isinstance(resolved, Failed):
                self._settle(rec, None, resolved)
                continue
            pipeline, step = resolved
            prepared = self._prepare(rec, pipeline, step)
            if isinstance(prepared, Failed):
                self._settle(rec, None, prepared)
                continue
            ctx, args = prepared
            try:
                outcome = self._outcome_of_result(pipeline, step, step.fn(ctx, **args))
            except BaseException as exc:  # handlers may raise anything; the worker survives
                outcome = self._exception_outcome(exc, step)
            if not self._settle(rec, ctx, outcome):
                return  # abandoned after a timeout: a replacement thread holds the slot

    async def _run_async(self, rec: _Running, pipeline: Pipeline, step: Step[Any, Any]) -> None:
        prepared = self._prepare(rec, pipeline, step)
        if isinstance(prepared, Failed):
            await asyncio.to_thread(self._settle, rec, None, prepared)
            return
        ctx, args = prepared
        try:
            result = await asyncio.wait_for(step.fn(ctx, **args), timeout=step.timeout)
            outcome = self._outcome_of_result(pipeline, step, result)
        except asyncio.TimeoutError:
            exc = StepTimeout(f"step {step.name!r} exceeded its timeout of {step.timeout}s")
            outcome = Failed(exc, f"StepTimeout: {exc}", retry=step.retry)
        except BaseException as exc:
            outcome = self._exception_outcome(exc, step)
        await asyncio.to_thread(self._settle, rec, ctx, outcome)

    def _settle(self, rec: _Running, ctx: Context | None, outcome: Outcome) -> bool:
        """Hand the outcome on, unless the watchdog got there first; False if it did."""
        with rec.lock:
            abandoned, rec.done = rec.done, True
        duration = time.monotonic() - rec.started
        session = ctx._session if ctx is not None else None
        try:
            if abandoned:
                if session is not None:
                    session.rollback()
                log_event(WARNING, "late result of a timed-out handler discarded",
                          job_id=rec.job.id, task=rec.job.task, step=rec.job.step,
                          duration_ms=round(duration * 1000, 2))
                return False
            if session is not None and isinstance(outcome, Succeeded):
                try:
                    self.completer.complete_in_session(rec.job, outcome, session, duration)
                except Exception as exc:
                    self.completer.submit(rec.job, Failed(exc, _format_error(exc)), duration)
            else:
                if session is not None:
                    session.rollback()
                self.completer.submit(rec.job, outcome, duration)
        finally:
            if session is not None:
                session.close()
            if not abandoned:
                self._finish_slot(rec)
        return True
