"""Who waits for a run's end in this process: `RunEndListener` and one wait's `Registration`.

A waiter of `flowq.wait_run` / `await_run` (`flowq.ops.results`) is woken by the run-end
notification of its run. The LISTEN connection is the process's one to that database
(`flowq.db.listener.SharedListener`, shared with a worker of the process), which this module
subscribes to once per run-end channel and keeps subscribed, so later waits find it up
(until the connection is lost with nobody waiting: the next waiter then connects again). A
notification is only sent for a run registered in `flowq.run_waiters` under the backend pid
of that connection (`flowq.db.store.waiters`): the registrations are written on a
connection of their own (`flowq wait_run registrations`), renewed when the LISTEN
connection changed. Sync waiters wait on a `threading.Event`, async ones on an
`asyncio.Event` set from the listener's thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Final

import psycopg
import sqlalchemy as sa

from flowq.db.listener import SharedListener, Subscription
from flowq.db.runner import psycopg_runner
from flowq.db.store import Store
from flowq.db.urls import to_conninfo

__all__ = ["Registration", "RunEndListener", "listener_connection"]

CONNECT_TIMEOUT: Final = 10

Wake = Callable[[], None]


def listener_connection(conninfo: str) -> psycopg.Connection[Any]:
    """The autocommit connection a `RunEndListener` LISTENs on, when it opens the process's
    listener (tests replace it to stand for a server that refuses LISTEN)."""
    return psycopg.connect(conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT,
                           application_name="flowq wait_run")


def writer_connection(conninfo: str) -> psycopg.Connection[Any]:
    """The autocommit connection a `RunEndListener` writes its waiters' registrations on."""
    return psycopg.connect(conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT,
                           application_name="flowq wait_run registrations")


