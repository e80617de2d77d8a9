"""Results without polling: `wait_run`, `await_run` and `get_result`.

A worker announces on the schema's run-end channel (`flowq.db.schema.run_end_channel`) the
runs whose rows reached a state that creates nothing after them, one notification per
completing statement (`flowq.db.sql.fragments.notify_ended`), for the runs a waiter
registered in `flowq.run_waiters` only: a NOTIFY's commit queues on a lock of the whole
database, which a run nobody waits for should not pay. A waiter is woken by that
notification and reads the run again: whether it has finished is decided only where a run's
status is (`flowq.ops.runinfo`), never from the notification, which is a hint.

One LISTEN connection per database per process (`RunEndListener.shared`), opened by the first
waiter, with a daemon thread reading its notifications; sync waiters wait on a
`threading.Event`, async ones on an `asyncio.Event` set from that thread. The poll stays as
the fallback: `RECHECK` seconds after a waiter registers (a completion whose statement
began before the registration committed announces nothing), then every `FALLBACK_POLL`
seconds while the listener is up (a notification lost to a reconnect costs that much), and from `POLL[0]` backing off to `POLL[1]` while it is down
(LISTEN refused, or behind PgBouncer in transaction mode, where a LISTEN is accepted but
never hears anything: pass `listen=False` there to spare the connection). Options:

- `timeout`: seconds (None: no limit; `math.inf` too); NaN, a negative number or a
  non-number is refused with `InvalidArgumentsError`. 0 looks once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Final

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect
from sqlalchemy.sql.elements import TextClause

from flowq.db.schema import ACTIVE_STATUSES
from flowq.db.sql import Queries, queries
from flowq.db.urls import to_conninfo
from flowq.errors import InvalidArgumentsError, RunStateError
from flowq.names import DEFAULT_SCHEMA, check_id
from flowq.ops import binds
from flowq.ops.binds import Bind
from flowq.ops.runinfo import RunInfo, read_run

__all__ = ["FALLBACK_POLL", "POLL", "RECHECK", "RunEndListener", "await_run", "check_timeout",
           "get_result", "listener_connection", "run_finished", "wait_run"]

# How a waiter polls while no listener is up: from the first interval, doubling up to the last.
POLL: Final = (0.02, 1.0)
# How often a waiter reads its run anyway while the listener is up.
FALLBACK_POLL: Final = 5.0
# How soon a waiter reads its run again after registering: a completion in flight then (its
# statement began before the registration committed) announces nothing, and has committed
# by now.
RECHECK: Final = 0.05
# How long the listener thread blocks per read (also how soon it sees it was closed).
_SLICE: Final = 0.5
# After a failed connect, how long a listener is left down before a waiter tries again.
_RETRY_AFTER: Final = 5.0
_CONNECT_TIMEOUT: Final = 10
# A statement's text in psycopg's own parameter style, for the registrations' connection.
_PSYCOPG: Final = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]


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


def listener_connection(conninfo: str) -> psycopg.Connection[Any]:
    """The autocommit connection a `RunEndListener` LISTENs on (tests replace it to stand for
    a server that refuses LISTEN)."""
    return psycopg.connect(conninfo, autocommit=True, connect_timeout=_CONNECT_TIMEOUT,
                           application_name="flowq wait_run")


def _writer_connection(conninfo: str) -> psycopg.Connection[Any]:
    """The autocommit connection a `RunEndListener` writes its waiters' registrations on."""
    return psycopg.connect(conninfo, autocommit=True, connect_timeout=_CONNECT_TIMEOUT,
                           application_name="flowq wait_run registrations")


Wake = Callable[[], None]


