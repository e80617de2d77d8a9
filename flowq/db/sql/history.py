"""Retention of finished runs and the day partitions of `flowq.job_history` (revision 0018).

The statements behind `flowq.db.history`: the partitions' DDL (built per day, the names and
bounds being identifiers and literals, never parameters), the whole-run rule by rows
(`prune_jobs`: the DEFAULT partition and finished rows still in `jobs`), the sweep of a day
about to be dropped (`prune_partition`), and the move of finished rows left in `jobs` by an
earlier release (`move_finished_jobs`).

One rule decides what a run keeps, wherever its rows are (`keeps`): a run is kept whole while
any of its steps is live, ended within :retention, or is dead and ended within
:dead_retention. A pruned run goes with what hangs off it (`dependents`).
"""

from __future__ import annotations

from datetime import date, timedelta
from functools import cached_property
from typing import Final

import sqlalchemy as sa
from sqlalchemy.sql.elements import TextClause

from flowq.db.schema import HISTORY_CAPABILITY, HISTORY_PARTITION
from flowq.db.sql.fragments import ACTIVE, S, Statements, copy_rows, registered_without

__all__ = ["DEFAULT_PARTITION", "HistoryStatements", "dependents", "keeps", "partition_name"]

# The partition the migration creates for rows no day partition takes.
DEFAULT_PARTITION: Final = f"{HISTORY_PARTITION}default"

_ENDED = "'succeeded', 'dead', 'cancelled'"


def keeps(run: str) -> str:
    """The condition that run `run` (an SQL expression) is retained: one of its steps, live
    or finished (`steps`), is live, ended within :retention, or is dead and ended within
    :dead_retention.

    OFFSET 0 keeps it one lookup per candidate in each table's run_id index (issue 21: as an
    anti-join the planner once hashed every recent row, 11.5 s at 10,000,000 rows)."""
    return f"""EXISTS (
                SELECT 1 FROM {S}.steps o
                 WHERE o.run_id = {run}
                   AND (o.status IN {ACTIVE}
                        OR o.finished_at >= now() - make_interval(secs => :retention)
                        OR (o.status = 'dead' AND o.finished_at >=
                            now() - make_interval(secs => :dead_retention)))
                OFFSET 0)"""



def dependents(runs: str) -> str:
    """CTEs (to follow a comma) deleting what hangs off the runs of CTE `runs` (a `run_id`
    column): joins and their shards, signals, held unique keys, checkpoints, links to child
    runs, idempotency keys. Each through its table's run index: `= ANY(ARRAY(...))` is one
    lookup per run, where `IN` let the planner hash the runs against a walk of the whole
    table (`joins_pkey`, 5,000 joins at 10,000,000 retained rows)."""
    ids = f"ANY(ARRAY(SELECT run_id FROM {runs}))"
    return f"""joins AS (DELETE FROM {S}.joins WHERE run_id = {ids})
            , shards AS (DELETE FROM {S}.join_shards WHERE run_id = {ids})
            , signals AS (DELETE FROM {S}.signals WHERE run_id = {ids})
            , held_keys AS (DELETE FROM {S}.uniques WHERE run_id = {ids})
            , marks AS (DELETE FROM {S}.checkpoints WHERE run_id = {ids})
            , links AS (DELETE FROM {S}.children WHERE parent_run_id = {ids})
            , run_keys AS (DELETE FROM {S}.run_keys WHERE run_id = {ids})"""


def partition_name(day: date) -> str:
    """The name of the partition of `job_history` holding the rows retired on `day` (UTC)."""
    return f"{HISTORY_PARTITION}{day:%Y%m%d}"


def _bound(day: date) -> str:
    # A literal made from a date object, never from text a caller gave.
    return f"'{day.isoformat()} 00:00:00+00'"


