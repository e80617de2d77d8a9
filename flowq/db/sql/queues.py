"""`flowq.queues` and `flowq.permits`: queues as configuration (pauses, limits), the limited
claim, and the permits a concurrency-limited queue is claimed under.

Two ways to claim within a queue's limits, both exact across workers:
- the limited claim (`lock_queue`, then `claim_limited_jobs`): locks the queue's row and counts
  what runs, every claim; for rate limits (a token spent per claim) and per-key limits.
- permits (`PERMITTED`: a `concurrency` and nothing else): a worker leases a batch of permits
  under the queue's row lock (`lock_queue`, then `lease_permits`), then claims under the ones
  it holds (`claim_permitted_jobs`) locking only its own `flowq.permits` row, and hands back
  what it does not use (`release_permits`, `release_worker_permits`).

The invariant both keep, under the queue's lock whenever they grant: the sum over workers of
`greatest(permits held, running jobs)` (`USAGE`) is at most `concurrency`. A claim under
permits keeps a worker's running jobs within what it holds, so the running jobs of a queue
never exceed its limit; a worker's running jobs count even without permits (an older
release, a dead worker whose permits were reclaimed but whose jobs are not reaped yet).
"""

from __future__ import annotations

from functools import cached_property
from typing import Final

from sqlalchemy.sql.elements import TextClause

from flowq.db.sql.fragments import CONTROLLED, S, Statements, take

__all__ = ["PERMITTED", "USAGE", "QueueStatements"]

# Whether queue row `q` is claimed under permits: a concurrency limit and nothing else (a rate
# spends a token per claim and a key counts per key: those take the limited claim). The one
# home of that rule: the worker's choice of path, the lease and the claim all read it.
PERMITTED: Final = ("(q.concurrency IS NOT NULL AND q.rate_limit IS NULL AND NOT q.keyed "
                    "AND NOT q.paused)")

# What each worker uses of queue :queue's concurrency, (worker, n): the permits it holds or
# its running jobs, whichever is more. Running jobs count whoever claimed them (an older
# release holds no permits; a reclaimed worker's jobs run until reaped), permits count
# before they are used. Reads the running rows of the queue and its permits.
USAGE: Final = f"""
    SELECT COALESCE(r.worker, p.worker) AS worker,
           greatest(COALESCE(r.n, 0), COALESCE(p.held, 0)) AS n
      FROM (SELECT locked_by AS worker, count(*) AS n FROM {S}.jobs
             WHERE status = 'running' AND queue = :queue GROUP BY locked_by) r
      FULL JOIN (SELECT worker, held FROM {S}.permits WHERE queue = :queue) p
        ON p.worker = r.worker"""

