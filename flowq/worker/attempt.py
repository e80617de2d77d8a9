"""One attempt of a claimed job, from its row to its `Outcome`: the rules the worker's executor
and the test kit (`flowq.testing.drain`, `run_step`) share.

Which definition runs the job, and the rule when none here can (left to another worker,
retried, or dead), is `flowq.worker.resolution`'s (`resolve`, `mismatch`); an attempt applies
its answer.

- `Attempt(app, job, read=..., session_factory=..., elsewhere=...)` prepares the handler's call
  (`prepare()`: its `Context` and arguments; a join's mapped inputs and a late signal's
  payload are read from the database through `read`) and judges what came back:
  `judge(result)` by the graph rules of `flowq.worker.graph`, `judge_exception(exc)` and
  `failure(exc)` by the step's retry policy; a durable sleep (`flowq.durable.Suspend`) and a
  `Snooze` are `Suspended`, no attempt spent, a snooze past `flowq.durable.MAX_SNOOZES` dead.
  The handler's `ctx` carries the attempt's checkpoints (`flowq.durable.Ledger`), fenced on
  its claim.
- `run_attempt(attempt)` runs one attempt in the calling thread; `arun_attempt(attempt)`
  awaits an `async def` handler. Both call the same preparing and judging code.

The attempt cap, one rule: when the worker knows the step, its live policy's cap wins
(`Retry.attempt_cap`); the row's `max_attempts` is a copy made at enqueue, stale when the run
was enqueued by name without the definition or the policy changed in a deploy, and only
serves the SQL-only reaper. When the worker does not know the step (`UnknownTaskError`), the
row's `max_attempts` is the cap and the default backoff the wait (`Attempt.policy`).

Nothing a handler does escapes: any `BaseException` (`SystemExit` and `KeyboardInterrupt`
included) fails the attempt, an exception whose `__str__` raises is described by its type,
and a retry policy that raises fails the attempt for good with both errors in `last_error`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

from flowq import tracing
from flowq.db.rows import ClaimedJob
from flowq.db.store.enqueue import builder
from flowq.define.app import FlowQ
from flowq.define.retry import Retry
from flowq.define.step import Step, as_seconds
from flowq.durable.checkpoints import MAX_SNOOZES, Ledger
from flowq.durable.context import Context
from flowq.durable.session import StepSession
from flowq.durable.sleeps import Suspend
from flowq.errors import (
    CancelRun,
    InvalidArgumentsError,
    RetryStep,
    SignalTimeout,
    Snooze,
    UnknownTaskError,
    WorkflowError,
)
from flowq.storable import clamp_delay, delay_of, describe, first_line, storable_text
from flowq.worker.graph import InvalidResultError, spawn_roots, succeeded
from flowq.worker.model import Cancelled, Failed, Outcome, Retried, Suspended
from flowq.worker.resolution import Elsewhere, Mismatch, mismatch, resolve, stored_names

__all__ = ["HAND_OVER_DELAY", "SUMMARY_CHARS", "Attempt", "Call", "Reader", "arun_attempt",
           "run_attempt"]

SUMMARY_CHARS: Final = 300  # of an error, in log lines (last_error keeps MAX_TEXT_CHARS)
# A job left to another worker is due again this many seconds later (its attempt given
# back): long enough for that worker to claim it first, short enough not to delay the run.
HAND_OVER_DELAY: Final = 1.0

Reader = Callable[[Any, dict[str, Any]], list[Any]]
"""Runs one workflow read (a join's mapped inputs, a signal's payload), a statement and its
parameters as the store built them: its rows."""


@dataclass(frozen=True)
class Call:
    """A prepared handler call: the step, its context and its keyword arguments."""

    step: Step[Any, Any]
    ctx: Context
    args: dict[str, Any]

    def __call__(self) -> Any:
        return self.step.fn(self.ctx, **self.args)


class Attempt:
    """One attempt of `job`: resolved at construction, prepared once, judged once.

    `started` (monotonic) is when its clock started: durations and the policy's elapsed time
    count from it (the executor resets it when the attempt leaves its claim-ahead buffer;
    `claimed` keeps the construction's, so `ctx.started_at` adds the wait to the claim's
    database time).
    `cancelled` is set when the run is cancelled while the attempt runs; the handler sees it
    as `ctx.cancelled`. `error` is the exception that failed it, once judged (for tracing)."""

    def __init__(self, app: FlowQ, job: ClaimedJob, *, read: Reader | None = None,
                 session_factory: Callable[[], StepSession] | None = None,
                 skip_sleeps: bool = False, elsewhere: Elsewhere | None = None) -> None:
        self.app = app
        self.skip_sleeps = skip_sleeps  # the test kit's skip_waits: a sleep is due at once
        self.job = job
        self.elsewhere = elsewhere
        self.resolved = resolve(app, job, elsewhere)
        self.read = read
        self.session_factory = session_factory
        self.started = self.claimed = time.monotonic()
        self.cancelled = False
        self.ctx: Context | None = None
        self.error: BaseException | None = None

    @property
    def step(self) -> Step[Any, Any] | None:
        return self.resolved[1] if isinstance(self.resolved, tuple) else None

    @property
    def policy(self) -> Retry:
        """The retry policy that judges this attempt's failures (see the module: the cap)."""
        step = self.step
        return step.retry if step is not None else Retry(max_attempts=self.job.max_attempts)

    @property
    def reads_database(self) -> bool:
        """Whether `prepare()` reads the database (an async attempt prepares off its loop)."""
        step = self.step
        return self.job.joined or (step is not None and step.wait_for is not None)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # -- before the handler ---------------------------------------------------------------

    def prepare(self) -> Call | Outcome:
        """The handler's call, or the outcome the attempt has without one: an unknown step,
        the start of a run that spawns its roots, arguments that do not bind, a signal that
        did not come. A database error of a read propagates (`run_attempt` judges it)."""
        if isinstance(self.resolved, Mismatch):
            return self.mismatched(self.resolved)
        if not isinstance(self.resolved, tuple):
            return self.failure(self.resolved, 0.0)
        pipeline, step = self.resolved
        job = self.job
        try:
            started = spawn_roots(pipeline, job)
        except ValueError as exc:
            return self.failure(exc, 0.0)
        except InvalidArgumentsError as exc:
            return self.mismatched(mismatch(pipeline, job, str(exc), self.elsewhere,
                                            stored_names(job.args)))
        if started is not None:
            return started
        try:
            args = json.loads(job.args)
            if not isinstance(args, dict):
                raise InvalidArgumentsError("the stored arguments are not a JSON object")
            if job.joined:
                self._gather(step, args)
            if step.wait_for is not None and step.wait_for not in args:
                args = self._receive(step, args)
        except ValueError as exc:
            return self.failure(InvalidArgumentsError(f"job {job.id}: {exc}"), 0.0)
        except (InvalidArgumentsError, SignalTimeout) as exc:
            return self.failure(exc, 0.0)
        try:
            step.check_arguments(args, what=f"stored arguments of job {job.id}")
        except InvalidArgumentsError as exc:  # produced by a step of another definition
            return self.mismatched(mismatch(pipeline, job, str(exc), self.elsewhere, args))
        started_at = None if job.claimed_at is None else job.claimed_at + timedelta(
            seconds=max(0.0, self.started - self.claimed))
        # Without a session factory (no database), the checkpoints are kept in memory.
        ledger = Ledger(run_id=job.run_id, step=step.name, map_index=job.map_index,
                        claim=job.claim if self.session_factory is not None else None,
                        schema=self.app.schema, session_factory=self.session_factory,
                        skip_sleeps=self.skip_sleeps)
        self.ctx = Context(job.id, job.run_id, job.task, step.name, job.attempts, job.queue,
                           map_index=job.map_index, session_factory=self.session_factory,
                           scheduled_at=job.scheduled_at, cancelled=self._cancel_seen,
                           enqueued_at=job.enqueued_at, started_at=started_at, ledger=ledger)
        return Call(step, self.ctx, args)

    def mismatched(self, found: Mismatch) -> Outcome:
        """The outcome of a job this worker's definition cannot run (`mismatch`'s rule): left
        to `found.left_to`, its attempt given back, or dead."""
        if found.left_to is not None:
            return Retried(HAND_OVER_DELAY, storable_text(found.text), handed_over=True)
        if found.unheard:
            return self.failure(UnknownTaskError(found.text), 0.0)
        return self.failure(UnknownTaskError(found.text),
                            0.0, permanent=True)

    def _cancel_seen(self) -> bool:
        return self.cancelled or self.job.cancel_requested

    def _rows(self, statement: tuple[Any, dict[str, Any]]) -> list[Any]:
        if self.read is None:
            raise RuntimeError("this attempt reads the database, but was given no reader")
        return self.read(*statement)

    def _gather(self, step: Step[Any, Any], args: dict[str, Any]) -> None:
        """A join's inputs: the static parents' results came with the row; a mapped parent's
        are its instances' results, read now, in item order (none: it mapped `[]`)."""
        verbs = builder(self.app.schema)
        for parent in step.parents:
            if parent not in args:
                rows = self._rows(verbs.map_results_statement(self.job.run_id, parent))
                args[parent] = verbs.read_map_results(rows)

    def _receive(self, step: Step[Any, Any], args: dict[str, Any]) -> dict[str, Any]:
        """A waiting step that runs without its payload: its timeout passed, unless the signal
        came while it was between attempts."""
        assert step.wait_for is not None  # only a waiting step receives
        verbs = builder(self.app.schema)
        sent = verbs.read_signal(self._rows(verbs.signal_statement(self.job.run_id,
                                                                   step.wait_for)))
        if sent is None:
            raise SignalTimeout(
                f"signal {step.wait_for!r} did not arrive within {step.wait_timeout:g}s "
                f"(run {self.job.run_id}, step {step.name!r})")
        return step.with_signal(args, sent[0])

    # -- judging --------------------------------------------------------------------------

    def judge(self, result: Any, duration: float | None = None) -> Outcome:
        """The outcome of the handler's return value: a success with what it spawns, or, for
        a result flowq cannot store or the graph cannot take, a permanent failure."""
        assert isinstance(self.resolved, tuple), "judged an attempt that could not run"
        try:
            return succeeded(*self.resolved, self.job, result)
        except (InvalidResultError, WorkflowError) as exc:
            return self.failure(exc, duration, permanent=True)

    def judge_exception(self, exc: BaseException, duration: float | None = None) -> Outcome:
        """The outcome of what the handler raised: `RetryStep`, `CancelRun`, a cancellation
        the run asked for, or a failure for the retry policy to judge."""
        if self.cancelled and isinstance(exc, asyncio.CancelledError):
            return Cancelled("the run was cancelled while this step ran")
        if isinstance(exc, RetryStep):
            try:
                delay = delay_of(exc.after)
            except ValueError as bad:
                return self.failure(bad, duration)
            reason = storable_text(exc.reason or "retry requested by the handler")
            return self.retried(delay, reason, failed_as=f"RetryStep: {reason}",
                                summary=f"RetryStep: {first_line(reason)[:SUMMARY_CHARS]}")
        if isinstance(exc, CancelRun):
            return Cancelled(storable_text(exc.reason or "cancelled by the handler"))
        if isinstance(exc, Suspend):
            return Suspended(exc.until, 0.0, storable_text(exc.reason), step=self._step_name)
        if isinstance(exc, Snooze):
            return self.snoozed(exc, duration)
        return self.failure(exc, duration)

    @property
    def _step_name(self) -> str:
        step = self.step
        return step.name if step is not None else self.job.step

    def snoozed(self, exc: Snooze, duration: float | None = None) -> Outcome:
        """Run again after the snooze's delay without spending an attempt, unless the step
        snoozed `MAX_SNOOZES` times already: then it is dead, saying so."""
        try:
            delay = as_seconds("Snooze(seconds)", exc.seconds, minimum=0.0)
            done = self.ctx.ledger.snoozes() if self.ctx is not None else 0
        except Exception as bad:  # a delay refused, or the count could not be read
            return self.failure(bad, duration)
        reason = storable_text(exc.reason or "snoozed by the handler")
        if done >= MAX_SNOOZES:
            text = (f"Snooze: the step snoozed {done} times, the cap of {MAX_SNOOZES} snoozes "
                    f"per step (flowq.durable.MAX_SNOOZES), so it is dead rather than polling "
                    f"forever; its last snooze: {reason}")
            return Failed(text, None, first_line(text)[:SUMMARY_CHARS])
        return Suspended(None, delay, reason, snoozes=done + 1, step=self._step_name)

    def retried(self, delay: float, reason: str, *, failed_as: str, summary: str) -> Outcome:
        """Try again after `delay` seconds, unless this attempt is the last the cap allows:
        then the job ends `dead`, its error `failed_as` and the cap."""
        cap = self.policy.attempt_cap
        if self.job.attempts < cap:
            return Retried(delay, reason)
        return Failed(f"{failed_as} (the attempt cap of {cap} is reached)", None, summary)

    def failure(self, exc: BaseException, duration: float | None = None, *,
                permanent: bool = False) -> Failed:
        """The outcome of a failed attempt: when to retry it by the policy, or dead.
        `duration` defaults to the time since `started`."""
        duration = self.elapsed() if duration is None else duration
        text = describe(exc)
        summary = first_line(text)[:SUMMARY_CHARS]
        self.error = exc
        step = self.step
        # Running again would fail the same way; a missed signal is retried only by a policy
        # the step was given.
        if permanent or isinstance(exc, WorkflowError) or (
                isinstance(exc, SignalTimeout) and not (step is not None and step.retry_given)):
            return Failed(text, None, summary)
        try:
            delay = self.policy.next_delay(self.job.attempts, exc, self.job.age + duration)
        except BaseException as policy_error:  # a predicate like `e.code >= 500` on a ValueError
            text = storable_text(f"{text}\n\nThe step's retry policy raised while judging this "
                                 f"failure, so it is not retried:\n{describe(policy_error)}")
            return Failed(text, None, summary)
        # A wait without a `max` grows past any date (wait_exponential at attempt 50): clamp.
        return Failed(text, None if delay is None else clamp_delay(delay), summary)


