"""`drain(target, app)`: run every due job now, in this thread, one at a time, deterministically.

A test calls it where a worker would run later. It is built from the worker's own parts:
it claims with the worker's claim statement (`claim_any_jobs`, which ignores queue pauses and
limits; `claim_run_jobs` for `runs=`), runs each attempt with `flowq.worker.attempt` (the
function the worker's executor runs), and writes its outcome with `flowq.worker.writes` on the
test's connection (a handler's `ctx.session` completes as a worker completes it), so the rows
end exactly as a worker would leave them: pipeline successors are created and then run,
failures are retried by their step's policy until its attempt cap, then buried `dead`.

Where the jobs run follows `target`:
- a Session or Connection: inside its transaction, and the handler's `ctx.session` joins it
  through a SAVEPOINT (released on success, rolled back on failure, as a worker's commit or
  rollback would be). The test's rollback undoes the jobs, their outcomes and every business
  row the handlers wrote. A Session is flushed first, so handlers see its pending objects.
- an Engine: each job in its own committed transaction, as a worker would.

Options and their defaults:
- `queues=None`: the queues to drain, in order (the app's queues, sorted, by default); a job
  of the first queue with a due job runs next.
- `runs=None`: only the jobs of these runs (run ids, or what `enqueue` returned).
- `skip_waits=True`: a retry is due at once instead of after its policy's wait. With False, a
  retry stays pending for later (inside one transaction `now()` stands still, so it never
  becomes due during the drain).
- `raise_on_dead=True`: a job that ends `dead` raises AssertionError naming it and its error
  (after its row is written).
- `batches=True`: when no job is due, count the finished runs of `session.batch()` blocks
  and enqueue the callbacks of the batches that are complete, as the reaper's pass does
  (`Store.advance_batches`, `start_batch_callbacks`), on the test's connection; the
  callbacks are then drained too. With False they are left to the reaper's pass.
- `max_jobs=1000` (`MAX_JOBS`): AssertionError if jobs are still due after this many ran,
  naming the jobs that kept the drain busy and what they last did or waited on.

Waits: a job that suspends while a child run linked to it is unfinished (`ctx.wait`) is
parked: written pending `PARK_DELAY` seconds later (never due inside one transaction), and
due again when its children have ended (the completion that ends a child wakes it, as it
wakes a worker's parent; drain wakes what that missed). The children are drained too,
whatever `queues=` and `runs=` say: their queues and runs are added to the drain's once
nothing else is due, as are those of batch callbacks. A step waiting for a signal is
`waiting`, never claimed: drain leaves it (send the signal in the test, then drain again).
`DrainResult` counts suspensions (durable sleeps, snoozes, waits for children) apart from
retries.

Jobs enqueued to run later (`delay=`, `run_at=`) are not due, and are left pending.
Handlers run in the calling thread, without timeouts; `async def` handlers run with
`asyncio.run`, or on the running loop under `adrain`. `adrain(async_session_or_connection,
app, ...)` is the same drain through SQLAlchemy's `run_sync`; there an async handler cannot use
`ctx.session` (its synchronous calls would need the greenlet the handler is not running in).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Union

import sqlalchemy as sa
from sqlalchemy import orm

from flowq.db.rows import ClaimedJob
from flowq.db.runner import Runner, runner
from flowq.db.store import Store
from flowq.define.app import FlowQ
from flowq.durable.children import MAX_RECHECK
from flowq.durable.session import StepSession
from flowq.enqueueing.prepare import Enqueued
from flowq.names import validate_queue
from flowq.worker.attempt import Attempt, Call, run_attempt
from flowq.worker.model import Cancelled, Failed, Outcome, Retried, Succeeded, Suspended
from flowq.worker.writes import complete_in_session, write_outcome, write_successes

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

__all__ = ["MAX_JOBS", "PARK_DELAY", "WORKER_NAME", "DrainResult", "adrain", "drain",
           "run_claimed", "run_coroutine"]

MAX_JOBS: Final = 1000
WORKER_NAME: Final = "flowq.testing"  # `locked_by` of the rows a drain claims
# How long a parked parent waits before its next re-check: a worker's longest re-check. Inside
# one transaction `now()` stands still, so only its children's end (a wake) makes it due.
PARK_DELAY: Final = MAX_RECHECK
BATCH_LIMIT: Final = 1000  # batches counted and fired per idle turn, as the reaper's limit
BUSIEST: Final = 3  # jobs named when drain gives up

Target = Union[sa.Engine, sa.Connection, orm.Session, "orm.scoped_session[Any]"]


@dataclass(frozen=True)
class DrainResult:
    """How many attempts `drain` ran, by what they ended as."""

    succeeded: int = 0
    retried: int = 0  # back to pending after a failure or RetryStep (later attempts counted)
    dead: int = 0
    cancelled: int = 0
    suspended: int = 0  # a durable sleep, a snooze, a wait for children: no attempt spent

    @property
    def total(self) -> int:
        return self.succeeded + self.retried + self.dead + self.cancelled + self.suspended


def drain(target: Target, app: FlowQ, *, queues: Iterable[str] | None = None,
          runs: Iterable[int | Enqueued] | None = None, raise_on_dead: bool = True,
          skip_waits: bool = True, batches: bool = True, max_jobs: int = MAX_JOBS
          ) -> DrainResult:
    """Run the due jobs of `queues` (default: the app's) until none is left; see the module."""
    app.check()
    names = [validate_queue(q) for q in (app.queues if queues is None else queues)]
    run_ids = None if runs is None else {r.id if isinstance(r, Enqueued) else int(r)
                                         for r in runs}
    state = _Drain(names, run_ids, batches)
    for _ in range(max_jobs):
        dead: str | None = None
        with _transaction(target) as conn:
            job = state.next_job(Store(_runner(conn), app.schema))
            if job is None:
                break
            status, outcome, parked = _run(conn, app, job, skip_waits)
            state.record(job, status, outcome, parked)
            if status == "dead" and raise_on_dead:
                dead = _dead_message(job, outcome)
        if dead is not None:  # after the transaction block: an Engine's commits the row
            raise AssertionError(dead)
    else:
        with _transaction(target) as conn:
            store = Store(_runner(conn), app.schema)
            if store.due_jobs_exist(state.names, 0):
                raise AssertionError(f"drain ran {max_jobs} jobs (max_jobs) and jobs are "
                                     f"still due: {state.busiest(store)}")
    counts = state.counts
    return DrainResult(succeeded=counts["succeeded"], retried=counts["retried"],
                       dead=counts["dead"], cancelled=counts["cancelled"],
                       suspended=counts["suspended"])


@dataclass
class _Seen:
    """A job drain claimed: how often, and how its last attempt ended."""

    job: ClaimedJob
    attempts: int = 0
    last: str = ""
    parked: bool = False


@dataclass
class _Drain:
    """What one drain claims from (its queues and runs, growing as it follows children and
    batch callbacks), the jobs it parked, and what it saw."""

    names: list[str]
    run_ids: set[int] | None
    batches: bool
    parked: set[int] = field(default_factory=set)
    seen: dict[int, _Seen] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)

    def next_job(self, store: Store) -> ClaimedJob | None:
        """A due job claimed from the first queue that has one; when none is, what
        `unblock` makes due; None when nothing is left."""
        while True:
            runs = None if self.run_ids is None else sorted(self.run_ids)
            for name in self.names:
                claimed = store.claim_any(name, 1, WORKER_NAME, runs)
                if claimed:
                    return claimed[0]
            if not self.unblock(store):
                return None

    def unblock(self, store: Store) -> bool:
        """Nothing is due: fire the batch callbacks that are complete, wake the parked jobs
        whose children ended, follow the children that did not; whether any of it may have
        made a job due."""
        progress = False
        if self.batches:
            store.advance_batches(BATCH_LIMIT)
            fired = [f.callback_run_id for f in store.start_batch_callbacks(BATCH_LIMIT)]
            progress = self.follow(store, fired) or bool(fired)
        if self.parked:
            rows = store.waited_children(sorted(self.parked))
            self.parked = {r.job_id for r in rows if r.job_status == "pending"}
            waiting = {r.job_id for r in rows if r.finished is False or r.due}
            progress |= bool(store.wake_jobs(sorted(self.parked - waiting)))
            progress |= self.follow(store, [r.run_id for r in rows
                                            if r.run_id is not None and r.finished is False])
        return progress

    def follow(self, store: Store, run_ids: Sequence[int]) -> bool:
        """Drain `run_ids` too, and the queues their pending jobs are in; whether that added
        a run or a queue."""
        if not run_ids:
            return False
        added = False
        if self.run_ids is not None and not self.run_ids.issuperset(run_ids):
            self.run_ids.update(run_ids)
            added = True
        for queue in store.pending_queues(run_ids):
            if queue not in self.names:
                self.names.append(queue)
                added = True
        return added

    def record(self, job: ClaimedJob, status: str, outcome: Outcome, parked: bool) -> None:
        if isinstance(outcome, Suspended) and status == "pending":
            self.counts["suspended"] += 1
        else:
            self.counts["retried" if status == "pending" else status] += 1
        seen = self.seen.setdefault(job.id, _Seen(job))
        seen.attempts += 1
        seen.last, seen.parked = _describe(outcome), parked
        (self.parked.add if parked else self.parked.discard)(job.id)

    def busiest(self, store: Store) -> str:
        """The jobs that kept the drain busy: the ones claimed most, the tasks whose jobs
        each ran once (one enqueueing the next), the parked ones and what they wait for."""
        ranked = sorted(self.seen.values(), key=lambda s: (-s.attempts, s.job.id))
        repeated = [s for s in ranked if s.attempts > 1][:BUSIEST]
        once = Counter((s.job.task, s.job.step) for s in ranked if s.attempts == 1)
        parked = [s for s in ranked if s.job.id in self.parked and s not in repeated]
        children = store.waited_children([s.job.id for s in parked[:BUSIEST]])
        parts = [_named(s) for s in repeated]
        parts += [f"{n} jobs of task {task!r}, step {step!r} ran once each (a job that keeps "
                  "enqueueing another?)" for (task, step), n in once.most_common(2) if n > 1]
        for s in parked[:BUSIEST]:
            waits = [f"run {r.run_id}: {r.status or 'gone'}" for r in children
                     if r.job_id == s.job.id and r.finished is False]
            parts.append(_named(s) + (f" (waiting on {', '.join(waits[:5])})" if waits else ""))
        return "; ".join(parts) or "a job that keeps enqueueing another?"


