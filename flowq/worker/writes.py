"""The fenced writes of outcomes, over any `flowq.db.store.Store`: the completer's batches on
its own connection, a handler's `ctx.session` completion, and the test kit on the test's
connection.

- `write_successes(store, done)`: mark the jobs succeeded and insert what they spawn, in one
  statement; the ids that were still ours.
- `write_outcome(store, job, outcome)`: retry, bury, cancel or suspend (a durable sleep, a
  snooze) one job; (its new status, the delay) or None if it was not ours.
- `end_job(store, job, status, error)`: end one job `dead` or `cancelled`.
- `complete_in_session(session, schema, job, outcome)`: a success written in the transaction
  of a handler's `ctx.session` and committed with its writes, or rolled back with them if the
  claim is no longer ours.

Every write is a compare-and-set on the claim, (id, lease) and `running`: a row the writer
no longer owns (reaped, released, cancelled) is left alone. Re-sending a write that already
committed is harmless for the same reason. The store builds every parameter; this module only
turns outcomes into its dataclasses.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Literal

from flowq.db.rows import ClaimedJob, Completion, Spawned
from flowq.db.runner import runner
from flowq.db.store import Store
from flowq.durable.session import StepSession, commit_step_session
from flowq.storable import clamp_delay
from flowq.worker.model import Cancelled, Failed, Retried, Spawn, Succeeded, Suspended

__all__ = ["complete_in_session", "end_job", "write_outcome", "write_successes"]


def write_successes(store: Store, done: Sequence[tuple[ClaimedJob, Succeeded]]) -> set[int]:
    """Mark `done` succeeded and insert what they spawn, in one statement; the ids that were
    still ours."""
    # In id order, as the heartbeat locks them: the same rows locked in one order by both
    # statements cannot deadlock (seen once in a 1,000,000-job drain before the sort). The
    # store sorts the claims; the successors follow them in the same order.
    done = sorted(done, key=lambda d: d[0].id)
    completions = [Completion(job.id, job.lease, outcome.result) for job, outcome in done]
    successors = [_spawned(job, sp) for job, outcome in done for sp in outcome.spawn]
    return {c.id for c in store.complete(completions, successors)}


def write_outcome(store: Store, job: ClaimedJob,
                  outcome: Failed | Retried | Cancelled | Suspended
                  ) -> tuple[str, float] | None:
    """Retry, bury, cancel or suspend `job`; (its new status, the delay) or None if it was not
    ours. The status is `pending` for a retry or a suspension, unless the run was cancelled
    meanwhile. A suspension gives its attempt back."""
    if isinstance(outcome, Suspended):
        suspended = store.suspend(job.claim, outcome.step or job.step, until=outcome.until,
                                  delay=outcome.delay, snoozes=outcome.snoozes)
        if suspended is None:
            return None
        # The delay only sets the worker's wake-up (the row's run_at is the database's).
        left = (suspended.run_at - datetime.now(timezone.utc)).total_seconds()
        return suspended.status, clamp_delay(left)
    if isinstance(outcome, Cancelled):
        return end_job(store, job, "cancelled", f"CancelRun: {outcome.reason}")
    if isinstance(outcome, Retried) and outcome.handed_over:
        handed = store.hand_over(job.claim, job.step, outcome.delay, outcome.reason)
        return (handed.status, outcome.delay) if handed is not None else None
    if isinstance(outcome, Retried):
        delay: float | None = outcome.delay
        error = f"RetryStep: {outcome.reason}"
    else:
        delay, error = outcome.retry_in, outcome.text
    if delay is None:
        return end_job(store, job, "dead", error)
    retried = store.retry(job.claim, delay, error)
    return (retried.status, delay) if retried is not None else None


def end_job(store: Store, job: ClaimedJob, status: Literal["dead", "cancelled"],
            error: str) -> tuple[str, float] | None:
    """End `job` with `status` and `error`; (the status it got, 0) or None if it was not
    ours."""
    ended = store.end(job.claim, status, error)
    return (ended, 0.0) if ended is not None else None


def complete_in_session(session: StepSession, schema: str, job: ClaimedJob,
                        outcome: Succeeded) -> bool:
    """Commit the handler's `ctx.session` writes together with its success, or roll them back
    if the claim is no longer ours; True when committed. Anything the commit raises (the
    handler's writes failing at commit) propagates, after the rollback: the caller judges it
    as the attempt's failure."""
    try:
        # In the session's transaction (begun now if need be), straight through psycopg when
        # that is its driver (prepared, as on the completer's own connection).
        if not write_successes(Store(runner(session), schema), [(job, outcome)]):
            session.rollback()
            return False
        commit_step_session(session)
    except BaseException:
        session.rollback()
        raise
    return True


def _spawned(job: ClaimedJob, sp: Spawn) -> Spawned:
    """The row `sp` creates after `job`'s claim, with its workflow columns (the store sends
    them only when a successor of the batch waits for a signal or joins)."""
    step = sp.step
    return Spawned(id=job.id, lease=job.lease, task=sp.task, step=step.name,
                   step_index=step.index, queue=step.queue,
                   max_attempts=step.retry.attempt_cap, args=sp.args, map_index=sp.map_index,
                   delay=step.delay, signal=step.wait_for, wait=step.wait_timeout,
                   parents=sp.parents, delta=sp.delta, source=sp.parent, input=sp.input,
                   mapped=sp.mapped, items=sp.items)
