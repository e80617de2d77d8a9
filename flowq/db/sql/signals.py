"""`flowq.signals`: sending a signal, and the steps waiting for one."""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.sql.fragments import S, Statements

__all__ = ["SignalStatements"]


class SignalStatements(Statements):
    """The statements of `flowq.signals`, for one schema."""

    @cached_property
    def find_signal(self) -> TextClause:
        """Read the payload of a signal sent to a run.

        The payload of signal :name of run :run_id, if it was sent: (payload,) or no row."""
        return self.sql(f"""
            SELECT payload FROM {S}.signals
             WHERE run_id = :run_id AND name = :name AND sent_at IS NOT NULL""")

    @cached_property
    def expire_waits(self) -> TextClause:
        """Make steps whose signal did not arrive in time runnable.

        Make up to :limit steps whose signal did not arrive by their timeout (`run_at`)
        runnable: they run without the payload, fail with SignalTimeout, and their retry
        policy decides. Returns (id, queue) and wakes their queues."""
        return self.sql(f"""
            WITH expired AS (
                SELECT id FROM {S}.jobs
                 WHERE status = 'waiting' AND run_at <= now()
                 ORDER BY run_at LIMIT :limit
                 FOR UPDATE SKIP LOCKED
            ), woken AS (
                UPDATE {S}.jobs j SET status = 'pending'
                  FROM expired e WHERE j.id = e.id AND (j.status = 'waiting') IS TRUE
                RETURNING j.id, j.queue)
            SELECT w.id, w.queue, pg_notify(:channel, w.queue) FROM woken w""")

    @cached_property
    def select_run_state(self) -> TextClause:
        """Read what a signal checks of its run before it is written.

        Run :run_id's task, its number of rows and of active (unfinished) rows, and whether
        it was cancelled: what a signal checks before it is written."""
        return self.sql(f"""
            SELECT min(task), count(*),
                   count(*) FILTER (WHERE status IN ('pending', 'running', 'waiting')),
                   bool_or(status = 'cancelled' OR cancel_requested)
              FROM {S}.steps WHERE run_id = :run_id""")

    @cached_property
    def send_signal(self) -> TextClause:
        """Record a signal for a run, once.

        Record signal :name of run :run_id with :payload, unless it was sent already (then
        no row). Returns the step waiting for it, if that step was reached. The upsert on
        the primary key meets a completion creating the step: whichever writes second
        waits for the first and sees its row."""
        return self.sql(f"""
            INSERT INTO {S}.signals (run_id, name, payload, sent_at)
            VALUES (:run_id, :name, CAST(:payload AS jsonb), now())
            ON CONFLICT (run_id, name) DO UPDATE
               SET payload = excluded.payload, sent_at = excluded.sent_at
             WHERE signals.sent_at IS NULL
            RETURNING step""")

    @cached_property
    def compare_signal(self) -> TextClause:
        """Tell whether an already sent signal has this payload.

        Whether the signal already sent as :name for :run_id has this very :payload."""
        return self.sql(f"""
            SELECT payload = CAST(:payload AS jsonb) FROM {S}.signals
             WHERE run_id = :run_id AND name = :name""")

    @cached_property
    def wake_signalled_step(self) -> TextClause:
        """Hand a signal's payload to the step waiting for it.

        Hand the payload to step :step of run :run_id, which waits for signal :name: it
        becomes runnable now with the payload as its keyword argument :name. A new
        statement, so that under READ COMMITTED it sees a step created by a completion that
        `send_signal` waited for."""
        return self.sql(f"""
            WITH woken AS (
                UPDATE {S}.jobs
                   SET status = 'pending', run_at = least(run_at, now()),
                       args = args || jsonb_build_object(CAST(:name AS text),
                                                         CAST(:payload AS jsonb))
                 WHERE run_id = :run_id AND step = :step AND map_index IS NULL
                   AND status IN ('waiting', 'pending')
                RETURNING id, queue)
            SELECT w.id, pg_notify(:channel, w.queue) FROM woken w""")
