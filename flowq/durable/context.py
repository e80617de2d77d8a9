"""What a handler receives as `ctx`: who it is (job, run, step, attempt) and `ctx.session`.

`ctx.session` is a SQLAlchemy Session (`flowq.durable.session.StepSession`) opened lazily on
first use. Its writes commit in the same transaction that records the step's success, so
they happen exactly once per run even when a step is re-run after a crash: a worker that
lost its claim rolls them back. A handler that never touches `ctx.session` holds no
transaction while it runs. The rest of the durable wing is reached through the context:
checkpoints (`flowq.durable.checkpoints`), sleeps (`flowq.durable.sleeps`) and child runs
(`flowq.durable.children`); and `ctx.progress` reports, which the heartbeat takes
(`progress_of`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Final

from flowq import tracing
from flowq.durable import sleeps
from flowq.durable.children import Children
from flowq.errors import CancelRun, ContextError, InvalidArgumentsError

if TYPE_CHECKING:
    from flowq.define.pipeline import Pipeline
    from flowq.durable.checkpoints import Ledger
    from flowq.durable.session import StepSession

__all__ = ["PROGRESS_MESSAGE_CHARS", "Context", "progress_of"]

# `ctx.progress`: the longest message kept (longer ones are cut).
PROGRESS_MESSAGE_CHARS: Final = 500
# The contexts that reported progress, by job id, held weakly: an attempt's context goes
# with it, so nothing here outlives its job (the heartbeat reads it, `progress_of`).
_REPORTING: weakref.WeakValueDictionary[int, Context] = weakref.WeakValueDictionary()


def progress_of(job_ids: Iterable[int]) -> dict[int, str]:
    """The new progress reports of the jobs `job_ids` (their contexts in this process), as
    the JSON the heartbeat writes, each taken once (`Context.take_progress`)."""
    out = {}
    for job_id in job_ids:
        ctx = _REPORTING.get(job_id)
        if ctx is not None:
            taken = ctx.take_progress()
            if taken is not None:
                out[job_id] = taken
    return out


def _progress_message(message: object) -> str:
    if not isinstance(message, str):
        raise InvalidArgumentsError(
            f"ctx.progress: message must be text or None, got {type(message).__name__}")
    message = message[:PROGRESS_MESSAGE_CHARS]
    if "\x00" in message:
        raise InvalidArgumentsError("ctx.progress: message must not contain NUL characters "
                                    "(PostgreSQL cannot store them)")
    try:
        message.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentsError("ctx.progress: message has a lone surrogate, which is "
                                    "not text JSON can store") from None
    return message


@dataclass(init=False)
class Context:
    """The handler's view of the job it runs.

    Built by the worker for each attempt (and by `flowq.testing.make_context`):
    `session_factory` opens `ctx.session` on first use, `scheduled_at` is the tick of a
    scheduled run, `enqueued_at` and `started_at` are read from the claimed row (the
    construction time when not given: a test's context), and `cancelled` tells whether the
    run was cancelled while the step runs (asked each time the handler looks, so the worker
    can learn it later)."""

    job_id: int
    run_id: int
    task: str
    step: str
    attempt: int
    queue: str
    map_index: int | None = None  # the item position, in an instance of a mapped step

    def __init__(self, job_id: int, run_id: int, task: str, step: str, attempt: int,
                 queue: str, *, map_index: int | None = None,
                 session_factory: Callable[[], StepSession] | None = None,
                 scheduled_at: datetime | None = None,
                 cancelled: Callable[[], bool] | None = None,
                 enqueued_at: datetime | None = None,
                 started_at: datetime | None = None,
                 ledger: Ledger | None = None) -> None:
        self.job_id, self.run_id, self.task, self.step = job_id, run_id, task, step
        self.attempt, self.queue, self.map_index = attempt, queue, map_index
        self._session_factory = session_factory
        self._session: StepSession | None = None
        self._scheduled_at = scheduled_at
        self._cancelled = cancelled
        now = datetime.now(timezone.utc)
        self._enqueued_at = enqueued_at or now
        self._started_at = started_at or now
        self._ledger = ledger
        self._children: Children | None = None
        self._durable_lock: asyncio.Lock | None = None

    @property
    def cancelled(self) -> bool:
        """True once the run was cancelled while this step runs (the worker learns it within
        a heartbeat interval). Stop early with `raise_if_cancelled()`; a handler that finishes
        anyway has its success recorded, but no later step runs."""
        return self._cancelled is not None and self._cancelled()

    def raise_if_cancelled(self) -> None:
        """Raise `flowq.CancelRun` if the run was cancelled: the step ends `cancelled`."""
        if self.cancelled:
            raise CancelRun("the run was cancelled while this step ran")

    @property
    def scheduled_at(self) -> datetime | None:
        """The tick a periodic schedule enqueued this run for (an aware datetime in UTC), in
        the steps the run starts with; None for a run that was not scheduled (see
        `flowq.schedules`)."""
        if self._scheduled_at is None:
            return None
        return self._scheduled_at.astimezone(timezone.utc)

    @property
    def enqueued_at(self) -> datetime:
        """When this step's job was created (an aware datetime in UTC, the database's clock):
        for a run's first steps the enqueue, for a later step the success that created it.
        Retries keep it."""
        return self._enqueued_at.astimezone(timezone.utc)

    @property
    def started_at(self) -> datetime:
        """When this attempt started (UTC): the database's time of its claim, plus what it
        waited in the worker's claim-ahead buffer. `started_at - enqueued_at` is the pickup
        latency of a job that was due at once (a delayed one was due at its `run_at`)."""
        return self._started_at.astimezone(timezone.utc)

    @property
    def idempotency_key(self) -> str:
        """Stable across every attempt of this step of this run, distinct across steps, runs
        and map instances: pass it to payment and mail APIs so a re-run step is not charged or
        sent twice."""
        if self.map_index is not None:
            return f"flowq:{self.run_id}:{self.step}:{self.map_index}"
        return f"flowq:{self.run_id}:{self.step}"

    @property
    def session(self) -> StepSession:
        """A Session whose writes commit atomically with this step's success (opened lazily)."""
        if self._session is None:
            if self._session_factory is None:
                raise ContextError("this context has no database session (not run by a worker)")
            self._session = self._session_factory()
        return self._session

    @property
    def session_used(self) -> bool:
        return self._session is not None

    @property
    def opened_session(self) -> StepSession | None:
        """`ctx.session` if the handler opened it, else None (without opening it): what the
        worker commits with the step's success, or rolls back."""
        return self._session

    # -- durable execution (flowq.durable.checkpoints, .sleeps) -------------------------------

    @property
    def ledger(self) -> Ledger:
        """This attempt's checkpoints (`flowq.durable.checkpoints.Ledger`): the worker's
        reads and records them fenced on the claim; the test kit's (`make_context`) keeps
        them in memory."""
        if self._ledger is None:
            raise ContextError("this context has no checkpoint ledger (not run by a worker: "
                             "build it with flowq.testing.make_context)")
        return self._ledger

    def checkpoint(self, name: str, fn: Callable[..., Any], /, *args: Any,
                   **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` once per run, step, map instance and `name`: when the handler
        runs again (a retry, a crash, after a sleep), a recorded checkpoint returns its stored
        result (JSON) without calling `fn`. A `fn` taking a keyword `session` gets a Session
        whose writes commit in one transaction with the record, under this attempt's claim:
        a worker that lost its claim commits neither. Names are unique within an attempt."""
        return self.ledger.checkpoint(name, fn, args, kwargs)

    async def acheckpoint(self, name: str, fn: Callable[..., Any], /, *args: Any,
                          **kwargs: Any) -> Any:
        """`checkpoint` for an `async def` handler, without blocking its event loop (which
        runs the worker's other async handlers): the reads and the record run in a thread,
        one checkpoint or sleep of the attempt at a time. `fn` may be a coroutine function,
        awaited here on the loop (it cannot take a `session`: a Session is not shared between
        the loop and a thread), or a plain function, run in that thread."""
        ledger = self.ledger
        async with self._durable_turn():
            if not inspect.iscoroutinefunction(fn):
                return await asyncio.to_thread(ledger.checkpoint, name, fn, args, kwargs)
            found, stored = await asyncio.to_thread(ledger.lookup, name, fn)
            if found:
                return stored
            result = await fn(*args, **kwargs)
            return await asyncio.to_thread(ledger.checkpoint, name, lambda: result, (), {})

    async def asleep(self, seconds: float | timedelta) -> None:
        """`sleep` for an `async def` handler: its record is written in a thread, so the event
        loop is not blocked; the handler's call ends here the same way."""
        async with self._durable_turn():
            await asyncio.to_thread(sleeps.sleep, self.ledger, seconds)

    async def asleep_until(self, when: datetime) -> None:
        """`sleep_until` for an `async def` handler (see `asleep`)."""
        async with self._durable_turn():
            await asyncio.to_thread(sleeps.sleep_until, self.ledger, when)

    def _durable_turn(self) -> asyncio.Lock:
        # The ledger numbers an attempt's checkpoints and sleeps in call order: concurrent
        # awaits (asyncio.gather) take turns, so two never interleave in its thread.
        if self._durable_lock is None:
            self._durable_lock = asyncio.Lock()
        return self._durable_lock

    def sleep(self, seconds: float | timedelta) -> None:
        """Sleep durably: the handler's call ends here and the job gives its slot back, due
        again after `seconds` without spending an attempt; the handler then runs again, its
        checkpoints replay, and this call returns. Up to its sleeps a handler must be
        deterministic (see docs/durable.md)."""
        sleeps.sleep(self.ledger, seconds)

    def sleep_until(self, when: datetime) -> None:
        """`sleep` until `when`, an aware datetime (one in the past returns at once)."""
        sleeps.sleep_until(self.ledger, when)
    # -- progress (revision 0012): kept here, written by the worker's heartbeat ----------------

    def progress(self, done: float, total: float | None = None,
                 message: str | None = None) -> None:
        """Report how far this attempt has got: `done` (of `total`, if known) and a short
        `message`. Cheap enough for a tight loop: the latest report is kept in memory and
        the worker's heartbeat writes it with its own statement, at most once per beat
        (`--heartbeat-interval`, 5 s); `flowq runs show` and the dashboard show it. Numbers
        are finite, 0 or more, not bools; a message is text without NUL, cut to
        `PROGRESS_MESSAGE_CHARS`. A bad value raises InvalidArgumentsError."""
        if (type(done) is not int and type(done) is not float) or not 0 <= done < math.inf:
            raise InvalidArgumentsError(
                f"ctx.progress: done must be a finite number 0 or more, got {done!r}")
        if total is not None and ((type(total) is not int and type(total) is not float)
                                  or not 0 <= total < math.inf):
            raise InvalidArgumentsError(
                f"ctx.progress: total must be a finite number 0 or more, or None, got "
                f"{total!r}")
        if message is not None:
            message = _progress_message(message)
        self._progress_reports += 1
        self._progress = (self._progress_reports, done, total, message)
        if self._progress_reports == 1:
            _REPORTING[self.job_id] = self
            tracing.follow_progress(self)  # the attempt's span gets the latest at its end

    @property
    def latest_progress(self) -> tuple[int, float, float | None, str | None] | None:
        """(how many reports, done, total, message) of the latest `progress`, or None."""
        return self._progress

    def take_progress(self) -> str | None:
        """The latest report as the JSON the heartbeat writes, if it is newer than the last
        one taken, else None (called from the heartbeat's thread: one tuple, read once)."""
        latest = self._progress
        if latest is None or latest[0] == self._progress_taken:
            return None
        self._progress_taken = latest[0]
        _, done, total, message = latest
        return json.dumps({"done": done, "total": total, "message": message})

    # The latest report (its number first) and what was taken of it; class-level defaults,
    # so a context reporting nothing carries nothing.
    _progress: tuple[int, float, float | None, str | None] | None = field(
        default=None, repr=False, compare=False)
    _progress_reports: int = field(default=0, repr=False, compare=False)
    _progress_taken: int = field(default=0, repr=False, compare=False)

    # -- child runs (flowq.durable.children) --------------------------------------------------

    @property
    def children(self) -> Children:
        """This attempt's child runs (`flowq.durable.children.Children`), recorded by its
        ledger."""
        if self._children is None:
            self._children = Children(self.ledger, self.job_id)
        return self._children

    def start_child(self, task: Pipeline | str, /, **args: Any) -> int:
        """Start a run of `task` (a task or pipeline object, or its name with `queue=`) with
        `args` as a child of this step, once: it commits with a checkpoint of its own, so a
        retry or a replay gets the same child back. Returns its handle, the child's run id
        (an int, JSON: a step may return it for a later step to wait on). Arguments and
        options are checked like any enqueue's; `idempotency_key`, `unique`, `unique_key` and
        `schema` are refused (see flowq.durable.children)."""
        return self.children.start(task, args)

    def wait(self, child: int) -> Any:
        """The result of child run `child` once it succeeded; `flowq.ChildFailed` if it ended
        dead or cancelled. Until then the step gives its slot back without spending an
        attempt and runs again later, its checkpoints replaying (see docs/durable.md)."""
        return self.children.wait_all([child])[0]

    def wait_all(self, children: list[int]) -> list[Any]:
        """`wait` for every child in `children`: their results, in that order, once all
        succeeded; `flowq.ChildFailed` for the first (in that order) that ended dead or
        cancelled."""
        return self.children.wait_all(children)

    def __getstate__(self) -> dict[str, Any]:  # pragma: no cover - contexts are not pickled
        raise TypeError("a flowq Context cannot be pickled")
