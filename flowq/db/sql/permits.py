"""`flowq.permits`: the permits a queue limited by its `concurrency` alone is claimed under.

A worker leases a batch of permits under the queue's row lock (`queues.lock_queue`, which
also reclaims the permits of workers gone from `flowq.workers`, then `lease_permits`), claims
under the ones it holds (`claim_permitted_jobs`) locking only its own row of this table, and
gives back what it does not use (`release_permits`, `release_worker_permits`).

The invariant the lease and the limited claim (`queues.claim_limited_jobs`) keep, under the
queue's lock whenever they grant: the sum over workers of `greatest(permits held, running
jobs)` (`USAGE`) is at most `concurrency`. A claim under permits keeps a worker's running
jobs within what it holds, so the running jobs of a queue never exceed its limit; a worker's
running jobs count even without permits (an older release, a dead worker whose permits were
reclaimed but whose jobs are not reaped yet).
"""

from __future__ import annotations

from functools import cached_property
from typing import Final

from sqlalchemy.sql.elements import TextClause

from flowq.db.schema import PERMITS_CAPABILITY
from flowq.db.sql.fragments import CLAIM_ORDER, S, Statements, registered_without, take

__all__ = ["PERMITTED", "USAGE", "PermitStatements"]

# Whether queue row `q` is claimed under permits: a concurrency limit and nothing else (a rate
# spends a token per claim and a key counts per key: those take the limited claim), and no
# worker of an earlier release registered (`PERMITS_CAPABILITY`: it would count running jobs
# only, not the permits others hold; while one is, every worker takes the locked claim, and
# gives back its permits at its next look at the queues). The one home of that rule: the
# worker's choice of path, the lease and the claim all read it.
PERMITTED: Final = ("(q.concurrency IS NOT NULL AND q.rate_limit IS NULL AND NOT q.keyed "
                    f"AND NOT q.paused AND NOT {registered_without(PERMITS_CAPABILITY)})")

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



class PermitStatements(Statements):
    """The statements of `flowq.permits`, for one schema."""

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

        Claim up to :limit due jobs of :queue for :worker within the permits it holds, less
        its running jobs (found among :ids, which must hold every job of the queue it claimed
        and has not seen end: then the count is exact), and within its share
        (`lease_permits`, counted over the holders in `flowq.workers`), taking no lock but on
        its own `flowq.permits` row (FOR SHARE: a reclaim's DELETE waits for this claim, and
        a claim after the reclaim finds no permits). Nothing if the queue is not `PERMITTED`
        any more or its `concurrency` changed since the lease (`ok` false: the worker re-reads
        the queue, gives the permits back and leases afresh). Returns the claimed rows, each
        with `more` (due jobs remain), `held`, `mine` (which of :ids still run), `running`
        (its running jobs, the claimed ones included), `share` and `ok` last; a single row
        of NULLs and those when none."""
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
              FROM (SELECT 1) one LEFT JOIN claimed c ON true
             ORDER BY {CLAIM_ORDER}""")

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
