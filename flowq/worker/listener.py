"""Listener: a dedicated LISTEN connection that wakes the claimer the moment a job commits.

Notifications carry only a queue name, and for a job due later `queue@seconds`: the claimer
is then woken that many seconds later (a job enqueued with `delay=0.5` starts about 0.5 s
later, whatever the poll interval). The listener reconnects by itself (with backoff) and
wakes the claimer after every (re)connect, since notifications sent while it was away are
lost; the claimer's poll is the safety net in any case. Off with `listen=False` (poll only).
PgBouncer in transaction mode cannot hold a LISTEN: with `pgbouncer=True` the worker polls,
or listens on `listen_url` (`--listen-url`), a direct connection to PostgreSQL, since a
NOTIFY committed through the pooler reaches every session that LISTENs on the server.

The connection is the process's one to that database (`flowq.db.listener.SharedListener`,
which `wait_run` shares): this module is the worker's subscription to it, the queues it
cares about, and what a (re)connect or a loss means for the worker (its `Outage`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Collection
from typing import Any, Final

import psycopg

from flowq.db.listener import SharedListener, Subscription
from flowq.worker.connection import Outage

__all__ = ["Listener"]

CONNECT_TIMEOUT: Final = 10


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
        self.connected = threading.Event()
        self._read_only = self.outage.read_only
        self._subscription = Subscription(channel, self._notified, self._connected,
                                          self._lost, self._stale)
        self._shared: SharedListener | None = None

    def start(self) -> None:
        """Subscribe to the process's listener (which connects in its own thread)."""
        self._shared = SharedListener.of(self.conninfo, self._connect)
        self._shared.subscribe(self._subscription, wait=False)

    def stop(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.unsubscribe(self._subscription)
        self.connected.clear()

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT,
                               application_name=self.application_name)

    def _connected(self) -> None:
        # A LISTEN never writes, so it cannot see its server turn read-only: when another
        # part met a read-only server, it reconnects too (`_stale`).
        self._read_only = self.outage.read_only
        self.connected.set()
        self.outage.ok()
        self.wake()  # whatever was notified while we were away

    def _lost(self, error: psycopg.Error | None, retry_in: float) -> None:
        self.connected.clear()
        if error is not None:
            self.outage.failed("listen", error, retry_in_s=round(retry_in, 2))

    def _stale(self) -> bool:
        return self.outage.read_only != self._read_only

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
