"""Completer: writes the outcomes attempts decided, fenced, batched where that is safe.

Outcomes of handlers that did not use `ctx.session` are queued and written by one thread in
batches: all the successes of a batch in one `UPDATE … FROM unnest(…)` that also inserts
their pipeline successors, each other outcome (retry, dead, cancelled) by primary key.
While a batch is being written the next one accumulates, so batching grows with load and
costs no latency when idle. The success of a handler that used `ctx.session` is written on
that session instead, at once and in the caller's thread, so its writes and the step's
success commit together. One entry point for both: `submit(job, outcome, duration,
session=None)`. The statements themselves are `flowq.worker.writes`, fenced on the claim: an
outcome for a row this worker no longer owns (reaped, released, cancelled) is dropped with a
log line.

Options (constructor): `job_log=True` logs each success (failures are always logged);
`on_written` is called after each batch (the worker wakes its claim loop), `on_scheduled`
with the delay of each retry written (the worker wakes when it is due), `metrics` counts
each outcome (`flowq.metrics`).

One outcome must never hold up the others. When the database is unavailable (connection
lost, server shutting down, read-only, out of connections) the batch waits and is retried
with backoff, for at most `GIVE_UP_AFTER` seconds; then its outcomes are dropped (their
claims stop heartbeating and the reaper requeues them). When a batch fails for any other
reason (a value the database refuses), its outcomes are written one by one, and one that
still fails is recorded by a minimal fallback write: `dead`, "outcome could not be
recorded: …". If even that fails, the outcome is dropped with an error log.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from flowq.db.rows import Claim, ClaimedJob
from flowq.db.store import Store
from flowq.db.transient import is_transient
from flowq.storable import describe, first_line, storable_text
from flowq.worker.connection import DB_ERRORS, DedicatedConnection, Outage
from flowq.worker.logs import ERROR, INFO, WARNING, log_event
from flowq.worker.model import Cancelled, Failed, Outcome, Retried, Succeeded, Suspended
from flowq.worker.writes import complete_in_session, end_job, write_outcome, write_successes

if TYPE_CHECKING:
    from flowq.durable.session import StepSession
    from flowq.worker.metrics import OutcomeObserver

__all__ = ["Completer"]

MAX_BATCH: Final = 1000
RETRY_BACKOFF_MAX: Final = 5.0
GIVE_UP_AFTER: Final = 600.0


@dataclass(eq=False)
class _Item:
    job: ClaimedJob
    outcome: Outcome
    duration: float
    written: bool = False
    failing_since: float | None = None


class Completer:
    """Writes outcomes; one background thread, started with `start()`."""

    def __init__(self, conn: DedicatedConnection, schema: str, *, job_log: bool = True,
                 on_written: Callable[[], None] | None = None,
                 on_scheduled: Callable[[float], None] | None = None,
                 metrics: OutcomeObserver | None = None, outage: Outage | None = None) -> None:
        self.conn = conn
        self.outage = outage or Outage()
        self.schema = schema
        # The connection's `execute` is its runner: the store's verbs send through it.
        self.store = Store(conn.execute, schema)
        self.job_log = job_log
        self.on_written = on_written
        self.on_scheduled = on_scheduled
        self.metrics = metrics
        self._items: list[_Item] = []
        self._writing: list[_Item] = []  # the batch being written: its claims need heartbeats
        self._cond = threading.Condition()
        self._busy = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.written = 0

    # -- public ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="flowq-completer", daemon=True)
        self._thread.start()

    def submit(self, job: ClaimedJob, outcome: Outcome, duration: float = 0.0,
               session: StepSession | None = None) -> None:
        """Hand on the outcome of an attempt that ran `duration` seconds: queued for the next
        batch. With `session`, the handler's `ctx.session` (a success only), it is written
        now, in that session's transaction, and committed with the handler's writes (rolled
        back if the claim is no longer ours); what the commit raises propagates, after the
        rollback, for the caller to judge as the attempt's failure."""
        if session is not None:
            if not isinstance(outcome, Succeeded):
                raise TypeError("only a success is written in the handler's session")
            if complete_in_session(session, self.schema, job, outcome):
                self._log_success(job, duration)
            else:
                self._log_lost(job, "completion")
            return
        with self._cond:
            self._items.append(_Item(job, outcome, duration))
            self._cond.notify()

    @property
    def queued(self) -> int:
        """Outcomes waiting for the next batch (not counting the one being written)."""
        return len(self._items)

    def pending_claims(self) -> list[Claim]:
        """The claims of outcomes not yet written: they still need heartbeats."""
        with self._cond:
            return [i.job.claim for i in (*self._writing, *self._items) if not i.written]

    def flush(self, timeout: float) -> bool:
        """Wait until every queued outcome is written; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._items or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def stop(self, timeout: float) -> bool:
        ok = self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        return ok

    # -- the batch loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        backoff = 0.05
        while True:
            with self._cond:
                while not self._items and not self._stopping:
                    self._cond.wait(1.0)
                if self._stopping and not self._items:
                    return
                batch, self._items = self._items[:MAX_BATCH], self._items[MAX_BATCH:]
                self._writing = batch
                self._busy += 1
            later: list[_Item] = []
            try:
                later = self._write_batch(batch)
            except Exception as exc:  # a bug: log it; the claims get reaped, never stuck here
                log_event(ERROR, "completion write crashed; outcomes dropped (the reaper will "
                          "requeue their jobs)", error=first_line(describe(exc)),
                          job_ids=_ids(i for i in batch if not i.written))
            later = self._expire(later)
            with self._cond:
                self._items[:0] = later
                self._writing = []
                self._busy -= 1
                self.written += len(batch) - len(later)
                self._cond.notify_all()
            if self.on_written is not None:
                self.on_written()
            if later:
                time.sleep(backoff)
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX)
            else:
                backoff = 0.05

    def _expire(self, later: list[_Item]) -> list[_Item]:
        """Keep retrying unavailable writes for GIVE_UP_AFTER seconds at most."""
        now = time.monotonic()
        keep: list[_Item] = []
        expired: list[_Item] = []
        for item in later:
            item.failing_since = item.failing_since or now
            (expired if now - item.failing_since > GIVE_UP_AFTER else keep).append(item)
        for item in expired:
            self._observe(item.job, "lost", None)
        if expired:
            log_event(ERROR, "gave up writing outcomes: the database stayed unavailable; the "
                      "reaper will requeue their jobs", job_ids=_ids(expired))
        return keep

    def _write_batch(self, batch: list[_Item]) -> list[_Item]:
        """Write `batch`; returns the items to try again later (the database is unavailable).
        A batch the database refuses is written item by item, so one bad outcome never
        holds up the others."""
        try:
            self._write(batch)
            self.outage.ok()
            return []
        except DB_ERRORS as exc:
            if is_transient(exc):
                self.outage.failed("completion write", exc, batch=len(batch))
                return [i for i in batch if not i.written]
            log_event(WARNING, "completion batch refused; writing its outcomes one by one",
                      error=first_line(describe(exc)), batch=len(batch))
        for n, item in enumerate(batch):
            if item.written:
                continue
            try:
                try:
                    self._write([item])
                except DB_ERRORS as exc:
                    if is_transient(exc):
                        raise
                    self._record_unwritable(item, exc)
            except DB_ERRORS:
                return [i for i in batch[n:] if not i.written]
        return []

    def _record_unwritable(self, item: _Item, error: BaseException) -> None:
        """The minimal fallback for an outcome the database refuses: end the job `dead`."""
        text = storable_text(
            f"outcome could not be recorded: {first_line(describe(error))}\n\n"
            f"the outcome was {type(item.outcome).__name__}: "
            f"{first_line(_summary(item.outcome))}")
        try:
            result = end_job(self.store, item.job, "dead", text)
        except DB_ERRORS as exc:
            if is_transient(exc):
                raise
            item.written = True  # nothing more can be done: the reaper requeues the job
            log_event(ERROR, "outcome could not be recorded at all; dropped (the reaper will "
                      "requeue the job)", error=first_line(describe(exc)),
                      **self._fields(item.job, item.duration))
            return
        item.written = True
        self._observe(item.job, result[0] if result else "lost", item.duration)
        log_event(ERROR, "outcome could not be recorded; the job is dead",
                  error=first_line(describe(error)), status=result[0] if result else "lost",
                  **self._fields(item.job, item.duration))

    def _write(self, batch: Sequence[_Item]) -> None:
        # Autocommit: each statement is atomic on its own and no outcome needs another's, so
        # a batch costs one round trip per statement, no BEGIN/COMMIT. Items are marked
        # written as their statement commits, so a failure later in the batch re-sends none.
        successes = [i for i in batch if isinstance(i.outcome, Succeeded) and not i.written]
        if successes:
            ours = write_successes(self.store, [(i.job, _success(i.outcome))
                                                for i in successes])
            for i in successes:
                i.written = True
                if i.job.id in ours:
                    self._log_success(i.job, i.duration)
                else:
                    self._log_lost(i.job, "completion")
        for i in batch:
            if not i.written:
                assert not isinstance(i.outcome, Succeeded)
                result = write_outcome(self.store, i.job, i.outcome)
                i.written = True
                if result is not None and result[0] == "pending" and self.on_scheduled:
                    self.on_scheduled(result[1])
                self._log_other(i, result)

    # -- logging ----------------------------------------------------------------------------

    def _fields(self, job: ClaimedJob, duration: float) -> dict[str, Any]:
        return {"job_id": job.id, "run_id": job.run_id, "task": job.task, "step": job.step,
                "attempt": job.attempts, "duration_ms": round(duration * 1000, 2)}

    def _observe(self, job: ClaimedJob, outcome: str, duration: float | None) -> None:
        if self.metrics is not None:
            self.metrics.observe_outcome(job, outcome, duration)

    def _log_success(self, job: ClaimedJob, duration: float) -> None:
        self._observe(job, "succeeded", duration)
        if self.job_log:
            log_event(INFO, "job succeeded", **self._fields(job, duration))

    def _log_lost(self, job: ClaimedJob, what: str) -> None:
        self._observe(job, "lost", None)
        log_event(WARNING, f"{what} dropped: the job is no longer ours (reaped or cancelled)",
                  **self._fields(job, 0.0))

    def _log_other(self, item: _Item, result: tuple[str, float] | None) -> None:
        if result is None:
            self._log_lost(item.job, "failure")
            return
        status, delay = result
        suspended = status == "pending" and isinstance(item.outcome, Suspended)
        # A suspension (a durable sleep, a snooze) requeues the step like a retry, but no
        # attempt failed: it is counted apart, as the attempt's span says (flowq.tracing).
        self._observe(item.job, "suspended" if suspended else status, item.duration)
        fields = self._fields(item.job, item.duration)
        summary = first_line(_summary(item.outcome))[:300]
        if suspended:
            log_event(INFO, "job suspended (a durable sleep or a snooze)",
                      due_in_s=round(delay, 3), reason=summary, **fields)
        elif status == "pending":
            log_event(WARNING, "job failed; retrying", retry_in_s=round(delay, 3),
                      error=summary, **fields)
        elif status == "dead":
            log_event(ERROR, "job dead: attempts exhausted or not retryable", error=summary,
                      **fields)
        else:
            log_event(WARNING, "job cancelled", reason=summary, **fields)


def _summary(outcome: Outcome) -> str:
    if isinstance(outcome, Failed):
        return outcome.summary or outcome.text
    if isinstance(outcome, Retried | Cancelled | Suspended):
        return outcome.reason
    return "succeeded"


def _success(outcome: Outcome) -> Succeeded:
    assert isinstance(outcome, Succeeded)
    return outcome


def _ids(items: Any) -> str:
    return ",".join(str(i.job.id) for i in items)
