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
- `max_jobs=1000` (`MAX_JOBS`): AssertionError if jobs are still due after this many ran (a
  job that keeps enqueueing another, say).

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
from collections.abc import Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Union

import sqlalchemy as sa
from sqlalchemy import orm

from flowq.db.rows import ClaimedJob
from flowq.db.runner import Runner, runner
from flowq.db.store import Store
from flowq.define.app import FlowQ
from flowq.durable.session import StepSession
from flowq.enqueueing.prepare import Enqueued
from flowq.names import validate_queue
from flowq.worker.attempt import Attempt, Call, run_attempt
from flowq.worker.model import Failed, Outcome, Retried, Succeeded, Suspended
from flowq.worker.writes import complete_in_session, write_outcome, write_successes

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

__all__ = ["MAX_JOBS", "WORKER_NAME", "DrainResult", "adrain", "drain", "run_claimed",
           "run_coroutine"]

MAX_JOBS: Final = 1000
WORKER_NAME: Final = "flowq.testing"  # `locked_by` of the rows a drain claims

Target = Union[sa.Engine, sa.Connection, orm.Session, "orm.scoped_session[Any]"]


@dataclass(frozen=True)
class DrainResult:
    """How many attempts `drain` ran, by what they ended as."""

    succeeded: int = 0
    retried: int = 0  # back to pending (their later attempts are counted too)
    dead: int = 0
    cancelled: int = 0

    @property
    def total(self) -> int:
        return self.succeeded + self.retried + self.dead + self.cancelled


def drain(target: Target, app: FlowQ, *, queues: Iterable[str] | None = None,
          runs: Iterable[int | Enqueued] | None = None, raise_on_dead: bool = True,
          skip_waits: bool = True, max_jobs: int = MAX_JOBS) -> DrainResult:
    """Run the due jobs of `queues` (default: the app's) until none is left; see the module."""
    app.check()
    names = [validate_queue(q) for q in (app.queues if queues is None else queues)]
    run_ids = None if runs is None else [r.id if isinstance(r, Enqueued) else int(r)
                                         for r in runs]
    counts: Counter[str] = Counter()
    for _ in range(max_jobs):
        dead: str | None = None
        with _transaction(target) as conn:
            job = _claim(conn, app.schema, names, run_ids)
            if job is None:
                break
            status, outcome = run_claimed(conn, app, job, skip_waits)
            counts[status] += 1
            if status == "dead" and raise_on_dead:
                dead = _dead_message(job, outcome)
        if dead is not None:  # after the transaction block: an Engine's commits the row
            raise AssertionError(dead)
    else:
        with _transaction(target) as conn:
            left = Store(_runner(conn), app.schema).due_jobs_exist(names, 0)
        if left:
            raise AssertionError(f"drain ran {max_jobs} jobs (max_jobs) and jobs are still due: "
                                 "a job that keeps enqueueing another?")
    return DrainResult(succeeded=counts["succeeded"], retried=counts["pending"],
                       dead=counts["dead"], cancelled=counts["cancelled"])


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


def _claim(conn: sa.Connection, schema: str, names: list[str],
           run_ids: list[int] | None) -> ClaimedJob | None:
    store = Store(_runner(conn), schema)
    for name in names:
        claimed = store.claim_any(name, 1, WORKER_NAME, run_ids)
        if claimed:
            return claimed[0]
    return None


def _runner(conn: sa.Connection) -> Runner:
    """The test's connection as a runner: through SQLAlchemy, in the test's transaction."""
    return runner(conn, direct=False)


def run_claimed(conn: sa.Connection, app: FlowQ, job: ClaimedJob,
                skip_waits: bool = True) -> tuple[str, Outcome]:
    """Run one claimed attempt and write its outcome, as `drain` runs each (a test that
    claims its jobs itself calls it); (the row's new status, the outcome)."""
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
                return ("succeeded" if ours else "lost"), outcome
        elif session is not None:
            session.rollback()
        written = _skipping_wait(outcome) if skip_waits else outcome
        assert not isinstance(written, Succeeded)
        result = write_outcome(store, job, written)
        return (result[0] if result else "lost"), outcome
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

