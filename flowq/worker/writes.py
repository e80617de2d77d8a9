"""The fenced writes of outcomes, over any runner: the completer's batches on its own
connection, a handler's `ctx.session` completion, and the test kit on the test's connection.

- `write_successes(run, q, done)`: mark the jobs succeeded and insert what they spawn, in one
  statement; the ids that were still ours.
- `write_outcome(run, q, job, outcome)`: retry, bury or cancel one job; (its new status, the
  delay) or None if it was not ours.
- `end_job(run, q, job, status, error)`: end one job `dead` or `cancelled`.
- `complete_in_session(session, q, job, outcome)`: a success written in the transaction of a
  handler's `ctx.session` and committed with its writes, or rolled back with them if the
  claim is no longer ours.

Every write is a compare-and-set on the claim, (id, lease) and `running`: a row the writer
no longer owns (reaped, released, cancelled) is left alone. Re-sending a write that already
committed is harmless for the same reason. A `Runner` runs one named statement and returns
its rows as tuples; `connection_runner` and `session_runner` make one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy import orm
from sqlalchemy.sql.elements import TextClause

from flowq.context import StepSession, commit_step_session
from flowq.db.rows import ClaimedJob
from flowq.db.runner import fetch_rows
from flowq.db.schema import notify_channel
from flowq.db.sql import Queries
from flowq.db.sql.fragments import plural
from flowq.worker.model import Cancelled, Failed, Retried, Spawn, Succeeded

__all__ = ["Runner", "complete_in_session", "connection_runner", "end_job", "session_runner",
           "write_outcome", "write_successes"]

Runner = Callable[[TextClause, Mapping[str, Any]], list[tuple[Any, ...]]]
"""Runs one of flowq's statements with its parameters; its rows as tuples."""


def connection_runner(conn: sa.Connection) -> Runner:
    """A runner over a SQLAlchemy connection, in whatever transaction it is in."""
    def run(clause: TextClause, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in conn.execute(clause, params)]

    return run


def session_runner(session: orm.Session) -> Runner:
    """A runner in `session`'s transaction (begun now if need be): straight through psycopg
    when that is its driver (prepared statements, as the completer's own connection), else
    through SQLAlchemy."""
    conn = session.connection()
    raw = conn.connection.dbapi_connection
    if isinstance(raw, psycopg.Connection):
        def run(clause: TextClause, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
            return fetch_rows(raw, clause, params)

        return run
    return connection_runner(conn)


def write_successes(run: Runner, q: Queries,
                    done: Sequence[tuple[ClaimedJob, Succeeded]]) -> set[int]:
    """Mark `done` succeeded and insert what they spawn, in one statement; the ids that were
    still ours."""
    # In id order, as the heartbeat locks them: the same rows locked in one order by both
    # statements cannot deadlock (seen once in a 1,000,000-job drain before the sort).
    done = sorted(done, key=lambda d: d[0].id)
    claims = [{"id": job.id, "lease": job.lease, "result": outcome.result}
              for job, outcome in done]
    spawns = [(job, sp) for job, outcome in done for sp in outcome.spawn]
    single = len(claims) == 1
    params = _params(claims, single)
    if not spawns:
        stmt = q.complete_job if single else q.complete_jobs
    else:
        # Chains and map instances take the plain statement; joins and signals the
        # workflow one (counters, rendezvous), which costs more to plan and run.
        simple = all(sp.simple for _, sp in spawns)
        params.update(_params([_successor(job, sp, full=not simple) for job, sp in spawns],
                              False, prefix="next_"))
        params["channel"] = notify_channel(q.schema)
        if simple:
            stmt = q.complete_step if single else q.complete_steps
        else:
            stmt = q.complete_flow if single else q.complete_flows
    return {r[0] for r in run(stmt, params)}


def write_outcome(run: Runner, q: Queries, job: ClaimedJob,
                  outcome: Failed | Retried | Cancelled) -> tuple[str, float] | None:
    """Retry, bury or cancel `job`; (its new status, the delay) or None if it was not ours.
    The status is `pending` for a retry, unless the run was cancelled meanwhile."""
    if isinstance(outcome, Cancelled):
        return end_job(run, q, job, "cancelled", f"CancelRun: {outcome.reason}")
    if isinstance(outcome, Retried):
        delay: float | None = outcome.delay
        error = f"RetryStep: {outcome.reason}"
    else:
        delay, error = outcome.retry_in, outcome.text
    if delay is None:
        return end_job(run, q, job, "dead", error)
    rows = run(q.retry_job, {"id": job.id, "lease": job.lease, "delay": delay, "error": error})
    return (rows[0][0], delay) if rows else None


def end_job(run: Runner, q: Queries, job: ClaimedJob, status: str,
            error: str) -> tuple[str, float] | None:
    """End `job` with `status` (`dead` or `cancelled`) and `error`; (the status it got, 0) or
    None if it was not ours."""
    rows = run(q.end_job, {"id": job.id, "lease": job.lease, "status": status, "error": error})
    return (rows[0][0], 0.0) if rows else None


def complete_in_session(session: StepSession, q: Queries, job: ClaimedJob,
                        outcome: Succeeded) -> bool:
    """Commit the handler's `ctx.session` writes together with its success, or roll them back
    if the claim is no longer ours; True when committed. Anything the commit raises (the
    handler's writes failing at commit) propagates, after the rollback: the caller judges it
    as the attempt's failure."""
    try:
        if not write_successes(session_runner(session), q, [(job, outcome)]):
            session.rollback()
            return False
        commit_step_session(session)
    except BaseException:
        session.rollback()
        raise
    return True


def _successor(job: ClaimedJob, sp: Spawn, *, full: bool) -> dict[str, Any]:
    """The parameters of one spawned row: `flowq.db.sql._SUCCESSOR`'s columns, and with
    `full` those of `_SPAWN` (the signal it waits for, its share in a join)."""
    step = sp.step
    row: dict[str, Any] = {
        "id": job.id, "lease": job.lease, "task": sp.task, "step": step.name,
        "step_index": step.index, "queue": step.queue, "max_attempts": step.retry.attempt_cap,
        "args": sp.args, "map_index": sp.map_index, "delay": step.delay}
    if full:
        row.update(signal=step.wait_for, wait=step.wait_timeout, parents=sp.parents,
                   delta=sp.delta, source=sp.parent, input=sp.input)
    return row


def _params(rows: list[dict[str, Any]], single: bool, prefix: str = "") -> dict[str, Any]:
    """Bind parameters for `rows` in the shape `flowq.db.sql._rows` expects."""
    if single:
        return {prefix + k: v for k, v in rows[0].items()}
    return {prefix + plural(k): [r[k] for r in rows] for k in rows[0]}