class RunEndListener:
    """The waiters of this process on one database, heard through its shared listener.

    `watch(channel, run_id, wake)` registers a waiter before it reads the run (so no
    notification can fall between its read and its wait); `wake` is called from the
    listener's thread for every notification naming the run (or naming none: an overlong
    batch), and when the listener goes down or comes back. `notified` counts the waiters
    woken by a notification (what tests assert on instead of a clock)."""

    _shared: ClassVar[dict[str, RunEndListener]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.notified = 0
        self._lock = threading.Lock()
        self._waiters: dict[tuple[str, int], set[Wake]] = {}
        self._subscriptions: dict[str, Subscription] = {}
        self._down = False  # the connection was lost: its return wakes every waiter
        self._pid = os.getpid()
        # The connection registrations are written on (`register`): not the LISTEN one, whose
        # lock the listener's thread holds while it waits for a notification.
        self._writer: psycopg.Connection[Any] | None = None
        self._writer_lock = threading.Lock()

    @classmethod
    def shared(cls, engine: sa.Engine) -> RunEndListener:
        """The process's waiters for the database of `engine` (created on first use; a
        forked child gets its own)."""
        conninfo = to_conninfo(engine.url)
        with cls._shared_lock:
            found = cls._shared.get(conninfo)
            if found is None or found._pid != os.getpid():
                found = cls._shared[conninfo] = RunEndListener(conninfo)
            return found

    def _listener(self) -> SharedListener:
        # Looked up by name at each connect: tests replace `listener_connection`.
        return SharedListener.of(self.conninfo, lambda: listener_connection(self.conninfo))

    @property
    def backend_pid(self) -> int | None:
        """The backend pid of the LISTEN connection (None while down)."""
        return self._listener().backend_pid

    @property
    def up(self) -> bool:
        """Whether notifications can arrive (the connection is open and its thread reads)."""
        return bool(self._subscriptions) and self._listener().up

    @property
    def watching(self) -> int:
        """How many waiters are registered (`watch`ed and not yet `unwatch`ed)."""
        with self._lock:
            return sum(len(wakes) for wakes in self._waiters.values())

    def watch(self, channel: str, run_id: int, wake: Wake) -> bool:
        """Register `wake` for `run_id` on `channel`, subscribing first if needed; returns
        whether the channel is LISTENed (False: poll)."""
        with self._lock:
            self._waiters.setdefault((channel, run_id), set()).add(wake)
            listener = self._listener()
            subscription = self._subscriptions.get(channel)
            if subscription is None:
                subscription = self._subscriptions[channel] = Subscription(
                    channel, lambda payload: self._dispatch(channel, payload),
                    connected=self._connected, lost=self._lost)
                return listener.subscribe(subscription)
            return listener.listening(channel)

    def unwatch(self, channel: str, run_id: int, wake: Wake) -> None:
        with self._lock:
            waiters = self._waiters.get((channel, run_id))
            if waiters is not None:
                waiters.discard(wake)
                if not waiters:
                    del self._waiters[(channel, run_id)]

    def register(self, schema: str, run_id: int, token: str) -> int | None:
        """Record in `flowq.run_waiters` that wait `token` waits for `run_id`, under the
        current LISTEN connection (after `watch`); returns that connection's backend pid, or
        None when the listener is down or the write failed (the waiter then polls)."""
        pid = self.backend_pid
        if pid is None:
            return None
        ok = self._write(schema, lambda store: store.register_waiter(run_id, token, pid))
        return pid if ok else None

    def unregister(self, schema: str, run_id: int, token: str) -> None:
        """Delete wait `token`'s registration (best effort: the pruner deletes what is left
        once the LISTEN connection is gone)."""
        self._write(schema, lambda store: store.unregister_waiter(run_id, token))

    def _write(self, schema: str, verb: Callable[[Store], None]) -> bool:
        """`verb` on the registrations' connection; once more on a new one when the
        connection, opened earlier, is lost: one that died while idle (idle_session_timeout,
        pg_terminate_backend) would otherwise cost a registration a poll loop and leave an
        unregistered row until the LISTEN connection goes. Both verbs are idempotent."""
        with self._writer_lock:
            for again in (self._writer is not None, False):
                try:
                    if self._writer is None or self._writer.closed:
                        self._writer = writer_connection(self.conninfo)
                    # prepare=None: psycopg prepares after a few executions, as it always did.
                    verb(Store(psycopg_runner(self._writer, prepare=None), schema))
                    return True
                except psycopg.Error as exc:
                    if self._writer is not None:
                        with contextlib.suppress(psycopg.Error):
                            self._writer.close()
                    self._writer = None
                    if not (again and isinstance(exc, psycopg.OperationalError)):
                        return False
            return False

    def _wake_all(self) -> None:
        """Every waiter reads its run again (and registers anew under a new connection)."""
        with self._lock:
            waiters = [w for ws in self._waiters.values() for w in ws]
        for wake in waiters:
            with contextlib.suppress(RuntimeError):  # an async waiter's loop closed
                wake()

    def _connected(self) -> None:
        """Back after a loss: every waiter registers anew under the new connection (the
        first connection needs no wake: its waiter registers once `watch` returns)."""
        if self._down:
            self._down = False
            self._wake_all()

    def _lost(self, error: psycopg.Error | None, retry_in: float) -> None:
        """The connection went: every waiter reads its run again (then polls). With no
        waiter left, leave the listener rather than have it reconnect for nobody: the next
        waiter connects again."""
        self._down = True
        self._wake_all()
        if error is None:
            return
        with self._lock:
            if self._waiters:
                return
            subscriptions, self._subscriptions = list(self._subscriptions.values()), {}
            self._down = False
            listener = self._listener()
            for subscription in subscriptions:
                listener.unsubscribe(subscription)

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
        """Leave the shared listener (its connection closes when nobody else listens) and
        close the registrations' connection; every waiter is woken (it then polls)."""
        with self._lock:
            subscriptions, self._subscriptions = list(self._subscriptions.values()), {}
        listener = self._listener()
        for subscription in subscriptions:
            listener.unsubscribe(subscription)
        with self._writer_lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        self._wake_all()


class Registration:
    """One wait's entry in its listener and its row in `flowq.run_waiters` (see
    `RunEndListener.register`), the row renewed when the listener's connection changed (a
    notification is only sent to a registered run). `fresh` says the row was just written
    (the waiter reads its run again soon). `end` is final, and waits for a `watch` still
    running in another thread (an `await_run` cancelled while it ran): one that finished
    after the wait's cleanup would leave its row while the LISTEN connection lives, where
    no pruner takes it."""

    def __init__(self, listener: RunEndListener | None, schema: str, channel: str,
                 run_id: int, wake: Wake) -> None:
        self.listener, self.schema, self.channel = listener, schema, channel
        self.run_id, self.wake = run_id, wake
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
            if not self.listener.watch(self.channel, self.run_id, self.wake):
                return False
            current = self.listener.backend_pid
            if current is None or current != self.pid:
                self.pid = self.listener.register(self.schema, self.run_id, self.token)
                self.fresh = self.pid is not None
            return self.pid is not None

    def take_fresh(self) -> bool:
        """Whether the row was written since the last call (the waiter reads soon)."""
        fresh, self.fresh = self.fresh, False
        return fresh

    def end(self) -> None:
        with self._lock:
            self.ended = True
            if self.listener is None:
                return
            self.listener.unwatch(self.channel, self.run_id, self.wake)
            if self.pid is not None:
                self.listener.unregister(self.schema, self.run_id, self.token)
