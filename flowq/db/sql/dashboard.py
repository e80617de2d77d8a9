"""The dashboard's reads of `flowq.jobs`: activity over time, running jobs, argument search.

Each is bounded in rows (`:limit`) and, but for the argument search, served by an index, so
a page costs about the rows it reads however many finished rows are retained; the dashboard
also sends them under a statement timeout (`flowq.dashboard.reads`). None writes: the charts are computed from the
rows the workers write anyway (`started_at`, `finished_at`, `run_at`), not from a rollup.
"""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.sql.fragments import S, Statements

__all__ = ["DashboardStatements"]


def _bucket(at: str) -> str:
    """The bucket of time `at` falls in: 0 for [:since, :since + :bucket), and so on.
    `date_part` gives a float8 where `extract` gives a numeric, which made this per-row
    arithmetic most of the statement's time."""
    return f"floor(date_part('epoch', {at} - CAST(:since AS timestamptz)) / :bucket)::int"


class DashboardStatements(Statements):
    """The dashboard's bounded reads, for one schema."""

    @cached_property
    def set_statement_timeout(self) -> TextClause:
        """Bound the statements of the current transaction in time.

        Sets `statement_timeout` to :ms milliseconds until the transaction ends (the reads
        below without an index to stop them early are sent after it)."""
        return self.sql("SELECT set_config('statement_timeout', CAST(:ms AS text), true)")

    @cached_property
    def select_queue_activity(self) -> TextClause:
        """Count per queue and time bucket what was due, started, finished and died.

        Per queue and bucket of :bucket seconds from :since on: `finished` and `dead` (rows
        that ended then, by `finished_at`), `started` with the pickup delay's p50 and p95
        (rows whose latest attempt started then, `started_at - run_at`), `failed` (the
        attempts that failed then, from the rows' `attempt_log`), `due` (rows that
        became due then, or before :since for bucket 0, and had not started by then) and
        `taken` (those of them that started then): the caller sums `due - taken` into the
        queue's depth. The rows read are the latest :limit finished since :since
        (`job_history_finished_idx`, and `jobs_finished_idx` for rows the move to history has
        not reached), the running ones (`jobs_running_idx`) and the due pending
        ones (`jobs_pending_idx`), :limit each; `read` says how many of each were read, so
        the caller knows when the window was cut. Apart from `failed`, each row counts by
        its latest attempt (an earlier failed one is in its `attempt_log`); a retry due
        later is pending and not due, so its failed attempts are not read until it runs."""
        return self.sql(f"""
            WITH ended AS (
                SELECT queue, status, run_at, started_at AS began, finished_at, attempt_log
                  FROM {S}.steps
                 WHERE status IN ('succeeded', 'dead', 'cancelled')
                   AND finished_at >= CAST(:since AS timestamptz)
                 ORDER BY finished_at DESC LIMIT :limit
            ), running AS (
                SELECT queue, status, run_at, locked_at AS began, NULL::timestamptz,
                       attempt_log
                  FROM {S}.jobs WHERE status = 'running' LIMIT :limit
            ), due AS (
                SELECT queue, status, run_at, NULL::timestamptz AS began,
                       NULL::timestamptz AS finished_at, attempt_log
                  FROM {S}.jobs WHERE status = 'pending' AND run_at <= now() LIMIT :limit
            ), r AS (
                SELECT * FROM ended UNION ALL SELECT * FROM running UNION ALL SELECT * FROM due
            ), b AS (
                SELECT queue, status,
                       {_bucket("finished_at")} AS fin,
                       CASE WHEN began >= CAST(:since AS timestamptz)
                            THEN {_bucket("began")} END AS st,
                       CASE WHEN status = 'pending' OR (began >= CAST(:since AS timestamptz)
                                                        AND began >= run_at)
                            THEN {_bucket("greatest(run_at, CAST(:since AS timestamptz))")}
                       END AS du,
                       CASE WHEN began >= run_at
                            THEN date_part('epoch', began - run_at) END AS delay
                  FROM r
            )
            SELECT queue, 'finished' AS kind, fin AS bucket, count(*) AS n,
                   NULL::float8 AS p50, NULL::float8 AS p95
              FROM b WHERE fin >= 0 GROUP BY queue, fin
            UNION ALL
            SELECT queue, 'dead', fin, count(*), NULL, NULL
              FROM b WHERE fin >= 0 AND status = 'dead' GROUP BY queue, fin
            UNION ALL
            SELECT queue, 'started', st, count(*),
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY delay),
                   percentile_cont(0.95) WITHIN GROUP (ORDER BY delay)
              FROM b WHERE st IS NOT NULL GROUP BY queue, st
            UNION ALL
            SELECT queue, 'due', du, count(*), NULL, NULL
              FROM b WHERE du IS NOT NULL GROUP BY queue, du
            UNION ALL
            SELECT queue, 'taken', st, count(*), NULL, NULL
              FROM b WHERE du IS NOT NULL AND st IS NOT NULL GROUP BY queue, st
            UNION ALL
            SELECT r.queue, 'failed', {_bucket("CAST(e.value ->> 'finished_at' AS timestamptz)")},
                   count(*), NULL, NULL
              FROM r CROSS JOIN LATERAL jsonb_array_elements(r.attempt_log) e
             WHERE r.attempt_log IS NOT NULL
               AND CAST(e.value ->> 'finished_at' AS timestamptz) >= CAST(:since AS timestamptz)
             GROUP BY 1, 3
            UNION ALL
            SELECT '', 'read', 0, (SELECT count(*) FROM ended), NULL, NULL""")

    @cached_property
    def select_running_jobs(self) -> TextClause:
        """List the running jobs, longest running first, with the worker holding each.

        Up to :limit running rows (`jobs_running_idx`) with the worker that claimed them
        (`locked_by`, the name it registered in `flowq.workers`)."""
        return self.sql(f"""
            SELECT id, run_id, task, step, queue, attempts, max_attempts, locked_by, locked_at,
                   GREATEST(extract(epoch FROM now() - locked_at), 0)::float8 AS running_s
              FROM {S}.jobs WHERE status = 'running'
             ORDER BY locked_at, id LIMIT :limit""")

    @cached_property
    def find_jobs_by_args(self) -> TextClause:
        """Find the newest job rows whose arguments contain a JSON value.

        Up to :limit rows whose `args` contain :args (`@>`, JSON containment), newest first.
        No index serves it (none is kept on `args`, which would cost every enqueue): it
        walks the rows from the newest id down, so the caller bounds it with a statement
        timeout as well as :limit."""
        return self.sql(f"""
            SELECT id, run_id, task, step, queue, status, created_at FROM {S}.steps
             WHERE args @> CAST(:args AS jsonb)
             ORDER BY id DESC LIMIT :limit""")

    @cached_property
    def select_due_times(self) -> TextClause:
        """Read when the pending steps of some runs are due.

        For each of :run_ids with a pending row, the earliest `run_at` of its pending rows:
        a delayed run's due time on the runs list (`jobs_run_id_idx`)."""
        return self.sql(f"""
            SELECT run_id, min(run_at) AS due_at FROM {S}.jobs
             WHERE run_id = ANY(CAST(:run_ids AS bigint[])) AND status = 'pending'
             GROUP BY run_id""")

    @cached_property
    def select_known_tasks(self) -> TextClause:
        """List the task names the runs filter offers.

        The tasks live or past workers registered and those of the newest :recent rows,
        sorted, at most :limit: no index lists every task of a large table cheaply, so an
        old task seen in neither is typed in the filter's URL instead."""
        return self.sql(f"""
            SELECT task FROM (
                SELECT unnest(tasks) AS task FROM {S}.workers
                UNION
                SELECT task FROM (SELECT task FROM {S}.steps ORDER BY id DESC LIMIT :recent) r
            ) t ORDER BY task LIMIT :limit""")