class RunEndListener:
    """One LISTEN connection to a database, shared by every waiter of this process on it.

    `watch(channel, run_id, wake)` registers a waiter before it reads the run (so no
    notification can fall between its read and its wait); `wake` is called from the
    listener's thread for every notification naming the run (or naming none: an overlong
    batch), and when the listener goes down. `notified` counts the waiters woken by a
    notification (what tests assert on instead of a clock)."""

    _shared: ClassVar[dict[str, RunEndListener]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.notified = 0
        self._lock = threading.Lock()
        self._waiters: dict[tuple[str, int], set[Wake]] = {}
        self._channels: set[str] = set()
        self._conn: psycopg.Connection[Any] | None = None
        self._thread: threading.Thread | None = None
        self._failed_at: float | None = None
        self._pid = os.getpid()
        # The connection registrations are written on (`register`): not the LISTEN one, whose
        # lock the reader holds while it waits for a notification.
        self._writer: psycopg.Connection[Any] | None = None
        self._writer_lock = threading.Lock()

    @classmethod
    def shared(cls, engine: sa.Engine) -> RunEndListener:
        """The process's listener for the database of `engine` (created on first use; a
        forked child gets its own)."""
        conninfo = to_conninfo(engine.url)
        with cls._shared_lock:
            found = cls._shared.get(conninfo)
            if found is None or found._pid != os.getpid():
                found = cls._shared[conninfo] = RunEndListener(conninfo)
            return found

    @property
    def backend_pid(self) -> int | None:
        """The backend pid of the LISTEN connection (None while down)."""
        conn = self._conn
        return None if conn is None else conn.info.backend_pid

    @property
    def up(self) -> bool:
        """Whether notifications can arrive (the connection is open and its thread reads)."""
        return self._conn is not None and self._thread is not None and self._thread.is_alive()

    @property
    def watching(self) -> int:
        """How many waiters are registered (`watch`ed and not yet `unwatch`ed)."""
        with self._lock:
            return sum(len(wakes) for wakes in self._waiters.values())

    def watch(self, channel: str, run_id: int, wake: Wake) -> bool:
        """Register `wake` for `run_id` on `channel`, LISTENing first if needed; returns
        whether the listener is up (False: poll)."""
        with self._lock:
            self._waiters.setdefault((channel, run_id), set()).add(wake)
            return self._listen(channel)

    def unwatch(self, channel: str, run_id: int, wake: Wake) -> None:
        with self._lock:
            waiters = self._waiters.get((channel, run_id))
            if waiters is not None:
                waiters.discard(wake)
                if not waiters:
                    del self._waiters[(channel, run_id)]

    def register(self, q: Queries, run_id: int, token: str) -> int | None:
        """Record in `flowq.run_waiters` that wait `token` waits for `run_id`, under the
        current LISTEN connection (after `watch`); returns that connection's backend pid, or
        None when the listener is down or the write failed (the waiter then polls)."""
        with self._lock:
            pid = None if self._conn is None else self._conn.info.backend_pid
        if pid is None:
            return None
        ok = self._write(q.register_waiter, {"run_id": run_id, "token": token, "pid": pid})
        return pid if ok else None

    def unregister(self, q: Queries, run_id: int, token: str) -> None:
        """Delete wait `token`'s registration (best effort: the pruner deletes what is left
        once the LISTEN connection is gone)."""
        self._write(q.unregister_waiter, {"run_id": run_id, "token": token})

    def _write(self, statement: TextClause, params: dict[str, Any]) -> bool:
        """Send `statement` on the registrations' connection; once more on a new one when the
        connection, opened earlier, is lost: one that died while idle (idle_session_timeout,
        pg_terminate_backend) would otherwise cost a registration a poll loop and leave an
        unregistered row until the LISTEN connection goes. Both statements are idempotent."""
        sql = str(statement.compile(dialect=_PSYCOPG))
        with self._writer_lock:
            for again in (self._writer is not None, False):
                try:
                    if self._writer is None or self._writer.closed:
                        self._writer = _writer_connection(self.conninfo)
                    self._writer.execute(sql, params)
                    return True
                except psycopg.Error as exc:
                    if self._writer is not None:
                        with contextlib.suppress(psycopg.Error):
                            self._writer.close()
                    self._writer = None
                    if not (again and isinstance(exc, psycopg.OperationalError)):
                        return False
            return False

    def _listen(self, channel: str) -> bool:
        """Connect if down (not more often than every `_RETRY_AFTER` s after a failure) and
        LISTEN on `channel`; under `_lock`. The first LISTEN happens on this thread, before
        the reader starts: once it returns, a commit's notification cannot be missed."""
        if not self.up:
            if self._failed_at is not None and time.monotonic() - self._failed_at < _RETRY_AFTER:
                return False
            try:
                conn = listener_connection(self.conninfo)
                for known in sorted(self._channels | {channel}):
                    conn.execute(f'LISTEN "{known}"')  # [a-z0-9_:] only: run_end_channel
            except psycopg.Error:
                self._failed_at = time.monotonic()
                return False
            self._failed_at = None
            self._channels.add(channel)
            self._conn = conn
            self._thread = threading.Thread(target=self._read, args=(conn,), daemon=True,
                                            name="flowq-wait-run")
            self._thread.start()
            return True
        if channel not in self._channels:
            try:
                # The reader uses this connection too: psycopg serializes the two on the
                # connection's lock (this waits for the reader's slice, at most `_SLICE`).
                assert self._conn is not None
                self._conn.execute(f'LISTEN "{channel}"')
            except psycopg.Error:
                return False
            self._channels.add(channel)
        return True

    def _read(self, conn: psycopg.Connection[Any]) -> None:
        try:
            while True:
                # Collected first: the generator holds the connection's lock while it waits,
                # and `watch` may hold `_lock` while it sends a LISTEN on this connection.
                # stop_after=1: back as soon as a packet came, not at the end of the slice.
                for note in list(conn.notifies(timeout=_SLICE, stop_after=1)):
                    self._dispatch(note.channel, note.payload)
        except psycopg.Error:
            pass
        finally:
            with self._lock:
                if self._conn is conn:
                    self._conn = None
                waiters = [w for ws in self._waiters.values() for w in ws]
            with contextlib.suppress(psycopg.Error):  # closing a broken connection
                conn.close()
            for wake in waiters:  # they read their run again, then poll
                with contextlib.suppress(RuntimeError):
                    wake()

    def _dispatch(self, channel: str, payload: str) -> None:
        ids: set[int] | None = set()
        for part in payload.split(","):
            if part.isascii() and part.isdigit() and len(part) < 20:  # anyone may NOTIFY
                ids.add(int(part))  # type: ignore[union-attr]
            else:
                ids = None  # '' (an overlong batch) or not ours to parse: wake every waiter
                break
        with self._lock:
            woken = [w for (ch, run_id), ws in self._waiters.items()
                     if ch == channel and (ids is None or run_id in ids) for w in ws]
            self.notified += len(woken)
        for wake in woken:
            # RuntimeError: an async waiter whose event loop closed meanwhile.
            with contextlib.suppress(RuntimeError):
                wake()

    def close(self) -> None:
        """Close the connection (its thread then ends, waking every waiter)."""
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        with self._writer_lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        if self._thread is not None:
            self._thread.join(timeout=2 * _SLICE)


class _Registration:
    """One wait's entry in its listener and its row in `flowq.run_waiters` (see
    `RunEndListener.register`), the row renewed when the listener's connection changed (a
    notification is only sent to a registered run). `end` is final, and waits for a `watch`
    still running in another thread (an `await_run` cancelled while it ran): one that
    finished after the wait's cleanup would leave its row while the LISTEN connection lives,
    where no pruner takes it."""

    def __init__(self, listener: RunEndListener | None, q: Queries, run_id: int,
                 wake: Wake) -> None:
        self.listener, self.q, self.run_id, self.wake = listener, q, run_id, wake
        self.token = uuid.uuid4().hex
        self.pid: int | None = None
        self.fresh = False
        self.ended = False
        self._lock = threading.Lock()

    def watch(self) -> bool:
        """Register `wake` with the listener, then (again, if the LISTEN connection changed)
        the row; whether the listener is up with the row written (False: poll)."""
        with self._lock:
            if self.listener is None or self.ended:
                return False
            if not self.listener.watch(self.q.run_channel, self.run_id, self.wake):
                return False
            current = self.listener.backend_pid
            if current is None or current != self.pid:
                self.pid = self.listener.register(self.q, self.run_id, self.token)
                self.fresh = self.pid is not None
            return self.pid is not None

    def next_step(self) -> float:
        """How long to wait for a notification before reading the run again."""
        step, self.fresh = (RECHECK if self.fresh else FALLBACK_POLL), False
        return step

    def end(self) -> None:
        with self._lock:
            self.ended = True
            if self.listener is None:
                return
            self.listener.unwatch(self.q.run_channel, self.run_id, self.wake)
            if self.pid is not None:
                self.listener.unregister(self.q, self.run_id, self.token)


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
    q = queries(schema)
    deadline = None if limit is None else time.monotonic() + limit
    engine = _engine_of(bind) if listen else None
    listener = None if engine is None else RunEndListener.shared(engine)
    woken = threading.Event()
    wait = _Registration(listener, q, run_id, woken.set)
    pause = POLL[0]
    try:
        while True:
            # Cleared first: a wake sent meanwhile (the listener lost while we register)
            # makes the wait below return at once, and the next pass listen again.
            woken.clear()
            up = wait.watch()
            run = binds.read(bind, lambda conn: read_run(conn, q, run_id))
            if run_finished(run):
                return run
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise _timed_out(run, timeout)
            step = wait.next_step() if up else pause
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
    q = queries(schema)
    deadline = None if limit is None else time.monotonic() + limit
    engine = _engine_of(bind) if listen else None
    listener = None if engine is None else RunEndListener.shared(engine)
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()

    def wake() -> None:
        loop.call_soon_threadsafe(woken.set)

    async def read() -> RunInfo:
        if isinstance(bind, sa.Engine):
            return await asyncio.to_thread(
                binds.read, bind, lambda conn: read_run(conn, q, run_id))
        async with bind.connect() as conn:
            found: RunInfo = await conn.run_sync(lambda c: read_run(c, q, run_id))
            return found

    wait = _Registration(listener, q, run_id, wake)
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
            step = wait.next_step() if up else pause
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(woken.wait(), step if left is None else min(step, left))
            if not up:
                pause = min(pause * 2, POLL[1])
    finally:
        if listener is not None:
            await asyncio.to_thread(wait.end)


def get_result(bind: Bind, run_id: int, schema: str = DEFAULT_SCHEMA) -> Any:
    """The result of succeeded run `run_id` (its leaves' results, `RunInfo.result`);
    RunStateError naming the status and what to do when it has not finished or did not
    succeed, RunNotFoundError when no such run exists. Never waits: `wait_run` does."""
    run_id = check_id(run_id)
    q = queries(schema)
    run = binds.read(bind, lambda conn: read_run(conn, q, run_id))
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
