"""The process's one LISTEN connection per database, shared by everything that listens.

`SharedListener.of(conninfo, connect)` is the listener of a database for this process (a
forked child gets its own): one autocommit connection, one daemon thread reading its
notifications and handing each to the `Subscription`s of its channel, one reconnect policy.
The worker's wake-ups (`flowq.worker.listener`) and `wait_run` / `await_run`'s run ends
(`flowq.ops.waiters`) subscribe to it, so a process that does both holds one connection.

- Subscriptions are counted per channel: the first one of a channel sends its LISTEN, the
  last one to leave its UNLISTEN; when none is left the connection is closed and the thread
  ends (a later subscription opens a new listener).
- Reconnect: after the connection is lost or a connect fails, the thread waits `backoff`
  seconds (from `BACKOFF[0]` doubling to `BACKOFF[1]`, reset once connected) and connects
  again, for as long as a subscription is left. A subscription's `stale()` returning True
  (the worker met a read-only server: a LISTEN never writes, so it cannot see it) makes the
  thread reconnect at once. Every subscriber hears `lost(error, retry_in)` (error None for a
  deliberate reconnect) and `connected()` after every (re)connect, since notifications sent
  while it was away are lost.
- A subscriber whose callback raises is logged and skipped: the others still hear.
- The connection is opened by the `connect` of the part that created the listener (its
  application name is that part's: `flowq listen <worker>` or `flowq wait_run`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal

import psycopg

__all__ = ["BACKOFF", "SLICE", "SharedListener", "Subscription"]

logger = logging.getLogger(__name__)

# How long the thread waits before connecting again: from the first, doubling up to the last.
BACKOFF: Final = (0.1, 5.0)
# How long one read of notifications blocks: also how long a LISTEN sent by another thread,
# or a stop, can wait for the thread (psycopg holds the connection's lock while it reads);
# keep it short (an idle wake-up costs nothing; a 1 s wait made every worker shutdown take
# 1 s).
SLICE: Final = 0.2
# How long a subscriber that asked to wait waits for a connect attempt under way.
ATTEMPT_WAIT: Final = 15.0

Connect = Callable[[], psycopg.Connection[Any]]
State = Literal["down", "connecting", "up", "backoff"]


def _never() -> bool:
    return False


def _quiet(*args: Any) -> None:
    return None


def _lose(subscription: Subscription, *, error: psycopg.Error, retry_in: float) -> None:
    subscription.lost(error, retry_in)


@dataclass(frozen=True, eq=False)
class Subscription:
    """What one subscriber hears on `channel`: `notified(payload)` per notification,
    `connected()` after every (re)connect, `lost(error, retry_in)` when the connection went
    (error None: a deliberate reconnect, at once); `stale()` asks for a reconnect. All are
    called on the listener's thread."""

    channel: str
    notified: Callable[[str], None]
    connected: Callable[[], None] = _quiet
    lost: Callable[[psycopg.Error | None, float], None] = _quiet
    stale: Callable[[], bool] = _never