def _named(seen: _Seen) -> str:
    job = seen.job
    return (f"job {job.id} (run {job.run_id}, task {job.task!r}, step "
            f"{job.step or '(first)'!r}): {seen.attempts} attempt"
            f"{'' if seen.attempts == 1 else 's'}, the last {seen.last}")


def _describe(outcome: Outcome) -> str:
    """How an attempt ended, in a few words, for `busiest`."""
    if isinstance(outcome, Succeeded):
        return "succeeded"
    if isinstance(outcome, Failed):
        return f"{'dead' if outcome.retry_in is None else 'retried'}: {outcome.summary}"
    if isinstance(outcome, Retried):
        return f"{'handed over' if outcome.handed_over else 'retried'}: RetryStep: " \
               f"{outcome.reason}"
    if isinstance(outcome, Cancelled):
        return f"cancelled: {outcome.reason}"
    return f"suspended: {outcome.reason}"


async def adrain(target: AsyncSession | AsyncConnection, app: FlowQ, **options: Any
                 ) -> DrainResult:
    """`drain` in an AsyncSession's or AsyncConnection's transaction (same options)."""
    result: DrainResult = await target.run_sync(lambda sync: drain(sync, app, **options))
    return result


@contextlib.contextmanager
def _transaction(target: Target) -> Iterator[sa.Connection]:
    if isinstance(target, sa.Engine):
        with target.begin() as conn:
            yield conn
    elif isinstance(target, sa.Connection):
        if not target.in_transaction():
            target.begin()  # what its next execute would do; the test commits or rolls back
        yield target
    elif isinstance(target, orm.Session | orm.scoped_session):
        target.flush()
        yield target.connection()
    else:
        raise TypeError(f"drain needs an Engine, Session or Connection, got "
                        f"{type(target).__name__} (for an AsyncSession use adrain)")