# Worker :worker's running jobs of queue :queue.
_MINE = f"""SELECT count(*) AS n FROM {S}.jobs
             WHERE status = 'running' AND queue = :queue AND locked_by = :worker"""


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
        at most `concurrency` running (permits held count as running: `USAGE`); at most the rate limit's tokens (refilled at `limit`
        per period, up to `limit`), spending one per claim; and per concurrency key at most
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
              FROM (SELECT 1) one LEFT JOIN claimed c ON true""")

    @cached_property
    def lease_permits(self) -> TextClause:
        """Lease a worker permits of a concurrency-limited queue (after `lock_queue`).

        After `lock_queue` in the same transaction: set :worker's permits of :queue to what it
        runs plus :want more, at most its share (`concurrency` over the workers holding or
        asking for permits of the queue, itself included, rounded up) and at most what the
        others' `USAGE` leaves; its row stays, with none, as a request (it counts in the
        share, so that holders above it give back). None unless the queue is `PERMITTED`
        (`ok` false: the caller re-reads the queue), and nothing changes while no job of it
        is due (an idle queue polled often is not leased and given back each poll).
        Returns (held, ok, due)."""
        return self.sql(f"""
            WITH cfg AS (
                SELECT q.concurrency, {PERMITTED} AS ok FROM {S}.queues q
                 WHERE q.name = :queue
            ), due AS (
                SELECT EXISTS (SELECT 1 FROM {S}.jobs j
                                WHERE j.status = 'pending' AND j.queue = :queue
                                  AND j.run_at <= now()) AS found
            ), others AS (
                SELECT COALESCE(sum(u.n), 0)::bigint AS n FROM ({USAGE}) u
                 WHERE u.worker IS DISTINCT FROM CAST(:worker AS text)
            ), asking AS (
                SELECT count(*) + 1 AS n FROM {S}.permits
                 WHERE queue = :queue AND worker <> CAST(:worker AS text)
            ), granted AS (
                SELECT cfg.concurrency, greatest(0, least(
                           ceil(cfg.concurrency::float8 / (SELECT n FROM asking))::bigint,
                           ({_MINE}) + CAST(:want AS int),
                           cfg.concurrency - (SELECT n FROM others)))::int AS held
                  FROM cfg WHERE cfg.ok AND (SELECT found FROM due)
            ), leased AS (
                INSERT INTO {S}.permits AS p (queue, worker, held, concurrency)
                SELECT :queue, :worker, g.held, g.concurrency FROM granted g
                ON CONFLICT (queue, worker) DO UPDATE
                   SET held = excluded.held, concurrency = excluded.concurrency,
                       leased_at = now()
                RETURNING p.held
            )
            SELECT COALESCE((SELECT held FROM leased), (
                       SELECT held FROM {S}.permits
                        WHERE queue = :queue AND worker = CAST(:worker AS text)), 0) AS held,
                   COALESCE((SELECT ok FROM cfg), false) AS ok,
                   (SELECT found FROM due) AS due""")

    @cached_property
    def claim_permitted_jobs(self) -> TextClause:
        """Claim due jobs of a concurrency-limited queue under the worker's own permits.

        Claim up to :limit due jobs of :queue for :worker within the permits it holds, less its
        running jobs (found among :ids, which must hold every job of the queue it claimed and
        has not seen end: then the count is exact), and within its share (`lease_permits`; counted over the holders in
        `flowq.workers`), taking no lock but on its own
        `flowq.permits` row (FOR SHARE: a reclaim's DELETE waits for this claim, and a claim
        after the reclaim finds no permits). Nothing if the queue is not `PERMITTED` any more
        or its `concurrency` changed since the lease (`ok` false: the worker re-reads the
        queue, gives the permits back and leases afresh). Returns the claimed rows, each
        with `more` (due jobs remain), `held`, `mine` (which of :ids still run), `running`
        (its running jobs, the claimed ones included), `share` and `ok` last; a single row of NULLs and those when none."""
        return self.sql(f"""
            WITH cfg AS (
                SELECT q.concurrency, {PERMITTED} AS ok FROM {S}.queues q
                 WHERE q.name = :queue
            ), permit AS (
                SELECT p.held, p.concurrency FROM {S}.permits p
                 WHERE p.queue = :queue AND p.worker = :worker
                   FOR SHARE
            ), valid AS (
                SELECT permit.held FROM permit, cfg
                 WHERE cfg.ok AND cfg.concurrency = permit.concurrency
            ), mine AS (
                -- Our running jobs of the queue, among the ones we claimed (:ids, every claim
                -- of ours the caller has not seen end): primary-key lookups, where counting
                -- the queue's running rows reads every entry the running index has kept
                -- since the last vacuum (6 ms mid-drain, three times the rest of the claim).
                SELECT j.id FROM {S}.jobs j
                 WHERE j.id = ANY(CAST(:ids AS bigint[])) AND (j.status = 'running') IS TRUE
                   AND j.queue = :queue AND j.locked_by = :worker
            ), share AS (
                -- over the registered holders: once a dead one's entry expired, the others'
                -- share grows, and their next lease reclaims its permits
                SELECT ceil(cfg.concurrency::float8 / greatest(1, (
                           SELECT count(*) FROM {S}.permits p
                            WHERE p.queue = :queue AND EXISTS (
                                  SELECT 1 FROM {S}.workers w WHERE w.name = p.worker))
                       ))::int AS n
                  FROM cfg
            ), allowed AS (
                -- Without valid permits, none: COALESCE first, for least() skips a NULL
                -- (least(NULL, share) is the share) and a LIMIT of NULL is no limit.
                SELECT greatest(0, least(CAST(:limit AS int),
                                         least(COALESCE((SELECT held FROM valid), 0),
                                               (SELECT n FROM share))
                                         - (SELECT count(*) FROM mine))) AS n
            ), picked AS (
                SELECT j.id FROM {S}.jobs j
                 WHERE j.status = 'pending' AND j.queue = :queue AND j.run_at <= now()
                 ORDER BY j.priority, j.run_at, j.id
                 LIMIT (SELECT n FROM allowed)
                 FOR UPDATE SKIP LOCKED
            ), claimed AS (
                {take("picked")}
            )
            SELECT c.*, EXISTS (
                       SELECT 1 FROM {S}.jobs w
                        WHERE w.status = 'pending' AND w.queue = :queue AND w.run_at <= now()
                          AND w.id NOT IN (SELECT id FROM claimed)) AS more,
                   COALESCE((SELECT held FROM valid), 0) AS held,
                   ARRAY(SELECT id FROM mine) AS mine,
                   (SELECT count(*) FROM mine) + (SELECT count(*) FROM claimed) AS running,
                   COALESCE((SELECT n FROM share), 0) AS share,
                   EXISTS (SELECT 1 FROM valid) AS ok
              FROM (SELECT 1) one LEFT JOIN claimed c ON true""")

    @cached_property
    def select_running_ids(self) -> TextClause:
        """List a worker's running jobs of one queue (before its first claim under permits).

        The ids of :worker's running jobs of :queue: what `claim_permitted_jobs` is given
        first, when the worker had claimed the queue another way (a limited claim before its
        declaration changed). Reads the queue's running rows; once per queue and worker."""
        return self.sql(f"""
            SELECT id FROM {S}.jobs
             WHERE status = 'running' AND queue = :queue AND locked_by = :worker""")

    @cached_property
    def release_permits(self) -> TextClause:
        """Give back a worker's permits of a queue beyond what it runs (and :keep).

        Lower :worker's permits of :queue to the greater of :keep and its running jobs (never
        raising them); delete its row when that is none. Returns what it holds after."""
        return self.sql(f"""
            WITH target AS (
                SELECT greatest(CAST(:keep AS int), ({_MINE}))::int AS n
            ), gone AS (
                DELETE FROM {S}.permits
                 WHERE queue = :queue AND worker = :worker AND (SELECT n FROM target) = 0
            ), kept AS (
                UPDATE {S}.permits SET held = least(held, (SELECT n FROM target))
                 WHERE queue = :queue AND worker = :worker AND (SELECT n FROM target) > 0
                RETURNING held
            )
            SELECT COALESCE((SELECT held FROM kept), 0) AS held""")

    @cached_property
    def release_worker_permits(self) -> TextClause:
        """Give back every permit a worker holds beyond its running jobs (at shutdown).

        Lower each of :worker's permits to its running jobs of that queue, deleting the rows
        of queues where it runs none (after a clean stop's release: all of them). Returns
        how many rows were deleted. Reads the worker's running rows."""
        return self.sql(f"""
            WITH mine AS (
                SELECT queue, count(*) AS n FROM {S}.jobs
                 WHERE status = 'running' AND locked_by = :worker GROUP BY queue
            ), gone AS (
                DELETE FROM {S}.permits p
                 WHERE p.worker = :worker
                   AND NOT EXISTS (SELECT 1 FROM mine m WHERE m.queue = p.queue)
                RETURNING p.queue
            ), kept AS (
                UPDATE {S}.permits p SET held = least(p.held, m.n)
                  FROM mine m WHERE p.worker = :worker AND p.queue = m.queue
            )
            SELECT count(*) FROM gone""")

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
        Reads the unfinished and dead rows only (through their partial indexes)."""
        return self.sql(f"""
            WITH counts AS (
                SELECT queue AS name,
                       count(*) FILTER (WHERE status = 'pending' AND run_at <= now())
                           AS pending,
                       count(*) FILTER (WHERE status = 'pending' AND run_at > now())
                           AS scheduled,
                       count(*) FILTER (WHERE status = 'waiting') AS waiting,
                       count(*) FILTER (WHERE status = 'running') AS running,
                       count(*) FILTER (WHERE status = 'dead') AS dead,
                       extract(epoch FROM now() - min(run_at) FILTER (
                           WHERE status = 'pending' AND run_at <= now()))::float8
                           AS oldest_due_s
                  FROM {S}.jobs
                 -- ORs, not IN: each arm is served by its partial index (a BitmapOr), so
                 -- the retained finished rows are never read (an IN list is a seq scan).
                 WHERE (status = 'pending' OR status = 'waiting' OR status = 'running'
                        OR status = 'dead')
                 GROUP BY queue)
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
        age of the oldest due job in seconds (the partial pending and running indexes)."""
        return self.sql(f"""
            SELECT queue,
                   count(*) FILTER (WHERE status = 'pending' AND run_at <= now()) AS due,
                   count(*) FILTER (WHERE status = 'pending' AND run_at > now()) AS scheduled,
                   count(*) FILTER (WHERE status = 'running') AS running,
                   COALESCE(extract(epoch FROM now() - min(run_at) FILTER (
                       WHERE status = 'pending' AND run_at <= now())), 0)::float8 AS oldest_s
              FROM {S}.jobs
             WHERE status IN ('pending', 'running')
             GROUP BY queue ORDER BY queue""")
