"""Statements about the database rather than a table: schema check, locks, clocks, health."""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.sql.fragments import S, Statements

__all__ = ["AdminStatements"]


class AdminStatements(Statements):
    """The statements about the database itself, for one schema."""

    @cached_property
    def check_schema(self) -> TextClause:
        """Tell whether the schema's jobs table exists.

        Whether this schema's jobs table exists (NULL if not): a query that cannot fail, so
        a missing schema is reported before an INSERT would abort the caller's transaction."""
        return self.sql(f"SELECT to_regclass('{S}.jobs')")

    @cached_property
    def end_backend(self) -> TextClause:
        """Terminate a server process (an abandoned attempt's connection).

        End server process :pid: the connection of an attempt abandoned at its timeout,
        whose open transaction would otherwise hold its row locks until the stuck handler
        returns (if ever)."""
        return self.sql("SELECT pg_terminate_backend(:pid)")

    @cached_property
    def try_maintenance_lock(self) -> TextClause:
        """Try the transaction-scoped advisory lock of a maintenance service.

        Take the transaction-scoped advisory lock of one maintenance service, or not."""
        return self.sql("SELECT pg_try_advisory_xact_lock(hashtext(:name))")

    @cached_property
    def lock_maintenance_shared(self) -> TextClause:
        """Wait for the advisory lock of a maintenance service, shared.

        Take the transaction-scoped advisory lock `try_maintenance_lock` tries, in shared
        mode, waiting for a pass that holds it: holders never wait for one another, and a
        pass that tries the lock meanwhile finds it taken and does nothing."""
        return self.sql("SELECT pg_advisory_xact_lock_shared(hashtext(:name))")

    @cached_property
    def select_now(self) -> TextClause:
        """Read the transaction's clock.

        The database's clock: relative times (`--since 1h`) are measured on it, once."""
        return self.sql("SELECT now()")

    @cached_property
    def select_completions(self) -> TextClause:
        """Count per queue the jobs that ended in the last hour.

        Per queue, the jobs that ended in the last hour: succeeded in the last minute and
        hour, dead in the last hour. Reads the finished indexes of `job_history` and `jobs` from an hour ago on (its
        predicate written out, so the planner can use it): never the older retained rows."""
        return self.sql(f"""
            SELECT queue,
                   count(*) FILTER (WHERE status = 'succeeded'
                                      AND finished_at >= now() - interval '1 minute')
                       AS succeeded_last_minute,
                   count(*) FILTER (WHERE status = 'succeeded') AS succeeded_last_hour,
                   count(*) FILTER (WHERE status = 'dead') AS dead_last_hour
              FROM {S}.steps
             WHERE status IN ('succeeded', 'dead', 'cancelled')
               AND finished_at >= now() - interval '1 hour'
             GROUP BY queue""")

    @cached_property
    def select_dead_by_task(self) -> TextClause:
        """Count dead jobs by task.

        Dead jobs by task, most first, up to :limit tasks (`jobs_dead_idx`)."""
        return self.sql(f"""
            SELECT task, count(*) AS jobs FROM {S}.steps WHERE status = 'dead'
             GROUP BY task ORDER BY count(*) DESC, task LIMIT :limit""")

    @cached_property
    def select_dead_errors(self) -> TextClause:
        """Read the first dead step and its error of each of some runs.

        For each run of :run_ids, its first dead step (lowest id) and that step's error
        (the run_id index, then only the runs' rows)."""
        return self.sql(f"""
            SELECT DISTINCT ON (run_id) run_id, step, map_index, last_error FROM {S}.steps
             WHERE run_id = ANY(CAST(:run_ids AS bigint[])) AND status = 'dead'
             ORDER BY run_id, id""")

    @cached_property
    def select_table_health(self) -> TextClause:
        """Read the jobs table's statistics, size and pending index.

        `flowq.jobs`' statistics (live and dead tuples, last vacuum and analyze, size, the
        average row width of its last analyze, reloptions), its pending index's size, and the
        pending jobs (counted through that index)."""
        return self.sql(f"""
            SELECT s.n_live_tup, s.n_dead_tup,
                   extract(epoch FROM now() - GREATEST(s.last_vacuum, s.last_autovacuum))::float8
                       AS vacuum_age_s,
                   extract(epoch FROM now() - GREATEST(s.last_analyze, s.last_autoanalyze))::float8
                       AS analyze_age_s,
                   pg_table_size(c.oid) AS table_bytes, pg_relation_size(c.oid) AS heap_bytes,
                   c.reloptions,
                   (SELECT sum(avg_width) FROM pg_stats
                     WHERE schemaname = '{S}' AND tablename = 'jobs')::float8 AS row_width,
                   pg_relation_size(i.oid) AS pending_index_bytes,
                   i.reltuples AS pending_index_entries,
                   (SELECT count(*) FROM {S}.jobs WHERE status = 'pending') AS pending
              FROM pg_class c
              LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
              LEFT JOIN pg_class i ON i.oid = to_regclass('{S}.jobs_pending_idx')
             WHERE c.oid = to_regclass('{S}.jobs')""")

    @cached_property
    def select_long_transactions(self) -> TextClause:
        """List other sessions whose long transaction holds back vacuum.

        Sessions of this database (other than this one) whose transaction began more than
        :age seconds ago and holds back the xmin horizon (a snapshot, or a transaction id):
        oldest first, up to 10. Other roles' sessions are visible with pg_read_all_stats
        (pg_monitor) or as a superuser."""
        return self.sql("""
            SELECT pid, COALESCE(application_name, '') AS application_name,
                   COALESCE(usename::text, '') AS usename, COALESCE(state, '') AS state,
                   extract(epoch FROM now() - xact_start)::float8 AS age_s,
                   age(COALESCE(backend_xmin, backend_xid)) AS xmin_age,
                   left(regexp_replace(COALESCE(query, ''), '\\s+', ' ', 'g'), 80) AS query
              FROM pg_stat_activity
             WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
               AND datname = current_database() AND pid <> pg_backend_pid()
               AND xact_start < now() - make_interval(secs => :age)
             ORDER BY xact_start LIMIT 10""")

    @cached_property
    def select_backend(self) -> TextClause:
        """Read this session's backend pid, server port, autovacuum setting and role.

        This session's backend pid and server port, whether autovacuum is on, and whether
        the server is a standby in recovery (read-only)."""
        return self.sql("""
            SELECT pg_backend_pid() AS pid, inet_server_port() AS port,
                   current_setting('autovacuum') AS autovacuum,
                   pg_is_in_recovery() AS in_recovery""")

    @cached_property
    def send_probe(self) -> TextClause:
        """Send a NOTIFY (the doctor's LISTEN round trip).

        NOTIFY :channel with :payload (the doctor's LISTEN round trip)."""
        return self.sql("SELECT pg_notify(:channel, :payload)")

    @cached_property
    def select_clock(self) -> TextClause:
        """Read the database's wall clock.

        The database's clock (not the transaction's start), as seconds since the epoch."""
        return self.sql("SELECT extract(epoch FROM clock_timestamp())::float8")

    @cached_property
    def lock_metrics_collector(self) -> TextClause:
        """Take or keep the session lock that elects the metrics collector.

        Whether this session collects the queue metrics: it still is the backend :pid that
        took the session-level advisory lock :name, or it takes it now. CASE, so a holder
        never takes it twice (a session lock is re-entrant and counts its holds)."""
        return self.sql("""
            SELECT CASE WHEN pg_backend_pid() = CAST(:pid AS int) THEN true
                        ELSE pg_try_advisory_lock(hashtext(CAST(:name AS text))) END,
                   pg_backend_pid()""")
