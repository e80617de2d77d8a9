"""Results without polling: `wait_run`, `await_run` and `get_result`.

A worker announces on the schema's run-end channel (`flowq.db.schema.run_end_channel`) the
runs whose rows reached a state that creates nothing after them, one notification per
completing statement (`flowq.db.sql.fragments.notify_ended`), for the runs a waiter
registered in `flowq.run_waiters` only: a NOTIFY's commit queues on a lock of the whole
database, which a run nobody waits for should not pay. A waiter is woken by that
notification and reads the run again: whether it has finished is decided only where a run's
status is (`flowq.ops.runinfo`), never from the notification, which is a hint.

The waiters of a process share one LISTEN connection per database (`flowq.ops.waiters`: the
process's `flowq.db.listener.SharedListener`, which a worker of the process shares too); sync
waiters wait on a `threading.Event`, async ones on an `asyncio.Event` set from its thread.
The poll stays as the fallback: `RECHECK` seconds after a waiter registers (a completion
whose statement began before the registration committed announces nothing), then every
`FALLBACK_POLL` seconds while the listener is up (a notification lost to a reconnect costs
that much), and from `POLL[0]` backing off to `POLL[1]` while it is down
(LISTEN refused, or behind PgBouncer in transaction mode, where a LISTEN is accepted but
never hears anything: pass `listen=False` there to spare the connection). Options:

- `timeout`: seconds (None: no limit; `math.inf` too); NaN, a negative number or a
  non-number is refused with `InvalidArgumentsError`. 0 looks once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import sqlalchemy as sa

from flowq.db.schema import ACTIVE_STATUSES, run_end_channel
from flowq.errors import InvalidArgumentsError, RunStateError
from flowq.names import DEFAULT_SCHEMA, check_id
from flowq.ops import binds
from flowq.ops.binds import Bind
from flowq.ops.runinfo import RunInfo, read_run
from flowq.ops.waiters import Registration, RunEndListener

__all__ = ["FALLBACK_POLL", "POLL", "RECHECK", "RunEndListener", "await_run", "check_timeout",
           "get_result", "run_finished", "wait_run"]

# How a waiter polls while no listener is up: from the first interval, doubling up to the last.
POLL: Final = (0.02, 1.0)
# How often a waiter reads its run anyway while the listener is up.
FALLBACK_POLL: Final = 5.0
# How soon a waiter reads its run again after registering: a completion in flight then (its
# statement began before the registration committed) announces nothing, and has committed
# by now.
RECHECK: Final = 0.05


def check_timeout(timeout: object) -> float | None:
    """`timeout` as seconds, or None for no limit (None or infinity); InvalidArgumentsError
    for NaN, a negative number, a bool or a non-number."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InvalidArgumentsError(f"timeout must be a number of seconds or None, got "
                                    f"{timeout!r}")
    value = float(timeout)
    if math.isnan(value) or value < 0:
        raise InvalidArgumentsError(f"timeout must be 0 or more seconds (None: no limit), "
                                    f"got {timeout!r}")
    return None if math.isinf(value) else value


def run_finished(run: RunInfo) -> bool:
    """Whether `run` has finished: no step left pending, running or waiting (a cancelled run
    whose running step was asked to stop has not, until that step ends)."""
    return not any(s.status in ACTIVE_STATUSES for s in run.steps)


def _read(conn: sa.Connection, schema: str, run_id: int) -> RunInfo:
    """Run `run_id` read on `conn` (`read_run`, looked up here: tests count the reads)."""
    return read_run(conn, schema, run_id)


def _registration(engine: sa.Engine | None, schema: str, run_id: int,
                  wake: Callable[[], None]) -> Registration:
    listener = None if engine is None else RunEndListener.shared(engine)
    return Registration(listener, schema, run_end_channel(schema), run_id, wake)


def _next_step(wait: Registration, up: bool, pause: float) -> float:
    """How long to wait for a notification before reading the run again."""
    if not up:
        return pause
    return RECHECK if wait.take_fresh() else FALLBACK_POLL


def _engine_of(bind: Any) -> sa.Engine | None:
    if isinstance(bind, sa.Engine):
        return bind
    if isinstance(bind, sa.Connection):
        return bind.engine
    sync = getattr(bind, "sync_engine", None)  # an AsyncEngine
    return sync if isinstance(sync, sa.Engine) else None


def _timed_out(run: RunInfo, timeout: float | None) -> TimeoutError:
    return TimeoutError(f"run {run.run_id} is still {run.status} after {timeout}s: wait "
                        "longer, or look at it with `flowq runs show "
                        f"{run.run_id}`")


