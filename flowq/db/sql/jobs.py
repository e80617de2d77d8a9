"""Enqueue and the reads of `flowq.jobs` rows outside a claim."""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.sql.fragments import (
    CALL,
    CALL_COLUMNS,
    DUE,
    S,
    Statements,
    mark_keyed,
    wake,
)
from flowq.db.sql.runstart import FIND_RUN_BY_KEY, claim_key, start_run

__all__ = ["JobStatements"]


class JobStatements(Statements):
    """Enqueue and the reads of job rows outside a claim, for one schema."""

    @cached_property
    def insert_job(self) -> TextClause:
        """Enqueue one run of one row, without a key (the hot path).

        The keyless enqueue: one plain INSERT (no CTE, no conflict arbitration: it is the
        hot path of every business transaction) whose RETURNING also notifies :channel with
        the queue, delivered at commit only."""
        return self.sql(f"""
            INSERT INTO {S}.jobs ({CALL_COLUMNS}, args, run_at, concurrency_key)
            VALUES ({CALL}, CAST(:args AS jsonb), {DUE}, CAST(:concurrency_key AS text))
            RETURNING id, run_id, true AS created, pg_notify(:channel, {wake("queue", "run_at")})""")

    @cached_property
    def insert_keyed_job(self) -> TextClause:
        """Enqueue one run of one row with a concurrency key, without an idempotency key.

        `insert_job` for a job carrying a concurrency key: it also marks its queue keyed
        (`fragments.mark_keyed`), so that the key's limit holds in whatever queue it runs."""
        return self.sql(f"""
            WITH {mark_keyed("true")}
            INSERT INTO {S}.jobs ({CALL_COLUMNS}, args, run_at, concurrency_key)
            VALUES ({CALL}, CAST(:args AS jsonb), {DUE}, CAST(:concurrency_key AS text))
            RETURNING id, run_id, true AS created, pg_notify(:channel, {wake("queue", "run_at")})""")

    @cached_property
    def find_run_by_key(self) -> TextClause:
        """Find the run holding an idempotency key.

        The run holding :idempotency_key, as (id, run_id, created = false)."""
        return self.sql(f"""
            {FIND_RUN_BY_KEY}""")

    @cached_property
    def release_orphaned_key(self) -> TextClause:
        """Free an idempotency key whose run has no rows left.

        Delete the entry of :idempotency_key in `run_keys` when no row of its run is in
        `jobs` or `job_history`: a run that a pruner of the release before revision 0018
        deleted (from `jobs` alone) after the migration had recorded its key. This release
        deletes a key with its run; without this, such a key would name no run for good and
        every enqueue of it would fail. A run's first rows and its key are written by one
        statement, and its rows move by one, so a run that this statement's snapshot sees
        without rows has none: the key is free."""
        return self.sql(f"""
            DELETE FROM {S}.run_keys k
             WHERE k.key = CAST(:idempotency_key AS text)
               AND NOT EXISTS (SELECT 1 FROM {S}.steps s WHERE s.run_id = k.run_id)
            RETURNING k.run_id""")

    @cached_property
    def insert_job_by_key(self) -> TextClause:
        """Enqueue one run of one row under an idempotency key.

        The keyed enqueue: the run holding :idempotency_key, else a new one (notified).

        The key is read first, in the statement's snapshot, and the key is claimed
        (`runstart.claim_key`) and the row inserted only when nothing was found; so a
        duplicate touches no row and takes no lock. Under REPEATABLE READ an old key is found
        in the snapshot, where any ON CONFLICT arbitration against a newer version would
        raise a serialization failure.

        `DO NOTHING` on the key's entry remains for a key claimed concurrently: PostgreSQL
        makes the INSERT wait for that transaction. If it rolls back, ours goes in; if it
        commits, the statement returns no row (the winner is newer than its snapshot), and
        the caller sends `find_run_by_key`. A concurrency key marks the queue keyed
        (`fragments.mark_keyed`)."""
        return self.sql(f"""
            WITH existing AS ({FIND_RUN_BY_KEY}),
            {mark_keyed("CAST(:concurrency_key AS text) IS NOT NULL")},
            {claim_key("(VALUES (1)) AS one(n)", "NOT EXISTS (SELECT 1 FROM existing)",
                       f"nextval('{S}.run_id_seq')")},
            inserted AS (
                INSERT INTO {S}.jobs (run_id, {CALL_COLUMNS}, args, run_at, concurrency_key,
                                        idempotency_key)
                SELECT k.run_id, {CALL}, CAST(:args AS jsonb), {DUE},
                       CAST(:concurrency_key AS text), CAST(:idempotency_key AS text)
                  FROM keyed k
                ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
                RETURNING id, run_id, queue, run_at)
            SELECT id, run_id, true AS created, pg_notify(:channel, {wake("queue", "run_at")})
              FROM inserted
            UNION ALL
            SELECT id, run_id, created, NULL FROM existing""")

    @cached_property
    def insert_jobs(self) -> TextClause:
        """Enqueue many runs of one row each, in one statement.

        The bulk enqueue: one run per element of :args (JSON texts), one notification; the
        run ids in input order (run_id is drawn from its sequence row by row in input order,
        while RETURNING itself promises no order). Any concurrency key among
        :concurrency_keys marks the queue keyed (`fragments.mark_keyed`)."""
        return self.sql(f"""
            WITH {mark_keyed("EXISTS (SELECT 1 FROM unnest(CAST(:concurrency_keys AS text[]))"
                             " AS c(k) WHERE c.k IS NOT NULL)")},
            inserted AS (
                INSERT INTO {S}.jobs ({CALL_COLUMNS}, args, run_at, concurrency_key)
                SELECT {CALL}, a.value, {DUE}, a.key
                  FROM unnest(CAST(:args AS jsonb[]), CAST(:concurrency_keys AS text[]))
                       WITH ORDINALITY AS a(value, key, n)
                 ORDER BY a.n
                RETURNING run_id, run_at)
            SELECT array_agg(run_id ORDER BY run_id),
                   pg_notify(:channel, {wake("CAST(:queue AS text)", "min(run_at)")})
              FROM inserted""")

    @cached_property
    def insert_run(self) -> TextClause:
        """Enqueue a run that starts with several root rows (a workflow).

        Enqueue a run of a workflow: one row per root step, all sharing one run_id (see
        `_start_run`). A root waiting for a signal starts `waiting` and is entered in
        `flowq.signals` (a signal needs its run to exist, so none can be there yet). Keyed
        like `insert_job_by_key`: the other roots are inserted only if the first one was,
        and the run holding :idempotency_key is returned otherwise."""
        return self.sql(start_run(
            f"WITH existing AS ({FIND_RUN_BY_KEY})", "{roots}",
            "NOT EXISTS (SELECT 1 FROM existing)", "nextval('{s}.run_id_seq')",
            "UNION ALL SELECT id, run_id, created, NULL FROM existing"))

    @cached_property
    def exists_due_jobs(self) -> TextClause:
        """Tell whether any job of some queues is due soon.

        Whether any job of :queues is due within :horizon seconds (`run_until_idle` uses it
        to know it is done)."""
        return self.sql(f"""
            SELECT EXISTS (SELECT 1 FROM {S}.jobs
                           WHERE status = 'pending' AND queue = ANY(:queues)
                             AND run_at <= now() + make_interval(secs => :horizon))""")

    @cached_property
    def select_pending_queues(self) -> TextClause:
        """List the queues some runs have pending jobs in (the test kit's drain).

        The distinct queues of the pending rows of the runs :run_ids, by name: where the
        children and batch callbacks a drain follows will run."""
        return self.sql(f"""
            SELECT DISTINCT queue FROM {S}.jobs
             WHERE run_id = ANY(CAST(:run_ids AS bigint[])) AND status = 'pending'
             ORDER BY queue""")

    @cached_property
    def select_map_results(self) -> TextClause:
        """Read the results of a mapped step's instances, in item order.

        The results of every instance of mapped step :step of run :run_id, in item order:
        a join's input from a mapped parent, collected when the join runs (an instance
        completing never reads its siblings; the join's counter is all it touches)."""
        return self.sql(f"""
            SELECT result FROM {S}.steps
             WHERE run_id = :run_id AND step = :step AND map_index IS NOT NULL
             ORDER BY map_index""")

    @cached_property
    def find_stranded_jobs(self) -> TextClause:
        """Find due jobs of an app's tasks on queues its workers do not serve.

        Due jobs of :tasks that sit on a queue outside :queues (the queues their app's
        steps use, which its workers serve by default): enqueued with a queue= no worker of
        that app serves, they would wait forever. Up to 20 (queue, task) groups, largest
        first; the worker logs them at start."""
        return self.sql(f"""
            SELECT queue, task, count(*) AS n,
                   extract(epoch FROM now() - min(run_at))::float8 AS oldest_s
              FROM {S}.jobs
             WHERE status = 'pending' AND run_at <= now()
               AND task = ANY(:tasks) AND queue <> ALL(:queues)
             GROUP BY queue, task ORDER BY count(*) DESC LIMIT 20""")

    @cached_property
    def select_pending_jobs(self) -> TextClause:
        """List pending jobs of a task and queue (the test kit's assertions).

        Pending jobs of :task and of :queue (NULL: any), oldest first: what the test kit's
        `assert_enqueued` looks at, sent through the caller's own transaction."""
        return self.sql(f"""
            SELECT * FROM {S}.jobs
             WHERE status = 'pending'
               AND (CAST(:task AS text) IS NULL OR task = CAST(:task AS text))
               AND (CAST(:queue AS text) IS NULL OR queue = CAST(:queue AS text))
             ORDER BY id""")
