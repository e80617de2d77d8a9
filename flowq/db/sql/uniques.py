"""`flowq.uniques`: enqueue under a key held while the run is active."""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.sql.fragments import (
    ACTIVE,
    CALL,
    CALL_COLUMNS,
    DUE,
    S,
    Statements,
    mark_keyed,
    wake,
)
from flowq.db.sql.runstart import FIND_RUN_BY_KEY, KEY_CLAIMED, claim_key, start_run

__all__ = ["UniqueStatements"]


class UniqueStatements(Statements):
    """The unique enqueues (`flowq.uniques`), for one schema."""

    def _unique_claim(self) -> str:
        """The CTEs every unique enqueue starts with (see `insert_job_unique` for why they
        are race-free): `existing`, the run holding :idempotency_key (NULL: none); `held`,
        the active run holding :unique_key in the statement's snapshot, as (id, run_id,
        created = false); `claimed`, the new run's id when the key was free, or held by a
        run visible here and finished. The visible claim `v` is read by a scalar sub-select
        on the primary key: as an EXISTS the planner hashed the whole table for it (issue 21,
        `flowq bench --scenario indexes`), and the key is unique, so both say the same."""
        active = f"x.run_id = u.run_id AND x.status IN {ACTIVE}"
        return f"""
            WITH existing AS ({FIND_RUN_BY_KEY}),
            held AS (
                SELECT f.id, u.run_id, false AS created
                  FROM {S}.uniques u
                 CROSS JOIN LATERAL (SELECT min(s.id) AS id FROM {S}.steps s
                                      WHERE s.run_id = u.run_id) f
                 WHERE u.key = CAST(:unique_key AS text)
                   AND EXISTS (SELECT 1 FROM {S}.jobs x WHERE {active})
                   AND NOT EXISTS (SELECT 1 FROM existing)
            ), claimed AS (
                INSERT INTO {S}.uniques AS u (key, run_id)
                SELECT CAST(:unique_key AS text), nextval('{S}.run_id_seq')
                 WHERE NOT EXISTS (SELECT 1 FROM existing) AND NOT EXISTS (SELECT 1 FROM held)
                ON CONFLICT (key) DO UPDATE
                   SET run_id = excluded.run_id, created_at = excluded.created_at
                 WHERE (SELECT v.run_id FROM {S}.uniques v WHERE v.key = u.key) = u.run_id
                   AND NOT EXISTS (SELECT 1 FROM {S}.jobs x WHERE {active})
                RETURNING run_id
            )"""

    @cached_property
    def insert_job_unique(self) -> TextClause:
        """Enqueue one run of one row under a unique key held while it is active.

        The unique enqueue (`unique=True` or `unique_key=`): the run of :task active under
        :unique_key (a key of the task and its arguments, or of the caller's key), else a
        new one (notified) that holds the key in `flowq.uniques`. With an :idempotency_key
        too, the run holding that key comes first, whatever its state.

        A duplicate reads, and locks nothing: `held` finds the key's run in the statement's
        snapshot, active there. Otherwise the key is claimed by an upsert on its primary key,
        with a run id drawn first: PostgreSQL arbitrates the conflict on the newest version
        of the row (waiting for a transaction that inserted or updated it until it ends),
        and under READ COMMITTED evaluates the DO UPDATE's WHERE on that version, while its
        sub-selects still read the statement's snapshot. So the WHERE takes the key over only
        if the claim it finds is one this snapshot sees (`v`: the visible version names the
        same run, each run id being claimed once), and then reads that run's rows in a
        snapshot in which they are all there: none active means it has finished (a finished
        row stays finished, unless `flowq runs retry` revives a dead run). A claim committed
        after our snapshot (a concurrent enqueuer we waited for) is not taken over: no row
        comes back, and the caller sends the statement again, whose new snapshot sees that
        run (active: it is returned, with no lock). A claim whose run is gone (its rows
        deleted by hand) is taken over, never stuck. The job is inserted only with the run
        id `claimed` returned, so two enqueuers can never both insert.

        The row lock a claim takes (insert or update) is held until the caller's transaction
        ends: a concurrent enqueue of the same key waits for it, then returns its run, or
        takes the key if it rolled back. Under REPEATABLE READ or SERIALIZABLE, PostgreSQL
        refuses to arbitrate against a row version the transaction's snapshot cannot see:
        the race raises a serialization failure (SQLSTATE 40001; retry the transaction).

        If an :idempotency_key insert loses its race (DO NOTHING), the key claimed here
        names a run without rows, which the next enqueue of the key takes over; the caller
        sends the statement again and gets the run holding the idempotency key.

        A concurrency key marks the queue keyed (`fragments.mark_keyed`), whether or not a
        run is inserted (a mark without a job only sends the queue's claims the limited
        way)."""
        return self.sql(f"""{self._unique_claim()},
            {mark_keyed("CAST(:concurrency_key AS text) IS NOT NULL")},
            {claim_key("claimed c", "true", "c.run_id")},
            inserted AS (
                INSERT INTO {S}.jobs (run_id, {CALL_COLUMNS}, args, run_at, concurrency_key,
                                        idempotency_key)
                SELECT c.run_id, {CALL}, CAST(:args AS jsonb), {DUE},
                       CAST(:concurrency_key AS text), CAST(:idempotency_key AS text)
                  FROM claimed c
                 WHERE {KEY_CLAIMED}
                ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
                RETURNING id, run_id, queue, run_at)
            SELECT id, run_id, true AS created, pg_notify(:channel, {wake("queue", "run_at")})
              FROM inserted
            UNION ALL
            SELECT id, run_id, created, NULL FROM existing
            UNION ALL
            SELECT id, run_id, created, NULL FROM held""")

    @cached_property
    def insert_run_unique(self) -> TextClause:
        """Enqueue a run of several roots under a unique key.

        `insert_run` (a workflow whose run starts with several rows) under a unique key, as
        `insert_job_unique`: the roots are inserted with the run id `claimed` returned."""
        return self.sql(start_run(
            self._unique_claim(), "claimed c CROSS JOIN {roots}", "true", "c.run_id",
            """UNION ALL SELECT id, run_id, created, NULL FROM existing
            UNION ALL SELECT id, run_id, created, NULL FROM held"""))
