"""Listener: a dedicated LISTEN connection that wakes the claimer the moment a job commits.

Notifications carry only a queue name, and for a job due later `queue@seconds`: the claimer
is then woken that many seconds later (a job enqueued with `delay=0.5` starts about 0.5 s
later, whatever the poll interval). The listener reconnects by itself (with backoff) and
wakes the claimer after every (re)connect, since notifications sent while it was away are
lost; the claimer's poll is the safety net in any case. Off with `listen=False` (poll only).
PgBouncer in transaction mode cannot hold a LISTEN: with `pgbouncer=True` the worker polls,
or listens on `listen_url` (`--listen-url`), a direct connection to PostgreSQL, since a
NOTIFY committed through the pooler reaches every session that LISTENs on the server.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Collection
from typing import Final

import psycopg

from flowq.worker.connection import Outage

__all__ = ["Listener"]

RECONNECT_MAX: Final = 5.0
# How long one wait for notifications blocks: also how long `stop()` can take, so keep it
# short (an idle wake-up costs nothing; a 1 s wait made every worker shutdown take 1 s).
WAIT_SLICE: Final = 0.2


class Listener:
    """LISTENs on `channel` and calls `wake()` for notifications about `queues`."""

    def __init__(self, conninfo: str, channel: str, queues: Collection[str],
                 wake: Callable[[], None], *, application_name: str = "flowq listen",
                 wake_in: Callable[[float], None] | None = None,
                 outage: Outage | None = None) -> None:
        self.conninfo = conninfo
        self.outage = outage or Outage()
        self.channel = channel
        self.queues = frozenset(queues)
        self.wake = wake
        self.wake_in = wake_in
        self.application_name = application_name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.connected = threading.Event()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="flowq-listener", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _notified(self, payload: str) -> None:
        queue, _, due_in = payload.partition("@")
        if queue not in self.queues:
            return
        if not due_in or self.wake_in is None:
            self.wake()
            return
        try:
            seconds = float(due_in)
        except ValueError:  # not ours to parse: wake, the claim finds out
            seconds = math.nan
        if math.isfinite(seconds):
            self.wake_in(seconds)
        else:  # NaN or infinity (anyone may NOTIFY): wake now, never poison the schedule
            self.wake()

    def _loop(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True, connect_timeout=10,
                                     application_name=self.application_name) as conn:
                    conn.execute(f'LISTEN "{self.channel}"')
                    self.connected.set()
                    backoff = 0.1
                    self.outage.ok()
                    self.wake()  # whatever was notified while we were away
                    # A LISTEN never writes, so it cannot see its server turn read-only:
                    # when another part met a read-only server, it reconnects too.
                    read_only = self.outage.read_only
                    while not self._stop.is_set() and self.outage.read_only == read_only:
                        for note in conn.notifies(timeout=WAIT_SLICE):
                            self._notified(note.payload)
                self.connected.clear()
            except psycopg.Error as exc:
                self.connected.clear()
                if self._stop.is_set():
                    return
                self.outage.failed("listen", exc, retry_in_s=round(backoff, 2))
                self._stop.wait(backoff)
                backoff = min(backoff * 2, RECONNECT_MAX)
