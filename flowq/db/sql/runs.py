"""Runs (the rows of one run_id): inspection, cancel, retry, filters and bulk redrive."""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.sql.fragments import (
    CANCELLABLE,
    RUN_STATUS,
    S,
    Statements,
    cancel,
    copy_rows,
    notify_ended_row,
)

__all__ = ["RunStatements"]

# The columns of a run's rows that `flowq.ops.runinfo` reads.
# A run's rows as `flowq.ops.runinfo` reads them (of `{S}.steps j`: live and finished), with the pipeline version
# its definition's fingerprint was recorded under (`flowq.definitions`, a primary key lookup;
# NULL when none was).
RUN_JOB_COLUMNS = f"""id, run_id, task, step, step_index, queue, status, priority, attempts,
                   max_attempts, args, result, last_error, idempotency_key, cancel_requested,
                   run_at, locked_at, heartbeat_at, locked_by, created_at, finished_at,
                   map_index, started_at, attempt_log, progress, forked_from, deadline,
                   fingerprint,
                   (SELECT d.version FROM {S}.definitions d
                     WHERE d.fingerprint = j.fingerprint) AS version"""


def _lock_rows(where: str) -> str:
    """Lock the rows of runs matching `where`: finished ones (`job_history`), then live ones
    (`jobs`), each in id order, returning their ids. History first: a lock taken again until
    the set stops growing (`flowq.ops.runs`) finds in `jobs` the rows a concurrent retry moved
    out of history, and with live rows locked first two bulk retries deadlocked (one held
    those moved rows and waited for the history rows the other held; seen in
    test_dashboard_adversarial). A row moves from history to `jobs` only under its history
    lock, so whoever holds a run's history rows takes its live ones last."""
    return f"""
            WITH done AS (SELECT id FROM {S}.job_history WHERE {where} ORDER BY id FOR UPDATE),
                 live AS (SELECT id FROM {S}.jobs WHERE {where} ORDER BY id FOR UPDATE)
            SELECT id FROM done UNION ALL SELECT id FROM live"""


def _retried(signal: str) -> dict[str, str]:
    """A retried dead step's columns: pending again (or waiting again until its timeout, for
    a step whose signal never came: `signal`, the alias of its `flowq.signals` row, NULL
    otherwise), with a fresh attempt budget; `last_error` stays until the next attempt."""
    return {"status": f"CASE WHEN {signal}.run_id IS NULL THEN 'pending' ELSE 'waiting' END",
            "attempts": "0", "finished_at": "NULL",
            "run_at": f"now() + make_interval(secs => COALESCE({signal}.timeout_s, 0))"}


def _retry_dead(where: str) -> str:
    """CTEs ending in `retried` (id, run_id, queue, status): the dead steps of the runs
    `where` selects (on alias `d`) sent back, moved from `job_history` to `jobs` (and, for
    a dead row still in `jobs` from before revision 0018, updated in place)."""
    sets = ", ".join(f"{name} = {value}" for name, value in _retried("x").items())
    return f"""back AS (
                DELETE FROM {S}.job_history d WHERE {where} AND d.status = 'dead'
                RETURNING d.*
            ), moved AS (
                {copy_rows("jobs", f"back g LEFT JOIN {S}.signals x ON x.run_id = g.run_id "
                                   "AND x.step = g.step AND x.sent_at IS NULL", _retried("x"))}
                RETURNING id, run_id, queue, status
            ), kept AS (
                UPDATE {S}.jobs j SET {sets}
                  FROM {S}.jobs d
                  LEFT JOIN {S}.signals x
                         ON x.run_id = d.run_id AND x.step = d.step AND x.sent_at IS NULL
                 WHERE {where} AND d.status = 'dead' AND j.id = d.id
                RETURNING j.id, j.run_id, j.queue, j.status
            ), retried AS (SELECT * FROM moved UNION ALL SELECT * FROM kept)"""