def _runner(conn: sa.Connection) -> Runner:
    """The test's connection as a runner: through SQLAlchemy, in the test's transaction."""
    return runner(conn, direct=False)


def run_claimed(conn: sa.Connection, app: FlowQ, job: ClaimedJob,
                skip_waits: bool = True) -> tuple[str, Outcome]:
    """Run one claimed attempt and write its outcome, as `drain` runs each (a test that
    claims its jobs itself calls it); (the row's new status, the outcome)."""
    status, outcome, _ = _run(conn, app, job, skip_waits)
    return status, outcome


def _run(conn: sa.Connection, app: FlowQ, job: ClaimedJob,
         skip_waits: bool) -> tuple[str, Outcome, bool]:
    """`run_claimed`, and whether the job was parked on its unfinished children."""
    def session_factory() -> StepSession:
        # Joined to the test's transaction: its commit releases a SAVEPOINT, its rollback
        # returns to it, and only the test's own rollback or commit ends the transaction.
        return StepSession(bind=conn, join_transaction_mode="create_savepoint")

    run = _runner(conn)  # reads and writes, in the test's transaction
    attempt = Attempt(app, job, read=run, session_factory=session_factory,
                      skip_sleeps=skip_waits)
    # In this thread, without timeouts; an async handler is awaited here rather than on an
    # executor's loop. An interrupted test run is not the handler's failure.
    outcome = run_attempt(attempt, call=_call, reraise=KeyboardInterrupt)
    store = Store(run, app.schema)
    # The handler's `ctx.session` (checkpoints open and close sessions of their own).
    session = attempt.ctx.opened_session if attempt.ctx is not None else None
    try:
        if isinstance(outcome, Succeeded):
            try:
                if session is not None:
                    ours = complete_in_session(session, app.schema, job, outcome)
                else:
                    ours = bool(write_successes(store, [(job, outcome)]))
            except Exception as exc:  # the handler's writes failed at commit, as in a worker
                outcome = attempt.failure(exc)
            else:
                return ("succeeded" if ours else "lost"), outcome, False
        elif session is not None:
            session.rollback()
        written = _skipping_wait(outcome) if skip_waits else outcome
        parked = False
        if isinstance(outcome, Suspended):
            parked = any(r.finished is False for r in store.waited_children([job.id]))
            if parked and skip_waits:  # due when its children end, not at once (the module)
                written = dataclasses.replace(outcome, until=None, delay=PARK_DELAY)
        assert not isinstance(written, Succeeded)
        result = write_outcome(store, job, written)
        return (result[0] if result else "lost"), outcome, parked
    finally:
        if session is not None:
            session.close()