def wait_run(bind: Bind, run_id: int, *, timeout: float | None = None,
             schema: str = DEFAULT_SCHEMA, listen: bool = True) -> RunInfo:
    """Block until run `run_id` has finished (succeeded, dead, or cancelled with nothing left
    running) and return it (`.status`, `.result`); TimeoutError after `timeout` seconds,
    RunNotFoundError for a run that does not exist. Woken by the run-end notification, the
    poll as a fallback (see the module docstring); `listen=False` only polls. On a
    Connection, each read is a statement of its own: do not hold it in a transaction begun
    before the run ended, whose snapshot (REPEATABLE READ) would never see the end."""
    run_id = check_id(run_id)
    limit = check_timeout(timeout)
    deadline = None if limit is None else time.monotonic() + limit
    woken = threading.Event()
    wait = _registration(_engine_of(bind) if listen else None, schema, run_id, woken.set)
    pause = POLL[0]
    try:
        while True:
            # Cleared first: a wake sent meanwhile (the listener lost while we register)
            # makes the wait below return at once, and the next pass listen again.
            woken.clear()
            up = wait.watch()
            run = binds.read(bind, lambda conn: _read(conn, schema, run_id))
            if run_finished(run):
                return run
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise _timed_out(run, timeout)
            step = _next_step(wait, up, pause)
            woken.wait(step if left is None else min(step, left))
            if not up:
                pause = min(pause * 2, POLL[1])
    finally:
        wait.end()


async def await_run(bind: Any, run_id: int, *, timeout: float | None = None,
                    schema: str = DEFAULT_SCHEMA, listen: bool = True) -> RunInfo:
    """`wait_run` for asyncio: `bind` is an AsyncEngine (or an Engine, read in a thread). The
    LISTEN connection is the process's one (its thread sets this task's event)."""
    run_id = check_id(run_id)
    limit = check_timeout(timeout)
    deadline = None if limit is None else time.monotonic() + limit
    engine = _engine_of(bind) if listen else None
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()

    def wake() -> None:
        loop.call_soon_threadsafe(woken.set)

    async def read() -> RunInfo:
        if isinstance(bind, sa.Engine):
            return await asyncio.to_thread(
                binds.read, bind, lambda conn: _read(conn, schema, run_id))
        async with bind.connect() as conn:
            found: RunInfo = await conn.run_sync(lambda c: _read(c, schema, run_id))
            return found

    wait = _registration(engine, schema, run_id, wake)
    pause = POLL[0]
    try:
        while True:
            woken.clear()  # first, as in `wait_run`
            up = await asyncio.to_thread(wait.watch)  # connecting may take a while
            run = await read()
            if run_finished(run):
                return run
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise _timed_out(run, timeout)
            step = _next_step(wait, up, pause)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(woken.wait(), step if left is None else min(step, left))
            if not up:
                pause = min(pause * 2, POLL[1])
    finally:
        if engine is not None:
            await asyncio.to_thread(wait.end)


def get_result(bind: Bind, run_id: int, schema: str = DEFAULT_SCHEMA) -> Any:
    """The result of succeeded run `run_id` (its leaves' results, `RunInfo.result`);
    RunStateError naming the status and what to do when it has not finished or did not
    succeed, RunNotFoundError when no such run exists. Never waits: `wait_run` does."""
    run_id = check_id(run_id)
    run = binds.read(bind, lambda conn: _read(conn, schema, run_id))
    if run.status == "succeeded":
        return run.result
    if not run_finished(run):
        raise RunStateError(
            f"run {run_id} has no result yet: it is {run.status} (step "
            f"{run.current_step.step or '(first)'!r}); wait for it with "
            f"flowq.wait_run(engine, {run_id}, timeout=...), which returns it once it ends")
    if run.status == "dead":
        dead = next((s for s in run.steps if s.status == "dead"), run.current_step)
        error = (dead.last_error or "no error recorded").strip().splitlines()
        raise RunStateError(
            f"run {run_id} is dead, so it has no result: step {dead.step!r} failed after "
            f"{dead.attempts} attempt(s) ({error[0][:300] if error else ''}); fix the cause "
            f"and retry it with `flowq runs retry {run_id}` (or flowq.runs.retry_run)")
    reason = next((s.last_error for s in run.steps if s.status == "cancelled" and s.last_error),
                  None)
    raise RunStateError(
        f"run {run_id} was cancelled, so it has no result"
        + (f" ({reason.splitlines()[0][:300]})" if reason else "")
        + f": enqueue it again, or fork it (`flowq runs fork {run_id} --from STEP`)")
