"""`flowq.workers`: the registry of live workers; `flowq.definitions`, the definitions they
serve, and the runs in flight by the definition they started under (the deploy check)."""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.schema import CAPABILITIES
from flowq.db.sql.fragments import S, Statements, stale

__all__ = ["WorkerStatements"]

# What this release's code understands of the shared tables, as an SQL array's items.
_CAPABILITIES = ", ".join(f"'{c}'" for c in CAPABILITIES)


class WorkerStatements(Statements):
    """The statements of `flowq.workers`, for one schema."""

    @cached_property
    def register_worker(self) -> TextClause:
        """Register a worker in the registry (or refresh it).

        Register worker :name (or refresh it, if it exists: a restart under the same name),
        with what this release's code understands of the shared tables (`capabilities`) and
        the definitions it serves (:definitions, `{pipeline: [{version, fingerprint}]}`); no
        leases (a restart holds none of its predecessor's claims)."""
        return self.sql(f"""
            INSERT INTO {S}.workers (name, host, pid, queues, tasks, concurrency, version,
                                     capabilities, definitions)
            VALUES (:name, :host, :pid, CAST(:queues AS text[]), CAST(:tasks AS text[]),
                    :concurrency, :version, ARRAY[{_CAPABILITIES}],
                    CAST(:definitions AS jsonb))
            ON CONFLICT (name) DO UPDATE
               SET host = excluded.host, pid = excluded.pid, queues = excluded.queues,
                   tasks = excluded.tasks, concurrency = excluded.concurrency,
                   version = excluded.version, capabilities = excluded.capabilities,
                   definitions = excluded.definitions, leases = NULL,
                   started_at = now(), heartbeat_at = now()""")

    @cached_property
    def record_definitions(self) -> TextClause:
        """Record the shapes of definitions by fingerprint, once each.

        Record each definition (:fingerprints, :pipelines, :versions, :shapes as JSON texts)
        in `flowq.definitions` unless its fingerprint is there: a fingerprint names one shape,
        so the first row is the row."""
        return self.sql(f"""
            INSERT INTO {S}.definitions (fingerprint, pipeline, version, shape)
            SELECT d.fingerprint, d.pipeline, d.version, d.shape
              FROM unnest(CAST(:fingerprints AS text[]), CAST(:pipelines AS text[]),
                          CAST(:versions AS int[]), CAST(:shapes AS jsonb[]))
                   AS d(fingerprint, pipeline, version, shape)
             ORDER BY d.fingerprint  -- one lock order for workers starting at once
            ON CONFLICT (fingerprint) DO NOTHING""")

    @cached_property
    def select_definitions(self) -> TextClause:
        """List the recorded definitions of some pipelines.

        The recorded definitions (fingerprint, pipeline, version, shape, first_seen) of the
        pipelines :pipelines, by pipeline, version and first sight."""
        return self.sql(f"""
            SELECT fingerprint, pipeline, version, shape, first_seen
              FROM {S}.definitions
             WHERE pipeline = ANY(CAST(:pipelines AS text[]))
             ORDER BY pipeline, version, first_seen""")

    @cached_property
    def select_served_definitions(self) -> TextClause:
        """List what the other live workers serve.

        The live workers (heartbeat within :stale seconds) other than :name that registered
        their definitions: name, queues, definitions."""
        return self.sql(f"""
            SELECT name, queues, definitions
              FROM {S}.workers
             WHERE name <> :name AND definitions IS NOT NULL
               AND heartbeat_at >= now() - make_interval(secs => :stale)
             ORDER BY name""")

    @cached_property
    def find_worker(self) -> TextClause:
        """Tell whether a worker is in the registry.

        Worker :name's entry (its name); no row when it expired (then register again). The
        entry's beat is the heartbeat's (`heartbeat_jobs`), on the heartbeat's connection."""
        return self.sql(f"SELECT name FROM {S}.workers WHERE name = :name")

    @cached_property
    def unregister_worker(self) -> TextClause:
        """Remove a worker from the registry (a clean stop).

        Remove worker :name (a clean stop)."""
        return self.sql(f"DELETE FROM {S}.workers WHERE name = :name")

    @cached_property
    def expire_workers(self) -> TextClause:
        """Remove workers whose heartbeat expired.

        Remove workers whose heartbeat is older than :stale seconds (they died): the
        reaper's limit (`fragments.stale`), under which their jobs are reaped too."""
        return self.sql(f"""
            DELETE FROM {S}.workers WHERE {stale("heartbeat_at")} RETURNING name""")

    @cached_property
    def select_unserved_jobs(self) -> TextClause:
        """Group the due jobs that no live worker serves.

        Due jobs that no live worker (heartbeat within :stale seconds) serves: none listens
        on their queue with their task in its app. Up to :limit (queue, task) groups, largest
        first. Scans the pending jobs: for an operator's eyes, not a hot path."""
        return self.sql(f"""
            SELECT j.queue, j.task, count(*) AS n,
                   extract(epoch FROM now() - min(j.run_at))::float8 AS oldest_s
              FROM {S}.jobs j
             WHERE j.status = 'pending' AND j.run_at <= now()
               AND NOT EXISTS (
                   SELECT 1 FROM {S}.workers w
                    WHERE j.queue = ANY(w.queues) AND j.task = ANY(w.tasks)
                      AND w.heartbeat_at >= now() - make_interval(secs => :stale))
             GROUP BY j.queue, j.task ORDER BY count(*) DESC LIMIT :limit""")

    @cached_property
    def select_live_workers(self) -> TextClause:
        """List the workers whose heartbeat is recent.

        The registered workers whose heartbeat is younger than :stale seconds, by name."""
        return self.sql(f"""
            SELECT name, host, pid, queues, concurrency, version, started_at,
                   -- now() is the transaction's start: a beat committed since is younger
                   GREATEST(extract(epoch FROM now() - heartbeat_at), 0)::float8
                       AS heartbeat_age_s
              FROM {S}.workers
             WHERE heartbeat_at >= now() - make_interval(secs => :stale)
             ORDER BY name""")

    @cached_property
    def select_runs_in_flight(self) -> TextClause:
        """Group the active jobs by definition, step and argument names.

        The active jobs (pending, running, waiting: read through the partial indexes of
        those statuses), grouped by task, the fingerprint their run started under, step,
        whether a join created them, and the names of their stored arguments: how many runs,
        the oldest row's creation, the smallest run id. Up to :limit groups. For the deploy
        check: an operator's read, not a hot path."""
        return self.sql(f"""
            SELECT j.task, j.fingerprint, j.step, j.joined,
                   COALESCE((SELECT array_agg(k ORDER BY k) FROM jsonb_object_keys(
                                CASE WHEN jsonb_typeof(j.args) = 'object' THEN j.args
                                     ELSE '{{}}'::jsonb END) AS k),
                            CAST('{{}}' AS text[])) AS names,
                   count(DISTINCT j.run_id) AS runs, min(j.created_at) AS oldest,
                   min(j.run_id) AS example
              FROM {S}.jobs j
             WHERE (j.status = 'pending' OR j.status = 'running' OR j.status = 'waiting')
             GROUP BY j.task, j.fingerprint, j.step, j.joined, names
             ORDER BY j.task, j.fingerprint, j.step
             LIMIT :limit""")

    @cached_property
    def select_handed_over_jobs(self) -> TextClause:
        """Group the pending jobs a worker left to another worker's definition.

        Pending jobs whose last note says a worker left them to another (`suspend_job` with a note:
        its definition could not run them, the other's can), by task, the fingerprint their
        run started under and the worker they were left to (the note's first quoted name);
        up to :limit groups, largest first. Reads the pending rows: for an operator's eyes,
        not a hot path."""
        return self.sql(f"""
            SELECT j.task, j.fingerprint, split_part(j.last_error, '''', 2) AS worker,
                   count(*) AS n
              FROM {S}.jobs j
             WHERE j.status = 'pending' AND j.last_error LIKE 'left to worker %'
             GROUP BY j.task, j.fingerprint, worker
             ORDER BY count(*) DESC, j.task LIMIT :limit""")

    @cached_property
    def select_version_fingerprints(self) -> TextClause:
        """List the recorded fingerprints of one version number.

        The fingerprints `flowq.definitions` records for version :version (of pipeline :task
        only, unless NULL): what `flowq runs list --version` matches runs by."""
        return self.sql(f"""
            SELECT fingerprint FROM {S}.definitions
             WHERE version = CAST(:version AS int)
               AND (CAST(:task AS text) IS NULL OR pipeline = CAST(:task AS text))
             ORDER BY fingerprint""")