def run_attempt(attempt: Attempt, *, call: Callable[[Call], Any] | None = None,
                reraise: type[BaseException] | tuple[type[BaseException], ...] = (),
                span: Any = None) -> Outcome:
    """Run `attempt` in this thread to its outcome. `call` calls the prepared handler (default:
    `Call()`; the test kit's awaits an async handler); with a tracing `span`, it is current
    while the handler runs. Exceptions of the `reraise` types propagate instead of being
    judged (the test kit's KeyboardInterrupt)."""
    try:
        prepared = attempt.prepare()
    except reraise:
        raise
    except BaseException as exc:
        return attempt.failure(exc)
    if not isinstance(prepared, Call):
        return prepared
    try:
        if span is not None:
            result = tracing.called_in(span, call or Call.__call__, prepared)
        else:
            result = prepared() if call is None else call(prepared)
    except reraise:
        raise
    except BaseException as exc:  # handlers may raise anything; the worker survives
        return attempt.judge_exception(exc)
    return attempt.judge(result)


async def arun_attempt(attempt: Attempt, *, span: Any = None) -> Outcome:
    """`run_attempt` for an `async def` handler, on the running loop: the database reads of
    `prepare()` run in a thread (never on the loop, where other handlers run), the handler is
    awaited (with `span` current, when tracing), and the same code judges it."""
    try:
        prepared = (await asyncio.to_thread(attempt.prepare) if attempt.reads_database
                    else attempt.prepare())
    except BaseException as exc:
        return attempt.failure(exc)
    if not isinstance(prepared, Call):
        return prepared
    try:
        result = await (prepared() if span is None else tracing.awaited_in(span, prepared()))
    except BaseException as exc:  # CancelledError too: the watchdog settled it, or a cancel
        return attempt.judge_exception(exc)
    return attempt.judge(result)