def _call(call: Call) -> object:
    result = call()
    return run_coroutine(result) if call.step.is_async else result


def run_coroutine(coro: Coroutine[Any, Any, Any]) -> Any:
    """Await `coro` from synchronous code: with `asyncio.run`, or, inside a running loop, through
    SQLAlchemy's greenlet bridge (which `adrain`'s `run_sync` provides)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from sqlalchemy.util import await_only

    try:
        return await_only(coro)
    except sa.exc.MissingGreenlet:
        coro.close()
        raise RuntimeError("an async handler cannot be run by a synchronous call inside a "
                           "running event loop: use `await adrain(...)` or "
                           "`await arun_step(...)`") from None


def _skipping_wait(outcome: Outcome) -> Outcome:
    if isinstance(outcome, Failed) and outcome.retry_in is not None:
        return dataclasses.replace(outcome, retry_in=0.0)
    if isinstance(outcome, Retried):
        return dataclasses.replace(outcome, delay=0.0)
    if isinstance(outcome, Suspended):  # a snooze (a sleep's deadline was recorded as now)
        return dataclasses.replace(outcome, until=None, delay=0.0)
    return outcome


def _dead_message(job: ClaimedJob, outcome: Outcome) -> str:
    error = outcome.text if isinstance(outcome, Failed) else repr(outcome)
    return (f"job {job.id} (run {job.run_id}, task {job.task!r}, step {job.step or '(first)'!r})"
            f" is dead after attempt {job.attempts}: {error}")