class SharedListener:
    """One LISTEN connection to a database, shared by the subscribers of this process."""

    _shared: ClassVar[dict[str, SharedListener]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, connect: Connect) -> None:
        self.connect = connect
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._channels: dict[str, tuple[Subscription, ...]] = {}
        self._listening: set[str] = set()
        self._conn: psycopg.Connection[Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._state: State = "down"

    @classmethod
    def of(cls, conninfo: str, connect: Connect) -> SharedListener:
        """The process's listener for `conninfo`, created (with `connect`) on first use, and
        again once its last subscriber left."""
        with cls._shared_lock:
            found = cls._shared.get(conninfo)
            if found is None or found._pid != os.getpid():
                found = cls._shared[conninfo] = SharedListener(connect)
            return found

    @property
    def up(self) -> bool:
        """Whether notifications can arrive (connected, its thread reading)."""
        thread = self._thread
        return self._state == "up" and thread is not None and thread.is_alive()

    @property
    def backend_pid(self) -> int | None:
        """The backend pid of the LISTEN connection (None while down)."""
        with self._cond:
            conn = self._conn if self._state == "up" else None
            return None if conn is None else conn.info.backend_pid

    def listening(self, channel: str, *, wait: bool = True) -> bool:
        """Whether `channel` is LISTENed now: waits for a connect under way when `wait`, and
        sends the channel's LISTEN if the connection does not have it yet (it does once this
        returns True: a commit's notification after that cannot be missed)."""
        with self._cond:
            if wait and self._state == "connecting":
                self._cond.wait_for(lambda: self._state != "connecting", ATTEMPT_WAIT)
            if not self.up or channel not in self._channels:
                return False
            if channel not in self._listening:
                assert self._conn is not None
                try:
                    self._conn.execute(f'LISTEN "{channel}"')
                except psycopg.Error:  # the thread finds the connection broken too
                    return False
                self._listening.add(channel)
            return True

    def subscribe(self, subscription: Subscription, *, wait: bool = True) -> bool:
        """Add `subscription` (starting the thread if none runs); whether its channel is
        LISTENed now (`listening`: with `wait`, after the first connect attempt)."""
        with self._cond:
            ours = self._channels.get(subscription.channel, ())
            self._channels[subscription.channel] = (*ours, subscription)
            thread = self._thread
            if thread is None or not thread.is_alive() or self._stop.is_set():
                # A thread told to stop (the last subscriber left) is left to end on its
                # own: it no longer changes the state, a new one owns it.
                self._stop = threading.Event()
                self._state = "connecting"
                self._thread = threading.Thread(target=self._run, args=(self._stop,),
                                                daemon=True, name="flowq-listener")
                self._thread.start()
        return self.listening(subscription.channel, wait=wait)

    def unsubscribe(self, subscription: Subscription) -> None:
        """Remove `subscription`: UNLISTEN its channel if it was the last there, and close
        the connection if it was the last of all (waits for the thread, up to 2 s)."""
        with self._cond:
            ours = tuple(s for s in self._channels.get(subscription.channel, ())
                         if s is not subscription)
            if ours:
                self._channels[subscription.channel] = ours
                return
            self._channels.pop(subscription.channel, None)
            if self._channels:
                if subscription.channel in self._listening and self._conn is not None:
                    self._listening.discard(subscription.channel)
                    with contextlib.suppress(psycopg.Error):
                        self._conn.execute(f'UNLISTEN "{subscription.channel}"')
                return
            self._stop.set()
            thread = self._thread
            if self._state != "down":
                self._state, self._conn = "down", None
                self._listening.clear()
                self._cond.notify_all()
        self._forget()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10 * SLICE)

    def _forget(self) -> None:
        """Leave the registry once nobody subscribes: `connect` may hold its creator (a
        worker, and its app) alive, which a later listener of the database must not."""
        with SharedListener._shared_lock, self._cond:
            if not self._channels:
                for conninfo, found in list(SharedListener._shared.items()):
                    if found is self:
                        del SharedListener._shared[conninfo]

    def _everyone(self) -> list[Subscription]:
        with self._cond:
            return [s for subs in self._channels.values() for s in subs]

    def _tell(self, call: Callable[[Subscription], object]) -> None:
        """`call` for every subscriber: one that raises is logged, the others still hear."""
        for subscription in self._everyone():
            self._safely(call, subscription)

    @staticmethod
    def _safely(call: Callable[[Subscription], object], subscription: Subscription) -> None:
        try:
            call(subscription)
        except Exception:
            logger.exception("a subscriber of channel %r failed", subscription.channel)

    def _set(self, stop: threading.Event, state: State,
             conn: psycopg.Connection[Any] | None = None) -> bool:
        """Enter `state` unless this thread was told to stop (a newer one owns the state)."""
        with self._cond:
            if stop.is_set():
                return False
            self._state, self._conn = state, conn
            if conn is None:
                self._listening.clear()
            self._cond.notify_all()
            return True

    def _open(self, stop: threading.Event) -> psycopg.Connection[Any] | None:
        """Connect and LISTEN on every subscribed channel; None when stopped meanwhile."""
        conn = self.connect()
        try:
            with self._cond:
                if stop.is_set():
                    conn.close()
                    return None
                for channel in sorted(self._channels):
                    conn.execute(f'LISTEN "{channel}"')  # [a-z0-9_:] only: our channels
                self._listening = set(self._channels)
                self._state, self._conn = "up", conn
                self._cond.notify_all()
            return conn
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                conn.close()
            raise

    def _run(self, stop: threading.Event) -> None:
        backoff = BACKOFF[0]
        while self._set(stop, "connecting"):
            error: psycopg.Error | None = None
            conn = None
            try:
                conn = self._open(stop)
                if conn is None:
                    return
                backoff = BACKOFF[0]
                self._tell(lambda s: s.connected())
                self._read(conn, stop)
            except psycopg.Error as exc:
                error = exc
            finally:
                if conn is not None:
                    self._set(stop, "connecting")  # before the close: nobody sends on it
                    with contextlib.suppress(psycopg.Error):  # a broken connection
                        conn.close()
            if stop.is_set():
                return
            if error is None:  # a subscriber asked for a new connection: at once
                self._tell(lambda s: s.lost(None, 0.0))
                continue
            if not self._set(stop, "backoff"):
                return
            self._tell(functools.partial(_lose, error=error, retry_in=backoff))
            stop.wait(backoff)
            backoff = min(backoff * 2, BACKOFF[1])

    def _read(self, conn: psycopg.Connection[Any], stop: threading.Event) -> None:
        """Hand out notifications until stopped or a subscriber is stale (returns), or the
        connection breaks (raises)."""
        while not stop.is_set():
            # Collected first: the generator holds the connection's lock while it waits, and
            # `listening` may hold the condition's lock while it sends a LISTEN here.
            # stop_after=1: back as soon as a packet came, not at the end of the slice.
            for note in list(conn.notifies(timeout=SLICE, stop_after=1)):
                for subscription in self._channels.get(note.channel, ()):
                    try:
                        subscription.notified(note.payload)
                    except Exception:
                        logger.exception("a subscriber of channel %r failed", note.channel)
            # A tuple made in one step: another thread may add a channel meanwhile.
            if any(s.stale() for subs in tuple(self._channels.values()) for s in subs):
                return
