"""The claim and every write after it: the (id, lease) fence on `flowq.jobs`.

A success is written by the statements of `flowq.db.sql.completions`; the claim, the
heartbeat, a retry, an end, a release and the reaper's requeue are here."""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.schema import LIVENESS_CAPABILITY
from flowq.db.sql.children import wake_parents
from flowq.db.sql.fragments import (
    CLAIM_KEY,
    CLAIM_ORDER,
    CONTROLLED,
    FENCE,
    UNLOCK,
    S,
    Statements,
    fence,
    log_attempt,
    notify_ended_row,
    registered_without,
    rows,
    stale,
    take,
)

__all__ = ["ClaimStatements"]

# The error of an attempt whose worker stopped heartbeating (the reaper's): its last beat
# is the later of the job's own and its worker's entry's (`reap_jobs`' `last_beat`).
LOST = """format('WorkerLost: worker %s stopped heartbeating during attempt %s of %s '
                              '(last heartbeat %s)', j.locked_by, j.attempts, j.max_attempts,
                              stale.last_beat)"""

# The plain claim's test that the queue is neither paused nor limited (`claim_jobs`).
UNCONTROLLED = f" AND NOT EXISTS ({CONTROLLED} AND q.name = :queue)"


class ClaimStatements(Statements):
    """The claim and the fenced writes after it, for one schema."""

    def _claim(self, only: str = "") -> TextClause:
        return self.sql(f"""
            WITH picked AS (
                SELECT id FROM {S}.jobs
                WHERE status = 'pending' AND queue = :queue AND run_at <= now(){only}
                ORDER BY {CLAIM_ORDER}
                LIMIT :limit
                FOR UPDATE SKIP LOCKED
            ), claimed AS ({take("picked")})
            SELECT * FROM claimed ORDER BY {CLAIM_ORDER}""")

    @cached_property
    def claim_jobs(self) -> TextClause:
        """Claim due jobs of one queue that is neither paused nor limited.

        Claim up to :limit due jobs of :queue for :worker, each under a new lease. A CTE, so
        that the LIMIT binds the locking subquery and the UPDATE can never touch more rows
        than were picked; SKIP LOCKED lets concurrent workers pick disjoint rows without
        waiting on each other. Claims nothing from a queue that is paused or limited
        (`flowq.queues`): those are claimed with `claim_limited_jobs` (one primary key lookup
        tells, so a worker that has not yet seen a new limit cannot break it)."""
        return self._claim(UNCONTROLLED)

    @cached_property
    def claim_jobs_after(self) -> TextClause:
        """Claim due jobs of one queue that sort after a cursor, or are more urgent than it.

        `claim_jobs` that starts its index scan after the key (:priority, :run_at, :id) of
        the last row this worker claimed of :queue: a row comparison the pending index
        serves as its start, so the claim skips the entries it already consumed, which an
        open snapshot elsewhere keeps vacuum from removing (each would be fetched from the
        heap, the claim's cost growing with the jobs claimed since that snapshot). Jobs of a
        more urgent priority than the cursor's come first, from their own range of the index
        (one more urgent than the cursor's is never passed over); rows of the cursor's
        priority that sort
        before it (a run_at in the past, a late commit) are taken by `claim_jobs` from the
        head, which the claimer still runs regularly."""
        def branch(where: str) -> str:
            return f"""SELECT id FROM (
                SELECT id FROM {S}.jobs
                 WHERE status = 'pending' AND queue = :queue AND run_at <= now()
                   AND {where}{UNCONTROLLED}
                 ORDER BY {CLAIM_ORDER}
                 LIMIT :limit
                   FOR UPDATE SKIP LOCKED) AS b"""
        after = ("(priority, run_at, id) > (CAST(:priority AS smallint), "
                 "CAST(:run_at AS timestamptz), CAST(:id AS bigint))")
        return self.sql(f"""
            WITH picked AS (
                {branch("priority < CAST(:priority AS smallint)")}
                UNION ALL
                {branch(after)}
                LIMIT :limit
            ), claimed AS ({take("picked")})
            SELECT * FROM claimed ORDER BY {CLAIM_ORDER}""")

    @cached_property
    def claim_any_jobs(self) -> TextClause:
        """Claim due jobs of one queue, ignoring pauses and limits (the test kit).

        `claim_jobs` without regard to pauses and limits: the test kit's `drain`, which runs
        one job at a time in the test's own transaction."""
        return self._claim()

    @cached_property
    def claim_run_jobs(self) -> TextClause:
        """Claim due jobs of one queue belonging to given runs (the test kit).

        `claim_jobs` restricted to the runs :run_ids (`flowq.testing.drain(runs=...)`);
        the same statement, written once."""
        return self._claim(" AND run_id = ANY(CAST(:run_ids AS bigint[]))")

    @cached_property
    def heartbeat_jobs(self) -> TextClause:
        """Beat a worker's registry entry and read (or refresh) its claims, fenced.

        Beat worker :worker's registry entry, recording the leases of its claims (:ids,
        :leases), and return the claims still ours, with whether their run was cancelled meanwhile (the running handler is told:
        cooperative cancellation). The claims are only read while the entry is there and
        every registered worker's reaper reads entries (`LIVENESS_CAPABILITY`); else (an
        entry expired after a stall, an older release's reaper) each claim's own
        `heartbeat_at` is refreshed too, as before. :progress: the latest `ctx.progress`
        of claims that reported one since the last beat (NULL: none new), written to those
        rows only, stamped with the database's now()."""
        claims = rows("c", (*CLAIM_KEY, ("progress", "jsonb")), single=False)
        return self.sql(f"""
            WITH me AS (
                -- The entry vouches for these leases only: a claim this worker does not
                -- know it holds (its claim's result or its completion lost) is reaped.
                UPDATE {S}.workers SET heartbeat_at = now(), leases = CAST(:leases AS bigint[])
                 WHERE name = :worker
                RETURNING name
            ), mode AS (
                SELECT NOT EXISTS (SELECT 1 FROM me)
                       OR {registered_without(LIVENESS_CAPABILITY)} AS per_job
            ), written AS (
                -- heartbeat_at is indexed (jobs_running_idx): left as it is, a progress
                -- write can be a HOT update.
                UPDATE {S}.jobs j
                   SET heartbeat_at = CASE WHEN m.per_job THEN now() ELSE j.heartbeat_at END,
                       progress = CASE WHEN c.progress IS NULL THEN j.progress
                                       ELSE c.progress || jsonb_build_object('at', now()) END
                  FROM {claims} CROSS JOIN mode m
                 WHERE {fence(False)} AND (m.per_job OR c.progress IS NOT NULL)
                RETURNING j.id, j.cancel_requested
            )
            SELECT id, cancel_requested FROM written
            UNION ALL
            SELECT j.id, j.cancel_requested
              FROM {claims} JOIN {S}.jobs j ON {fence(False)}
             WHERE c.progress IS NULL AND NOT (SELECT per_job FROM mode)""")

    @cached_property
    def retry_job(self) -> TextClause:
        """Send a failed attempt back to pending after a delay, fenced.

        Send a failed attempt back to pending after :delay seconds (or end it `cancelled` if
        its run was cancelled meanwhile); returns the new status and run_at, or nothing if
        the claim is no longer ours. The failed attempt goes into `attempt_log`
        (`fragments.log_attempt`), in the same fenced write."""
        return self.sql(f"""
            UPDATE {S}.jobs j
               SET status = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'pending' END,
                   finished_at = CASE WHEN cancel_requested THEN now() END,
                   run_at = now() + make_interval(secs => :delay),
                   last_error = :error, {log_attempt("CAST(:error AS text)")}, {UNLOCK}
              FROM {rows("c", CLAIM_KEY, single=True)}
             WHERE {FENCE}
            RETURNING j.status, j.run_at,
                      {notify_ended_row("j.status = 'cancelled'")} AS ended""")

    @cached_property
    def end_job(self) -> TextClause:
        """End a claim as dead or cancelled, fenced.

        End a claim as :status (`dead` or `cancelled`) with :error, the attempt appended
        to `attempt_log` (`fragments.log_attempt`); a parent waiting on its run is woken
        (`wake_parents`, :channel), to see it failed."""
        return self.sql(f"""
            WITH done AS (
                UPDATE {S}.jobs j
                   SET status = :status, finished_at = now(), last_error = :error,
                       {log_attempt("CAST(:error AS text)")}, {UNLOCK}
                  FROM {rows("c", CLAIM_KEY, single=True)}
                 WHERE {FENCE}
                RETURNING j.status, j.run_id, {notify_ended_row("true")} AS ended),
                 {wake_parents("done")}
            SELECT status, ended FROM done""")

    @cached_property
    def release_jobs(self) -> TextClause:
        """Hand a batch of claims back without burning their attempt, fenced.

        Hand claims back without burning the attempt: unfinished ones at shutdown, and jobs
        claimed ahead that did not start (or end them `cancelled` when their run was
        cancelled meanwhile). Giving the attempt back is safe: the fence is the lease, which
        the next claim renews. Notifies :channel with each queue, so other workers take them
        at once (identical notifications of one transaction are delivered once)."""
        return self.sql(f"""
            UPDATE {S}.jobs j
               SET status = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'pending' END,
                   finished_at = CASE WHEN j.cancel_requested THEN now() END,
                   attempts = greatest(j.attempts - 1, 0), run_at = now(), {UNLOCK}
              FROM {rows("c", CLAIM_KEY, single=False)}
             WHERE {fence(False)}
            RETURNING j.id, pg_notify(:channel, j.queue),
                      {notify_ended_row("j.status = 'cancelled'")} AS ended""")

    @cached_property
    def reap_jobs(self) -> TextClause:
        """Requeue, bury or cancel running jobs whose worker stopped heartbeating.

        Requeue (or bury, once attempts are spent) running jobs whose heartbeat is older than
        :stale seconds, unless their worker's registry entry (named by `locked_by`) is
        younger and lists their lease: their worker died, or does not know it holds them. The crashed attempt counts, and is appended to
        `attempt_log` as lost. The scan reads the running index from the oldest beat: jobs
        of live workers that beat their entry only are read and skipped at every pass."""
        entry = (f"SELECT w.heartbeat_at FROM {S}.workers w "
                 "WHERE w.name = j.locked_by AND j.lease = ANY(w.leases)")
        return self.sql(f"""
            WITH stale AS (
                SELECT j.id, GREATEST(j.heartbeat_at, ({entry})) AS last_beat
                  FROM {S}.jobs j
                 WHERE j.status = 'running' AND {stale("j.heartbeat_at")}
                   AND NOT EXISTS ({entry} AND NOT {stale("w.heartbeat_at")})
                 ORDER BY j.heartbeat_at
                 LIMIT :limit
                   FOR UPDATE OF j SKIP LOCKED
            ), reaped AS (
                UPDATE {S}.jobs j
                   SET status = CASE WHEN j.cancel_requested THEN 'cancelled'
                                     WHEN j.attempts >= j.max_attempts THEN 'dead'
                                     ELSE 'pending' END,
                       finished_at = CASE WHEN j.cancel_requested OR j.attempts >= j.max_attempts
                                          THEN now() END,
                       run_at = now(),
                       last_error = """ + LOST + """,
                       """ + log_attempt(LOST) + """, """ + UNLOCK + """
                  FROM stale WHERE j.id = stale.id
                RETURNING j.id, j.run_id, j.task, j.step, j.queue, j.status, j.attempts)
            SELECT r.*, pg_notify(:channel, r.queue),
                   """ + notify_ended_row("r.status IN ('dead', 'cancelled')", "r.run_id") + """
                   AS ended
              FROM reaped r""")
