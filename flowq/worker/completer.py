"""Completer: records outcomes in the database, fenced, batched where that is safe.

Outcomes of handlers that did not use `ctx.session` are queued and written by one thread in
batches: all the successes of a batch in one `UPDATE … FROM unnest(…)`, their pipeline
successors in one INSERT, in one transaction. While a batch is being written the next one
accumulates, so batching grows with load and costs no latency when idle.

Handlers that used `ctx.session` are completed on that session instead (`complete_in_session`)
so their writes and the step's success commit together, or not at all.

Every write is a compare-and-set on (id, attempts, status = 'running'): a row this worker no
longer owns (reaped, released, cancelled) is left alone and the outcome is dropped with a log
line. A database error keeps the batch and retries it; re-sending an already committed batch
is harmless because the fence then matches nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import psycopg
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import TextClause

from flowq.queries import Queries
from flowq.retry import Retry
from flowq.schema import notify_channel
from flowq.worker.connection import DB_ERRORS, DedicatedConnection, fetch_rows
from flowq.worker.logs import log_event
from flowq.worker.model import Cancelled, ClaimedJob, Failed, Outcome, Retried, Succeeded

__all__ = ["Completer"]

MAX_BATCH: Final = 1000
RETRY_BACKOFF_MAX: Final = 5.0
_LOG_ERROR_CHARS: Final = 8000
_DEFAULT_RETRY: Final = Retry()

INFO, WARNING, ERROR = 20, 30, 40

# Runs one named statement and returns its rows as tuples: the completer's own dedicated
# connection, or the connection of a handler's ctx.session.
_Run = Callable[[TextClause, Mapping[str, Any]], list[tuple[Any, ...]]]


@dataclass(frozen=True)
class _Item:
    job: ClaimedJob
    outcome: Outcome
    duration: float


class Completer:
    """Writes outcomes; one background thread, started with `start()`."""

    def __init__(self, conn: DedicatedConnection, queries: Queries, *, job_log: bool = True
                 ) -> None:
        self.conn = conn
        self.q = queries
        self.channel = notify_channel(queries.schema)
        self.job_log = job_log
        self._items: list[_Item] = []
        self._writing: list[_Item] = []  # the batch being written: its claims need heartbeats
        self._cond = threading.Condition()
        self._busy = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.written = 0
        self.on_written: Callable[[], None] | None = None  # after each batch (wakes claims)

    # -- public ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="flowq-completer", daemon=True)
        self._thread.start()

    def submit(self, job: ClaimedJob, outcome: Outcome, duration: float) -> None:
        """Queue an outcome for the next batch."""
        with self._cond:
            self._items.append(_Item(job, outcome, duration))
            self._cond.notify()

    @property
    def queued(self) -> int:
        """Outcomes waiting for the next batch (not counting the one being written)."""
        return len(self._items)

    def pending_claims(self) -> list[tuple[int, int]]:
        """(id, attempts) of outcomes not yet written: they still need heartbeats."""
        with self._cond:
            return [(i.job.id, i.job.attempts) for i in (*self._writing, *self._items)]

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

    def complete_in_session(self, job: ClaimedJob, outcome: Succeeded, session: Session,
                            duration: float) -> bool:
        """Commit the handler's `ctx.session` writes together with its success, or roll them
        back if the claim is no longer ours. True when committed."""
        try:
            conn = session.connection()
            raw = conn.connection.dbapi_connection

            def run(clause: TextClause, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
                if isinstance(raw, psycopg.Connection):
                    return fetch_rows(raw, clause, params)
                return [tuple(r) for r in conn.execute(clause, params)]

            ours = self._write_successes(run, [_Item(job, outcome, duration)])
            if not ours:
                session.rollback()
                self._log_lost(job, "completion")
                return False
            session._flowq_commit()  # type: ignore[attr-defined]
        except BaseException:
            session.rollback()
            raise
        self._log_success(job, duration)
        return True

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
            try:
                self._write(batch)
                backoff = 0.05
            except DB_ERRORS as exc:
                log_event(WARNING, "completion write failed; retrying", error=_first_line(exc),
                          batch=len(batch), retry_in_s=round(backoff, 2))
                with self._cond:
                    self._items[:0] = batch
                time.sleep(backoff)
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX)
            except Exception as exc:  # a bug: never let the thread die with outcomes queued
                log_event(ERROR, "completion write crashed; retrying", error=repr(exc))
                with self._cond:
                    self._items[:0] = batch
                time.sleep(1.0)
            finally:
                with self._cond:
                    self._writing = []
                    self._busy -= 1
                    self.written += len(batch)
                    self._cond.notify_all()
                if self.on_written is not None:
                    self.on_written()

    def _write(self, batch: Sequence[_Item]) -> None:
        successes = [i for i in batch if isinstance(i.outcome, Succeeded)]
        others = [i for i in batch if not isinstance(i.outcome, Succeeded)]
        # Autocommit: each statement is atomic on its own and no outcome needs another's, so
        # a batch costs one round trip per statement, no BEGIN/COMMIT.
        run = self.conn.execute
        ours = self._write_successes(run, successes) if successes else set()
        failed_logs = [(i, self._write_other(run, i)) for i in others]
        for i in successes:
            if i.job.id in ours:
                self._log_success(i.job, i.duration)
            else:
                self._log_lost(i.job, "completion")
        for i, status in failed_logs:
            self._log_other(i, status)

    def _write_successes(self, run: _Run, items: Sequence[_Item]) -> set[int]:
        """Mark `items` succeeded and insert their successors, in one statement; the ids that
        were still ours."""
        done = [(i.job, i.outcome) for i in items if isinstance(i.outcome, Succeeded)]
        if len(done) == 1:
            return self._write_success(run, *done[0])
        params: dict[str, Any] = {
            "ids": [job.id for job, _ in done],
            "attempts": [job.attempts for job, _ in done],
            "results": [out.result for _, out in done],
        }
        chained = [(job, out.next) for job, out in done if out.next is not None]
        if not chained:
            rows = run(self.q.complete_jobs, params)
        else:
            rows = run(self.q.complete_steps, {
                **params,
                "next_ids": [job.id for job, _ in chained],
                "tasks": [n.task for _, n in chained],
                "steps": [n.step.name for _, n in chained],
                "indexes": [n.step.index for _, n in chained],
                "queues": [n.step.queue for _, n in chained],
                "max_attempts": [n.step.retry.attempt_cap for _, n in chained],
                "args": [n.args for _, n in chained],
                "channel": self.channel,
            })
        return {r[0] for r in rows}

    def _write_success(self, run: _Run, job: ClaimedJob, outcome: Succeeded) -> set[int]:
        """One success (a `ctx.session` job, or a batch of one), by primary key."""
        params: dict[str, Any] = {"id": job.id, "attempts": job.attempts,
                                  "result": outcome.result}
        nxt = outcome.next
        if nxt is None:
            rows = run(self.q.complete_job, params)
        else:
            rows = run(self.q.complete_step, {
                **params, "task": nxt.task, "step": nxt.step.name, "step_index": nxt.step.index,
                "queue": nxt.step.queue, "max_attempts": nxt.step.retry.attempt_cap,
                "args": nxt.args, "channel": self.channel,
            })
        return {r[0] for r in rows}

    def _write_other(self, run: _Run, item: _Item) -> tuple[str, float] | None:
        """Retry, bury or cancel one job; (new status, delay) or None if it was not ours."""
        job, outcome = item.job, item.outcome
        delay: float | None
        if isinstance(outcome, Cancelled):
            return self._end(run, job, "cancelled", f"CancelRun: {outcome.reason}")
        if isinstance(outcome, Retried):
            error = f"RetryStep: {outcome.reason or 'retry requested by the handler'}"
            delay = outcome.delay if job.attempts < job.max_attempts else None
        else:
            assert isinstance(outcome, Failed)
            error = outcome.text[:_LOG_ERROR_CHARS]
            delay = None
            elapsed = job.age + item.duration
            if outcome.permanent:
                pass
            elif isinstance(outcome.retry, Retry):
                # The step's policy knows its own cap; the row's copy may be stale (enqueued by
                # name without the definition, or the policy changed in a deploy).
                delay = outcome.retry.next_delay(job.attempts, outcome.error, elapsed)
            elif job.attempts < job.max_attempts:
                delay = _DEFAULT_RETRY.next_delay(job.attempts, outcome.error, elapsed)
        if delay is None:
            return self._end(run, job, "dead", error)
        rows = run(self.q.retry_job, {"id": job.id, "attempts": job.attempts, "delay": delay,
                                      "error": error})
        return (rows[0][0], delay) if rows else None

    def _end(self, run: _Run, job: ClaimedJob, status: str,
             error: str) -> tuple[str, float] | None:
        rows = run(self.q.end_job, {"id": job.id, "attempts": job.attempts, "status": status,
                                    "error": error})
        return (rows[0][0], 0.0) if rows else None

    # -- logging ----------------------------------------------------------------------------

    def _fields(self, job: ClaimedJob, duration: float) -> dict[str, Any]:
        return {"job_id": job.id, "run_id": job.run_id, "task": job.task, "step": job.step,
                "attempt": job.attempts, "duration_ms": round(duration * 1000, 2)}

    def _log_success(self, job: ClaimedJob, duration: float) -> None:
        if self.job_log:
            log_event(INFO, "job succeeded", **self._fields(job, duration))

    def _log_lost(self, job: ClaimedJob, what: str) -> None:
        log_event(WARNING, f"{what} dropped: the job is no longer ours (reaped or cancelled)",
                  **self._fields(job, 0.0))

    def _log_other(self, item: _Item, result: tuple[str, float] | None) -> None:
        if result is None:
            self._log_lost(item.job, "failure")
            return
        status, delay = result
        fields = self._fields(item.job, item.duration)
        outcome = item.outcome
        error = (outcome.text.splitlines()[-1] if isinstance(outcome, Failed) and outcome.text
                 else getattr(outcome, "reason", ""))
        if status == "pending":
            log_event(WARNING, "job failed; retrying", retry_in_s=round(delay, 3),
                      error=_tail(outcome), **fields)
        elif status == "dead":
            log_event(ERROR, "job dead: attempts exhausted or not retryable",
                      error=_tail(outcome), **fields)
        else:
            log_event(WARNING, "job cancelled", reason=error, **fields)


def _tail(outcome: Outcome) -> str:
    if isinstance(outcome, Failed):
        return _first_line(outcome.error) if str(outcome.error) else type(outcome.error).__name__
    return getattr(outcome, "reason", "")


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0]
