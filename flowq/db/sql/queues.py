"""`flowq.queues`: queues as configuration (pauses, limits) and the limited claim.

A queue with a rate limit or keyed jobs is claimed the limited way (`lock_queue`, then
`claim_limited_jobs`): the claim locks the queue's row and counts what runs, every claim. A
queue limited by its `concurrency` alone is claimed under permits instead
(`flowq.db.sql.permits`), leased under the same lock; both count what the other grants
(`permits.USAGE`), so a queue may move between the two paths and its limit holds.
"""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.sql.fragments import CLAIM_ORDER, CONTROLLED, S, Statements, take
from flowq.db.sql.permits import PERMITTED, USAGE

__all__ = ["QueueStatements"]

class QueueStatements(Statements):
    """The statements of `flowq.queues`, for one schema."""

    @cached_property
    def select_controlled_queues(self) -> TextClause:
        """List which of some queues are paused or limited.

        Which of :queues are paused or limited: (name, paused, permits). The worker re-reads
        it every poll interval: a paused queue is skipped, one with `permits` claimed under
        them (`claim_permitted_jobs`), another limited one through `claim_limited_jobs`."""
        return self.sql(f"""
            SELECT c.name, c.paused, {PERMITTED} AS permits
              FROM ({CONTROLLED} AND q.name = ANY(:queues)) c
              JOIN {S}.queues q ON q.name = c.name""")

    @cached_property
    def lock_queue(self) -> TextClause:
        """Lock a queue's row for the transaction (limited claims take turns).

        Lock queue :queue's row for the transaction: limited claims and leases of one queue
        take turns, each counting in a snapshot taken after the previous one committed. Also
        reclaims the queue's permits held by workers no longer in `flowq.workers` (a clean
        stop left, a dead one expired): the DELETE waits for a claim under them that is in
        flight, so the count that follows, in a snapshot of its own, sees what it claimed."""
        return self.sql(f"""
            WITH locked AS (
                SELECT name FROM {S}.queues WHERE name = :queue FOR UPDATE
            ), reclaimed AS (
                DELETE FROM {S}.permits p
                 WHERE p.queue = :queue
                   AND NOT EXISTS (SELECT 1 FROM {S}.workers w WHERE w.name = p.worker)
            )
            SELECT name FROM locked""")

    @cached_property
    def claim_limited_jobs(self) -> TextClause:
        """Claim due jobs of one queue within its pause, concurrency and rate limits.

        Claim up to :limit due jobs of :queue within its limits, after `lock_queue` in the
        same transaction (so that what is counted as running is current): none if paused;
        at most `concurrency` running (permits held count as running: `USAGE`); at most
        the rate limit's tokens (refilled at `limit` per period, up to `limit`), spending
        one per claim; and per concurrency key at most
        its `key_limit` running, keys already at their limit skipped in the scan (up to
        :scan candidates) so that other keys are not held up behind them. Returns the claimed
        rows, each with `more` last (a single row of NULLs and `more` when none was claimed):
        whether due jobs remain that the limits held back."""
        return self.sql(f"""
            WITH cfg AS (
                SELECT paused, concurrency, rate_limit,
                       CASE WHEN rate_limit IS NULL THEN NULL ELSE least(
                           rate_limit::float8,
                           COALESCE(tokens, rate_limit::float8)
                           -- now() is this transaction's start, which may be before
                           -- another claim's refill it waited for: never a negative lag.
                           + extract(epoch FROM greatest(now() - COALESCE(refilled_at, now()),
                                                         interval '0'))
                             * rate_limit / rate_period) END AS tokens
                  FROM {S}.queues WHERE name = :queue
            ), running AS (
                -- running jobs, and the permits held beyond them (they may start any time)
                SELECT COALESCE(sum(u.n), 0)::bigint AS n FROM ({USAGE}) u
            ), busy AS (
                SELECT concurrency_key AS key, count(*) AS n FROM {S}.jobs
                 WHERE status = 'running' AND queue = :queue AND concurrency_key IS NOT NULL
                 GROUP BY concurrency_key
            ), allowed AS (
                SELECT CASE WHEN cfg.paused THEN 0 ELSE greatest(0, least(
                           CAST(:limit AS int),
                           COALESCE(cfg.concurrency - (SELECT n FROM running), :limit),
                           COALESCE(floor(cfg.tokens)::int, :limit))) END AS n
                  FROM cfg
            ), candidates AS (
                SELECT j.id, j.priority, j.run_at, j.concurrency_key, j.key_limit
                  FROM {S}.jobs j
                 WHERE j.status = 'pending' AND j.queue = :queue AND j.run_at <= now()
                   AND (j.concurrency_key IS NULL OR NOT EXISTS (
                        SELECT 1 FROM busy b
                         WHERE b.key = j.concurrency_key AND b.n >= j.key_limit))
                 ORDER BY j.priority, j.run_at, j.id
                 LIMIT :scan
                 FOR UPDATE SKIP LOCKED
            ), ranked AS (
                SELECT c.*, row_number() OVER (PARTITION BY c.concurrency_key
                                               ORDER BY c.priority, c.run_at, c.id) AS k
                  FROM candidates c
            ), picked AS (
                SELECT r.id FROM ranked r LEFT JOIN busy b ON b.key = r.concurrency_key
                 WHERE r.concurrency_key IS NULL OR r.k + COALESCE(b.n, 0) <= r.key_limit
                 ORDER BY r.priority, r.run_at, r.id
                 LIMIT (SELECT n FROM allowed)
            ), claimed AS (
                {take("picked")}
            ), spent AS (
                UPDATE {S}.queues
                   SET tokens = (SELECT tokens FROM cfg) - (SELECT count(*) FROM claimed),
                       -- never back in time, or the next claim would count a span twice
                       refilled_at = greatest(refilled_at, now())
                 WHERE name = :queue AND rate_limit IS NOT NULL
            )
            -- Always one row at least: whether due jobs are left that the limits held back
            -- (the worker then tries again shortly rather than at its next poll), and the
            -- claimed jobs, if any (NULLs when none).
            SELECT c.*, EXISTS (
                       SELECT 1 FROM {S}.jobs w
                        WHERE w.status = 'pending' AND w.queue = :queue AND w.run_at <= now()
                          AND w.id NOT IN (SELECT id FROM claimed)) AS more
              FROM (SELECT 1) one LEFT JOIN claimed c ON true
             ORDER BY {CLAIM_ORDER}""")

    @cached_property
    def declare_queues(self) -> TextClause:
        """Write the limits a worker declares for its queues.

        Write the declared limits of :names (:concurrencies, :rate_limits, :rate_periods;
        NULL: none) as :worker's, keeping each queue's paused state; a changed rate starts
        with a full bucket."""
        return self.sql(f"""
            INSERT INTO {S}.queues (name, concurrency, rate_limit, rate_period, declared_at,
                                    declared_by)
            SELECT d.name, d.concurrency, d.rate_limit, d.rate_period, now(), :worker
              FROM unnest(CAST(:names AS text[]), CAST(:concurrencies AS int[]),
                          CAST(:rate_limits AS int[]), CAST(:rate_periods AS float8[]))
                   AS d(name, concurrency, rate_limit, rate_period)
             ORDER BY d.name
            ON CONFLICT (name) DO UPDATE
               SET concurrency = excluded.concurrency, rate_limit = excluded.rate_limit,
                   rate_period = excluded.rate_period, declared_at = excluded.declared_at,
                   declared_by = excluded.declared_by,
                   tokens = CASE WHEN (queues.rate_limit, queues.rate_period)
                                      IS NOT DISTINCT FROM
                                      (excluded.rate_limit, excluded.rate_period)
                                 THEN queues.tokens END""")

    @cached_property
    def mark_keyed_queues(self) -> TextClause:
        """Mark queues as running tasks with per-key concurrency limits.

        Mark :names as running tasks with per-key limits (claimed through the limited path),
        without touching their limits; and those of :served (a worker's queues) not marked
        yet that hold pending jobs with a key: enqueued by a flowq whose enqueue did not
        mark its queue (an older flowq marked only a task's own queue), they are
        limited from now on. That check reads the pending jobs of an unmarked served queue
        (up to its first keyed one), once per worker start of an app with keyed tasks."""
        return self.sql(f"""
            INSERT INTO {S}.queues (name, keyed)
            SELECT x.n, true FROM (
                SELECT n FROM unnest(CAST(:names AS text[])) AS n
                UNION
                SELECT s FROM unnest(CAST(:served AS text[])) AS s
                 WHERE NOT EXISTS (SELECT 1 FROM {S}.queues k WHERE k.name = s AND k.keyed)
                   AND EXISTS (SELECT 1 FROM {S}.jobs j
                                WHERE j.status = 'pending' AND j.queue = s
                                  AND j.concurrency_key IS NOT NULL)) AS x(n)
             ORDER BY x.n
            ON CONFLICT (name) DO UPDATE SET keyed = true WHERE NOT queues.keyed""")

    @cached_property
    def set_queue_paused(self) -> TextClause:
        """Pause or resume a queue.

        Pause or resume queue :name (:paused); whether that changed anything."""
        return self.sql(f"""
            WITH before AS (SELECT paused FROM {S}.queues WHERE name = :name FOR UPDATE),
            changed AS (
                INSERT INTO {S}.queues (name, paused) VALUES (:name, :paused)
                ON CONFLICT (name) DO UPDATE SET paused = excluded.paused)
            SELECT COALESCE((SELECT paused FROM before), false)
                   IS DISTINCT FROM CAST(:paused AS boolean)""")

    @cached_property
    def list_queues(self) -> TextClause:
        """List every queue with its jobs by state, limits and pause.

        Every queue with jobs not yet finished (or dead) or a row in `flowq.queues`: its
        jobs by state, the age of its oldest due job, its limits, whether it is paused.
        Reads the unfinished rows only (through their partial indexes), and counts the dead
        ones from `jobs_dead_idx` alone: they are retained for 14 days, and reading each one
        read 100,000 pages at issue 21's 10,000,000 rows (an index-only scan reads ~170)."""
        return self.sql(f"""
            WITH live AS (
                SELECT queue AS name,
                       count(*) FILTER (WHERE status = 'pending' AND run_at <= now())
                           AS pending,
                       count(*) FILTER (WHERE status = 'pending' AND run_at > now())
                           AS scheduled,
                       count(*) FILTER (WHERE status = 'waiting') AS waiting,
                       count(*) FILTER (WHERE status = 'running') AS running,
                       extract(epoch FROM now() - min(run_at) FILTER (
                           WHERE status = 'pending' AND run_at <= now()))::float8
                           AS oldest_due_s
                  FROM {S}.jobs
                 -- ORs, not IN: each arm is served by its partial index (a BitmapOr), so
                 -- the retained finished rows are never read (an IN list is a seq scan).
                 WHERE (status = 'pending' OR status = 'waiting' OR status = 'running')
                 GROUP BY queue),
            dead AS (
                SELECT queue AS name, count(*) AS dead FROM {S}.steps
                 WHERE status = 'dead' GROUP BY queue),
            counts AS (
                SELECT COALESCE(l.name, d.name) AS name, l.pending, l.scheduled, l.waiting,
                       l.running, d.dead, l.oldest_due_s
                  FROM live l FULL JOIN dead d ON d.name = l.name)
            SELECT COALESCE(c.name, q.name) AS name, COALESCE(c.pending, 0) AS pending,
                   COALESCE(c.scheduled, 0) AS scheduled, COALESCE(c.waiting, 0) AS waiting,
                   COALESCE(c.running, 0) AS running, COALESCE(c.dead, 0) AS dead,
                   c.oldest_due_s, q.concurrency, q.rate_limit,
                   q.rate_period AS rate_period_s, COALESCE(q.paused, false) AS paused
              FROM counts c FULL JOIN {S}.queues q ON q.name = c.name
             ORDER BY 1""")

    @cached_property
    def select_queue_metrics(self) -> TextClause:
        """Count due, scheduled and running jobs per queue (metrics).

        Per queue with pending or running jobs: due, scheduled and running jobs, and the
        age of the oldest due job in seconds (the partial pending and running indexes: the
        test is an OR, whose arms a BitmapOr serves one index each, where `status IN (...)`
        matches neither index's predicate and read all 10,000,000 rows of issue 21's table)."""
        return self.sql(f"""
            SELECT queue,
                   count(*) FILTER (WHERE status = 'pending' AND run_at <= now()) AS due,
                   count(*) FILTER (WHERE status = 'pending' AND run_at > now()) AS scheduled,
                   count(*) FILTER (WHERE status = 'running') AS running,
                   COALESCE(extract(epoch FROM now() - min(run_at) FILTER (
                       WHERE status = 'pending' AND run_at <= now())), 0)::float8 AS oldest_s
              FROM {S}.jobs
             WHERE (status = 'pending' OR status = 'running')
             GROUP BY queue ORDER BY queue""")
