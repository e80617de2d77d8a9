"""The heartbeat: every `interval` (default 5 s) one statement, on a thread and a connection
of its own, beats this worker's registry entry (`flowq.workers`), listing the leases of the
claims it holds, and reads which of those jobs are still its own (`heartbeat_jobs`).

A running job is alive while its own `heartbeat_at` (set by the claim) is younger than
`stale_after`, or its worker's entry is and lists its lease, so a beat writes one row
whatever the number of jobs held, rather than one indexed update per job. A claim the worker
does not know it holds (its claim's result lost with the connection, a completion the server
acknowledged and then lost in a crash) is not listed: it is reaped as before. Each job's own
`heartbeat_at` is still refreshed, as before, while the entry is missing (removed after the
worker stalled: the registry enters it again at its next beat) or while a worker of an
earlier release is registered (its reaper reads the jobs' own heartbeats only: the
capability `LIVENESS_CAPABILITY`).

Its own thread and connection are a hard rule: no maintenance statement (a prune waiting on a
lock, a slow reap, the registry's reads) can delay a heartbeat past `stale_after` and get this
worker's live jobs reaped. The connection's statement timeout is about one interval (see
`flowq.worker.connection.heartbeat_options`): a beat that waits on a lock is cancelled and
sent again rather than silencing every other job's heartbeat.

Jobs whose fence (id, lease) no longer matches were taken from us (the reaper requeued them):
each is logged once, and its result will be discarded. The beat also reads which running jobs
were asked to stop (`flowq runs cancel`) and passes their claims to `on_cancelled`, and
writes the latest `ctx.progress` of the jobs that reported since the last beat (kept in
memory by their contexts, `flowq.durable.context.progress_of`) in the same statement, to those rows
only: a beat with no progress to write writes no job.
"""

from __future__ import annotations

from collections.abc import Callable

from flowq.db.rows import Claim
from flowq.db.store import Store
from flowq.durable.context import progress_of
from flowq.worker.config import DEFAULT_HEARTBEAT_INTERVAL
from flowq.worker.connection import DedicatedConnection
from flowq.worker.logs import WARNING, log_event
from flowq.worker.services import STOP_TIMEOUT, Service

__all__ = ["Heartbeat"]

class Heartbeat(Service):
    """Beats worker `worker`'s registry entry and checks the claims returned by `claims()`;
    `run_once()` returns how many are still ours, and leaves the ids lost at that beat in
    `lost`."""

    name = "heartbeat"

    def __init__(self, conn: DedicatedConnection, schema: str,
                 claims: Callable[[], list[Claim]],
                 unsettled: Callable[[], list[Claim]] | None = None, *, worker: str,
                 interval: float = DEFAULT_HEARTBEAT_INTERVAL,
                 on_cancelled: Callable[[list[Claim]], None] | None = None) -> None:
        super().__init__(interval=interval)
        self.conn = conn
        self.store = Store(conn.execute, schema)
        self.worker = worker
        self.claims = claims
        # The claims whose handler is still running (default: `claims`). Only those can be
        # reported lost: a claim whose outcome is being written may stop matching the fence
        # because we just completed it ourselves (the completer reports a dropped outcome).
        self.unsettled = unsettled or claims
        # Told the claims whose run was cancelled while they run (the executor tells their
        # handlers).
        self.on_cancelled = on_cancelled
        self.lost: list[int] = []  # ids lost to the reaper at the last beat
        self._reported: set[Claim] = set()  # lost claims already logged, while they run on

    def run_once(self) -> int:
        """Beat once; returns how many claims are still ours (`lost`: the ids that are not)."""
        # In id order, as the completer writes its batches: two statements that lock the
        # same rows in one order cannot deadlock (a beat covers the batch being written).
        # Sent with no claim held too: the statement beats the worker's entry.
        held = sorted(self.claims())
        # Progress rides on the beat: the handlers' latest `ctx.progress` reports since the
        # last one (in memory until now), in this same statement.
        beats = self.store.heartbeat(self.worker, held, progress_of(c[0] for c in held))
        alive = {b.id for b in beats}
        cancelled = {b.id for b in beats if b.cancel_requested}
        if cancelled and self.on_cancelled is not None:
            self.on_cancelled([c for c in held if c[0] in cancelled])
        # A job that completed between reading the claims and the UPDATE no longer matches
        # either: only a claim whose handler still runs after the UPDATE was taken from us.
        running = set(self.unsettled())
        lost = [c for c in held if c[0] not in alive and c in running]
        for job_id, lease in lost:
            if (job_id, lease) not in self._reported:  # once per claim, not every beat
                log_event(WARNING, "lost the claim on a running job (reaped after a stale "
                          "heartbeat); its result will be discarded", job_id=job_id,
                          lease=lease)
        self._reported = set(lost)
        self.lost = [c[0] for c in lost]
        return len(alive)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        super().stop(timeout)
        self.conn.close()