class RunStatements(Statements):
    """The statements on the rows of a run, for one schema."""

    @cached_property
    def select_run_jobs(self) -> TextClause:
        """Read every row of a run, in step order.

        Every row of run :run_id, in step order, with the pipeline version its definition's
        fingerprint was recorded under (`flowq.definitions`, a primary key lookup; NULL when
        none was). One statement, so one snapshot: a step's success and its successor's
        insert (one transaction) are seen together or not at all."""
        return self.sql(f"""
            SELECT {RUN_JOB_COLUMNS} FROM {S}.steps j WHERE run_id = :run_id
             ORDER BY step_index, map_index NULLS FIRST, id""")

    @cached_property
    def select_runs_jobs(self) -> TextClause:
        """Read every row of several runs, by run and in step order.

        `select_run_jobs` for the runs :run_ids (a parent reading its children), in one
        statement, so in one snapshot."""
        return self.sql(f"""
            SELECT {RUN_JOB_COLUMNS} FROM {S}.steps j
             WHERE run_id = ANY(CAST(:run_ids AS bigint[]))
             ORDER BY run_id, step_index, map_index NULLS FIRST, id""")

    @cached_property
    def mark_forked_run(self) -> TextClause:
        """Link a new run to the run it was forked from.

        Set `forked_from` to :source on the rows run :run_id has so far (its first rows, in
        the transaction that enqueued them): `flowq runs show` reads it from there."""
        return self.sql(f"""
            UPDATE {S}.jobs SET forked_from = CAST(:source AS bigint)
             WHERE run_id = :run_id""")

    @cached_property
    def lock_run_jobs(self) -> TextClause:
        """Lock every row of a run.

        Lock every row of run :run_id (waiting for an in-flight completion); returns their
        ids. Repeat until the set stops growing: a completion that committed while we waited
        may have inserted a successor this statement's snapshot could not see, or moved a
        row it waited for to history. Finished rows first, then live ones, always in that
        order (`_lock_rows`)."""
        return self.sql(_lock_rows("run_id = :run_id"))

    @cached_property
    def cancel_run_jobs(self) -> TextClause:
        """Cancel runs: end their waiting rows, flag their running ones.

        Cancel the runs :run_ids (a run, or its descendants; rows locked first): pending
        and waiting steps end `cancelled` with :error, running ones get `cancel_requested`
        (they finish, but create no successor and count towards no join)."""
        return self.sql(f"""
            UPDATE {S}.jobs j SET {cancel("CAST(:error AS text)")}
             WHERE run_id = ANY(CAST(:run_ids AS bigint[])) AND {CANCELLABLE}
            RETURNING id, run_id, status,
                      {notify_ended_row("j.status = 'cancelled'")} AS ended""")

    @cached_property
    def retry_dead_jobs(self) -> TextClause:
        """Send a run's dead steps back with a fresh attempt budget.

        Send every dead step of run :run_id back with a fresh attempt budget, and wake the
        workers of their queues (at commit): due now, or, for a step whose signal never
        came, `waiting` again for its timeout. `last_error` is kept until the next attempt
        ends. Returns the ids."""
        return self.sql(f"""
            WITH {_retry_dead("d.run_id = :run_id")}
            SELECT r.id, pg_notify(:channel, r.queue) FROM retried r""")

    def _runs_page(self, *, newest_first: bool, status: str) -> TextClause:
        """Up to :limit runs matching the filters, one row each, in run id order from a
        cursor (exclusive; NULL: from the start): newest first below :before, or oldest
        first above :after. Filters (NULL: any): derived status `status` (an SQL expression),
        :task, :fingerprints (the definitions its run started under: a version), :queue (any
        of its steps on it), created (its first row) in [:since, :until).

        The plan walks the run ids of the run id indexes of `jobs` and `job_history` in order (merged) from the cursor, keeping
        the rows that could make their run match (its task; created since :since; a row
        with the status asked for, which every run of that status has, else a row on
        :queue, else one created before :until), computes each kept run's status from its rows (an index lookup per run)
        (with :since, only the days of `job_history` that retired rows since then: a row
        retires after it was created, and the merge waits for a first row from every day's
        walk, so a day with none walked its whole index: 2.3 s at 10,000,000 rows)
        and stops at :limit matches. So a page costs about the index entries walked past,
        plus one lookup per candidate run, not the whole table: a page of recent runs takes
        milliseconds, while filters that match nothing walk every row below the cursor
        (0.1-0.2 s per million rows, measured; several seconds per million runs only when
        every run must be looked up: --until together with --status or --queue, matching
        none of the newest runs)."""
        order, param, op = ("DESC", "before", "<") if newest_first else ("ASC", "after", ">")
        return self.sql(f"""
            SELECT r.* FROM (
                SELECT j.run_id FROM {S}.steps j
                 WHERE (CAST(:{param} AS bigint) IS NULL
                        OR j.run_id {op} CAST(:{param} AS bigint))
                   AND (CAST(:task AS text) IS NULL OR j.task = CAST(:task AS text))
                   AND (CAST(:fingerprints AS text[]) IS NULL
                        OR j.fingerprint = ANY(CAST(:fingerprints AS text[])))
                   AND (CAST(:since AS timestamptz) IS NULL
                        OR j.created_at >= CAST(:since AS timestamptz))
                   AND (CAST(:since AS timestamptz) IS NULL OR j.retired_at IS NULL
                        OR j.retired_at >= CAST(:since AS timestamptz))
                   AND (CAST({status} AS text) IS NULL
                        OR j.status = CAST({status} AS text)
                        OR (CAST({status} AS text) = 'cancelled' AND j.cancel_requested))
                   AND (CAST(:queue AS text) IS NULL
                        OR (CAST({status} AS text) IS NULL AND j.queue = CAST(:queue AS text))
                        OR (CAST({status} AS text) IS NOT NULL AND EXISTS (
                            SELECT 1 FROM {S}.steps o
                             WHERE o.run_id = j.run_id AND o.queue = CAST(:queue AS text))))
                   AND (CAST(:until AS timestamptz) IS NULL OR CAST({status} AS text) IS NOT NULL
                        OR CAST(:queue AS text) IS NOT NULL
                        OR j.created_at < CAST(:until AS timestamptz))
                 GROUP BY j.run_id ORDER BY j.run_id {order}
            ) c CROSS JOIN LATERAL (
                SELECT c.run_id,
                       (array_agg(task ORDER BY step_index DESC, id DESC))[1] AS task,
                       (array_agg(step ORDER BY step_index DESC, id DESC))[1] AS step,
                       max(step_index) AS step_index,
                       {RUN_STATUS} AS status,
                       (array_agg(idempotency_key ORDER BY step_index, id))[1]
                           AS idempotency_key,
                       min(created_at) AS created_at,
                       (array_agg(finished_at ORDER BY step_index DESC, id DESC))[1]
                           AS finished_at
                  FROM {S}.steps a WHERE a.run_id = c.run_id
            ) r
             WHERE (CAST({status} AS text) IS NULL OR r.status = CAST({status} AS text))
               AND (CAST(:since AS timestamptz) IS NULL
                    OR r.created_at >= CAST(:since AS timestamptz))
               AND (CAST(:until AS timestamptz) IS NULL
                    OR r.created_at < CAST(:until AS timestamptz))
             ORDER BY c.run_id {order}
             LIMIT :limit""")

    @cached_property
    def list_runs(self) -> TextClause:
        """List a page of runs, newest first, with filters.

        The newest :limit runs below run id :before (NULL: the newest), optionally only
        those whose derived status is :status, of :task, with a step on :queue, created in
        [:since, :until); one row each, with the status `flowq.ops.runs.run_status` derives
        from its steps (see `_runs_page` for the cost)."""
        return self._runs_page(newest_first=True, status=":status")

    @cached_property
    def select_dead_runs(self) -> TextClause:
        """List a page of dead runs, oldest first, with filters (bulk redrive).

        The oldest :limit dead runs above run id :after (NULL: the oldest), filtered like
        `list_runs`: a batch of a bulk redrive, read without locks (`lock_runs_jobs` and
        `retry_dead_runs` then check each one again)."""
        return self._runs_page(newest_first=False, status="'dead'")

    @cached_property
    def lock_runs_jobs(self) -> TextClause:
        """Lock every row of several runs, in id order.

        `lock_run_jobs` for the runs :run_ids: lock every row, in id order (the order
        every run lock takes, so two redrives never deadlock), returning the ids; repeat
        until the set stops growing."""
        return self.sql(_lock_rows("run_id = ANY(CAST(:run_ids AS bigint[]))"))

    @cached_property
    def retry_dead_runs(self) -> TextClause:
        """Send the dead steps of several still-dead runs back (bulk redrive).

        `retry_dead_jobs` for those of the runs :run_ids (locked first) that are still
        dead: the others changed since they were picked and are left alone. Returns the
        run ids retried (one row each), and wakes the queues of the steps due now."""
        return self.sql(f"""
            WITH dead AS (
                SELECT run_id FROM {S}.steps
                 WHERE run_id = ANY(CAST(:run_ids AS bigint[]))
                 GROUP BY run_id
                HAVING {RUN_STATUS} = 'dead'
            ), {_retry_dead("d.run_id IN (SELECT run_id FROM dead)")}
            SELECT DISTINCT r.run_id,
                   (SELECT count(pg_notify(:channel, w.queue))
                      FROM (SELECT DISTINCT queue FROM retried WHERE status = 'pending') w)
              FROM retried r""")