class HistoryStatements(Statements):
    """Retention and the day partitions of `job_history`, for one schema."""

    # -- the partitions' DDL: one day each, never parameters ---------------------------------

    def create_partition(self, day: date) -> TextClause:
        """The table that becomes `day`'s partition, shaped like `job_history`."""
        return sa.text(f"CREATE TABLE {self.schema}.{partition_name(day)} "
                       f"(LIKE {self.schema}.job_history)")

    def attach_partition(self, day: date) -> TextClause:
        """Attach `day`'s table for [day 00:00 UTC, the next day's): SHARE UPDATE EXCLUSIVE
        on `job_history` (completions go on), ACCESS EXCLUSIVE on the new table and on the
        DEFAULT partition, which is scanned for rows of that day (check_violation if any)."""
        return sa.text(
            f"ALTER TABLE {self.schema}.job_history ATTACH PARTITION "
            f"{self.schema}.{partition_name(day)} FOR VALUES FROM ({_bound(day)}) "
            f"TO ({_bound(day + timedelta(days=1))})")

    def detach_partition(self, day: date) -> TextClause:
        """Detach `day`'s partition: ACCESS EXCLUSIVE on `job_history` (CONCURRENTLY is
        refused while a DEFAULT partition exists), so it runs under a short lock_timeout."""
        return sa.text(f"ALTER TABLE {self.schema}.job_history DETACH PARTITION "
                       f"{self.schema}.{partition_name(day)}")

    def drop_partition(self, day: date) -> TextClause:
        """Drop `day`'s table once detached."""
        return sa.text(f"DROP TABLE {self.schema}.{partition_name(day)}")

    # -- statements ----------------------------------------------------------------------

    @cached_property
    def set_ddl_timeouts(self) -> TextClause:
        """Bound this transaction's lock waits and statements (partition DDL).

        :lock_timeout and :statement_timeout (texts such as '500ms'), for this transaction
        only. A DDL statement waiting for its lock stands in the queue ahead of every
        completion and reader that comes after it, so it must give up soon."""
        return self.sql("SELECT set_config('lock_timeout', :lock_timeout, true), "
                        "set_config('statement_timeout', :statement_timeout, true)")

    @cached_property
    def list_partitions(self) -> TextClause:
        """List the partitions of job_history, with the database's clock.

        One row: `now()` (the days are the database's, in UTC) and `names`, the partitions
        of `job_history` (the days' and the DEFAULT)."""
        return self.sql(f"""
            SELECT now() AS now, ARRAY(
                SELECT c.relname::text
                  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                 WHERE i.inhparent = CAST('{S}.job_history' AS regclass)
                 ORDER BY c.relname) AS names""")

    @cached_property
    def exists_default_rows(self) -> TextClause:
        """Tell whether the DEFAULT partition holds rows retired in one day's range.

        Whether `job_history_default` has a row retired in [:lower, :upper): then that day
        cannot be attached (check_violation). Asked first with a plain read, so that a day
        that cannot be attached yet does not take the DEFAULT partition's ACCESS EXCLUSIVE
        lock for a scan at every pass (it reads DEFAULT whole: it is meant to stay small)."""
        return self.sql(f"""
            SELECT EXISTS (SELECT 1 FROM {S}.{DEFAULT_PARTITION}
                            WHERE retired_at >= :lower AND retired_at < :upper)""")

    @cached_property
    def select_day_rows(self) -> TextClause:
        """Count the rows of job_history retired in one day's range.

        The rows retired in [:lower, :upper): a day partition about to be dropped (swept,
        so frozen), counted as the rows its DROP deletes."""
        return self.sql(f"""
            SELECT count(*) FROM {S}.job_history
             WHERE retired_at >= :lower AND retired_at < :upper""")

    @cached_property
    def prune_jobs(self) -> TextClause:
        """Delete whole runs that finished longer ago than their retention.

        Delete up to :limit runs that have a row in the DEFAULT partition of `job_history` or
        a finished row still in `jobs`, and whose rows all ended more than :retention seconds
        ago (:dead_retention for runs with a dead step): see `keeps`. Whole runs only, wherever
        their rows are (a day partition too), so a retained run keeps its history and its
        idempotency key; with them what hangs off them (`dependents`: a unique key still held
        goes, `uniques_run_id_idx`). Batches (`session.batch`) whose callback was enqueued
        longer ago than :retention go too, up to :limit per statement (`batches_fired_idx`):
        the callback's run is a run of its own, kept by these same rules. The day partitions
        are retired whole (`prune_partition`, then a DROP): this is the rule row by row, for
        what no day partition took.

        The batches are deleted by `= ANY(ARRAY(...))` of their ids, primary-key lookups,
        where `IN` hashed them against a walk of the whole `batches_pkey` (issue 21). The
        :limit applies to the candidate rows before DISTINCT, so the walk of the ended rows
        stops at :limit rows (a batch is then at most :limit runs, fewer when a run has more
        than one ended row there): DISTINCT first had to sort every ended row, each checked
        against `keeps`, 8.6 s and 16,800,000 buffers a batch at 10,000,000 rows."""
        return self.sql(f"""
            WITH ended AS (
                SELECT d.run_id FROM {S}.{DEFAULT_PARTITION} d
                 WHERE d.finished_at < now() - make_interval(secs => :retention)
                UNION ALL
                SELECT j.run_id FROM {S}.jobs j
                 WHERE j.status IN ({_ENDED})
                   AND j.finished_at < now() - make_interval(secs => :retention))
            , old AS (
                SELECT DISTINCT c.run_id FROM (
                    SELECT e.run_id FROM ended e
                     WHERE NOT {keeps("e.run_id")}
                     LIMIT :limit) c)
            , gone AS (DELETE FROM {S}.jobs WHERE run_id = ANY(ARRAY(SELECT run_id FROM old))
                       RETURNING run_id)
            , gone_history AS (DELETE FROM {S}.job_history
                                WHERE run_id = ANY(ARRAY(SELECT run_id FROM old))
                               RETURNING run_id)
            , {dependents("old")}
            , fired AS (DELETE FROM {S}.batches WHERE id = ANY(ARRAY(
                  SELECT id FROM {S}.batches
                   WHERE fired_at < now() - make_interval(secs => :retention)
                   ORDER BY fired_at LIMIT :limit)))
            SELECT (SELECT count(*) FROM gone) + (SELECT count(*) FROM gone_history)""")

    @cached_property
    def prune_partition(self) -> TextClause:
        """Clear the next runs of a day partition to be dropped: re-home kept, prune the rest.

        The next :limit runs (by run_id, after :after) with a row retired in [:lower, :upper)
        (one day partition, older than :retention). A kept run (`keeps`) has its rows there
        re-homed (`retired_at = now()` moves them to today's partition); every other run is
        pruned whole: its rows elsewhere deleted, what hangs off it too (`dependents`), its
        rows in the day left for the DROP, but for a run with a dead step, deleted here:
        `runs retry` could bring it back before the DROP, which would take its rows from
        under it (dead runs are few, so few rows go one by one). Returns the last run id
        seen (NULL: the day is swept), the rows deleted (those the DROP will not count) and
        the rows re-homed.

        The day is frozen (new rows retire at now()), so a sweep by run_id sees each run once;
        every run is looked up in the run_id indexes only, by `= ANY(ARRAY(...))`: one lookup
        per run in each partition, where `IN` let the planner hash the runs against a walk of
        whole partitions' run_id indexes (seen on the days beside the swept one)."""
        day = "h.retired_at >= :lower AND h.retired_at < :upper"
        return self.sql(f"""
            WITH runs AS (
                SELECT DISTINCT h.run_id FROM {S}.job_history h
                 WHERE {day} AND h.run_id > :after
                 ORDER BY h.run_id LIMIT :limit)
            , kept AS (SELECT r.run_id FROM runs r WHERE {keeps("r.run_id")})
            , pruned AS (SELECT run_id FROM runs EXCEPT ALL SELECT run_id FROM kept)
            , rehomed AS (UPDATE {S}.job_history h SET retired_at = now()
                           WHERE h.run_id = ANY(ARRAY(SELECT run_id FROM kept)) AND {day}
                          RETURNING 1)
            , gone AS (DELETE FROM {S}.jobs
                        WHERE run_id = ANY(ARRAY(SELECT run_id FROM pruned))
                       RETURNING 1)
            , revivable AS (SELECT p.run_id FROM pruned p WHERE EXISTS (
                  SELECT 1 FROM {S}.job_history x
                   WHERE x.run_id = p.run_id AND x.status = 'dead'))
            , gone_history AS (DELETE FROM {S}.job_history h
                                WHERE h.run_id = ANY(ARRAY(SELECT run_id FROM pruned))
                                  AND (NOT ({day})
                                       OR h.run_id = ANY(ARRAY(SELECT run_id FROM revivable)))
                               RETURNING 1)
            , {dependents("pruned")}
            SELECT (SELECT max(run_id) FROM runs) AS last_run_id,
                   (SELECT count(*) FROM gone)
                       + (SELECT count(*) FROM gone_history) AS deleted,
                   (SELECT count(*) FROM rehomed) AS rehomed""")

    @cached_property
    def exists_finished_jobs(self) -> TextClause:
        """Tell whether `jobs` holds finished rows to move to history now.

        Whether a row of `jobs` has a terminal status (it ended before revision 0018, or
        while a worker of the release before it was registered), and no such worker is
        registered now (`HISTORY_CAPABILITY`: it reads finished rows from `jobs` only). One
        probe of `jobs_finished_idx`, so a pass sends the move only when it would move."""
        return self.sql(f"""
            SELECT EXISTS (SELECT 1 FROM {S}.jobs WHERE status IN ({_ENDED}))
                   AND NOT {registered_without(HISTORY_CAPABILITY)}""")

    @cached_property
    def move_finished_jobs(self) -> TextClause:
        """Move up to :limit finished rows from jobs to job_history.

        Rows of `jobs` with a terminal status (see `exists_finished_jobs`; none while a
        worker of the release before 0018 is registered) are deleted and written to `job_history` unchanged
        (`fragments.copy_rows`: every column by name), retired now, and the key of a keyed
        one recorded in `run_keys` if its run has none there (as the trigger `jobs_retire`
        does: a run enqueued by the previous release). SKIP LOCKED: a row an operator or a
        late writer holds waits for the next pass. Returns how many moved."""
        return self.sql(f"""
            WITH gone AS (
                DELETE FROM {S}.jobs WHERE id = ANY(ARRAY(
                    SELECT id FROM {S}.jobs WHERE status IN ({_ENDED})
                       AND NOT {registered_without(HISTORY_CAPABILITY)}
                     LIMIT :limit FOR UPDATE SKIP LOCKED))
                RETURNING *)
            , retired AS ({copy_rows("job_history", "gone g", {})} RETURNING 1)
            , keys AS (INSERT INTO {S}.run_keys (key, run_id)
                       SELECT idempotency_key, run_id FROM gone
                        WHERE idempotency_key IS NOT NULL
                       ON CONFLICT (key) DO NOTHING)
            SELECT count(*) FROM retired""")
