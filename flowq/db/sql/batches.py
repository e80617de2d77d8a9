"""Batches (revision 0013): a `session.batch()` block's runs, and its callback, once.

The block draws the batch's id (`select_batch_id`) and, as it closes, writes the batch and
its runs in the caller's transaction (`insert_batch`). The reaper's pass counts the runs
that finished (`advance_batches`) and enqueues the callback of each batch whose counts are
complete (`start_batch_callbacks`), exactly once: the batch's row is locked and stamped
`fired_at` in the statement that inserts the callback.
"""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.sql.fragments import ACTIVE, RUN_STATUS, S, Statements, notify_new

__all__ = ["BatchStatements"]


class BatchStatements(Statements):
    """The statements of batches, for one schema."""

    @cached_property
    def select_batch_id(self) -> TextClause:
        """Draw a new batch id.

        The id of a batch about to open: drawn from `batch_id_seq` (never reused), so the
        block can name its batch before any row of it is written."""
        return self.sql(f"SELECT nextval('{S}.batch_id_seq')")

    @cached_property
    def insert_batch(self) -> TextClause:
        """Write a closing batch: its callback and the runs that joined it.

        Batch :id with its callback (the row an enqueue of it inserts: :task, :step, :queue,
        :priority, :max_attempts, :args) and the runs :run_ids that exist in this
        transaction (a run whose savepoint rolled back is not there, so it is not waited
        for; one that ended in the block, its rows in history, is); returns the number of
        runs it waits for."""
        return self.sql(f"""
            WITH joined AS (
                INSERT INTO {S}.batch_runs (batch_id, run_id)
                SELECT CAST(:id AS bigint), u.run_id
                  FROM unnest(CAST(:run_ids AS bigint[])) AS u(run_id)
                 WHERE EXISTS (SELECT 1 FROM {S}.steps j WHERE j.run_id = u.run_id)
                ON CONFLICT DO NOTHING
                RETURNING run_id
            )
            INSERT INTO {S}.batches (id, task, step, queue, priority, max_attempts, args, runs)
            VALUES (CAST(:id AS bigint), CAST(:task AS text), CAST(:step AS text),
                    CAST(:queue AS text), CAST(:priority AS smallint),
                    CAST(:max_attempts AS int), CAST(:args AS jsonb),
                    (SELECT count(*) FROM joined))
            RETURNING runs""")

    @cached_property
    def advance_batches(self) -> TextClause:
        """Count the batch runs that finished into their batches.

        Up to :limit runs of batches (in batch, run order, skipping rows another pass
        holds) that have no row pending, running or waiting in one snapshot (a successor
        is inserted in the transaction that ends its parent, so such a run creates no
        more): each is taken off `batch_runs` and its end (`fragments.RUN_STATUS`: a run
        with a cancelled step is cancelled, else with a dead one dead) added to its batch's
        counts. A run whose rows were pruned counts as succeeded. Returns the batch ids."""
        return self.sql(f"""
            WITH picked AS (
                SELECT batch_id, run_id FROM {S}.batch_runs
                 ORDER BY batch_id, run_id
                 LIMIT :limit
                 FOR UPDATE SKIP LOCKED
            ), judged AS (
                SELECT p.batch_id, p.run_id, e.status
                  FROM picked p CROSS JOIN LATERAL (
                       SELECT {RUN_STATUS} AS status, bool_or(status IN {ACTIVE}) AS active
                         FROM {S}.steps WHERE run_id = p.run_id) e
                 WHERE e.active IS NOT TRUE
            ), ended AS (
                DELETE FROM {S}.batch_runs r USING judged j
                 WHERE r.batch_id = j.batch_id AND r.run_id = j.run_id
                RETURNING r.batch_id, j.status
            )
            UPDATE {S}.batches b
               SET succeeded = b.succeeded + c.succeeded, dead = b.dead + c.dead,
                   cancelled = b.cancelled + c.cancelled
              FROM (SELECT batch_id,
                           count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
                           count(*) FILTER (WHERE status = 'dead') AS dead,
                           count(*) FILTER (WHERE status = 'cancelled') AS cancelled
                      FROM ended GROUP BY batch_id ORDER BY batch_id) c
             WHERE b.id = c.batch_id
            RETURNING b.id""")

    @cached_property
    def start_batch_callbacks(self) -> TextClause:
        """Enqueue the callback of each batch whose runs have all finished, once.

        Up to :limit batches (only :batch_id, unless NULL) whose counts reached their runs
        and whose callback is still to come: each is locked, stamped `fired_at`, and its
        callback enqueued as a new run (notified) with the batch's id and counts added to
        its arguments. The stamp and the insert are one statement on the locked row, so a
        batch's callback is enqueued exactly once, however many passes race. Returns the
        batch ids with their callback's run id and counts."""
        return self.sql(f"""
            WITH due AS (
                SELECT id FROM {S}.batches
                 WHERE fired_at IS NULL AND succeeded + dead + cancelled >= runs
                   AND (CAST(:batch_id AS bigint) IS NULL OR id = CAST(:batch_id AS bigint))
                 ORDER BY id
                 LIMIT :limit
                 FOR UPDATE SKIP LOCKED
            ), fired AS (
                UPDATE {S}.batches b
                   SET fired_at = now(), callback_run_id = nextval('{S}.run_id_seq')
                  FROM due WHERE b.id = due.id
                RETURNING b.*
            ), inserted AS (
                INSERT INTO {S}.jobs (run_id, task, step, queue, priority, max_attempts, args)
                SELECT callback_run_id, task, step, queue, priority, max_attempts,
                       args || jsonb_build_object('batch_id', id, 'succeeded', succeeded,
                                                  'dead', dead, 'cancelled', cancelled)
                  FROM fired
                RETURNING queue, run_at
            )
            SELECT f.id, f.callback_run_id, f.runs, f.succeeded, f.dead, f.cancelled,
                   {notify_new("inserted")} AS woken
              FROM fired f""")

    @cached_property
    def select_batches(self) -> TextClause:
        """List batches, newest first, with their callback's state.

        Up to :limit batches with an id below :before (NULL: from the newest), each with
        its runs and the counts of those that finished, when its callback was enqueued
        (`fired_at`, NULL: still to come) and that run's status from its rows
        (`fragments.RUN_STATUS`; NULL: not enqueued yet, or its rows were pruned). Served
        by the primary key."""
        return self.sql(f"""
            SELECT b.id, b.task, b.queue, b.runs, b.succeeded, b.dead, b.cancelled,
                   b.created_at, b.fired_at, b.callback_run_id, c.status AS callback_status
              FROM {S}.batches b
              LEFT JOIN LATERAL (
                   SELECT {RUN_STATUS} AS status FROM {S}.steps
                    WHERE run_id = b.callback_run_id
                   HAVING count(*) > 0) c ON true
             WHERE CAST(:before AS bigint) IS NULL OR b.id < CAST(:before AS bigint)
             ORDER BY b.id DESC
             LIMIT :limit""")
