"""The statements of `flowq.children`: which runs a step started with `ctx.start_child`.

A child's link is written in the transaction that enqueues it and records its checkpoint
(`flowq.children`), after locking the parent's job row (`FOR NO KEY UPDATE`, the lock the
checkpoint's fence takes too): a cancel of the parent's run locks that row first, so either
the cancel waits for the child and then finds its link (and cancels it), or the child's
transaction waits for the cancel and sees `cancel_requested` (and starts nothing). A wait
reads its children's statuses by `RUN_STATUS`, the rule `flowq.ops.runinfo.run_status`
states; a cancel walks the links down, bounded in depth (a cycle cannot be made through
`start_child`, whose children are new runs, but a hand-written row could).
"""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.schema import NO_MAP_INDEX
from flowq.db.sql.fragments import RUN_STATUS, S, Statements

__all__ = ["ChildStatements", "wake_parents"]

# Whether a run's rows are all finished (none pending, running or waiting), over its rows.
FINISHED = "NOT bool_or(status IN ('pending', 'running', 'waiting'))"


def wake_parents(done: str) -> str:
    """A CTE `woken_parents` making the waiting parents of the child runs in `done` (a FROM
    item with `run_id`: the rows a completion just ended) due now, and waking the workers of
    their queues (:channel): the completion that ends a child's run ends its parent's wait
    at once, instead of at its next re-check. Two primary-key lookups per completed row
    (its link, the parent's job), none past the first for a run that is nobody's child.
    Only a parent step that is pending and due
    later (suspended in `ctx.wait`) is moved; a row another transaction holds is skipped
    (`SKIP LOCKED`: a claim, a cancel, or another completion waking it), so a completion
    never waits for, nor deadlocks on, a parent's row. A parent that was running its wait
    when the child ended is not woken: its re-check finds the child finished.

    The parents are found by primary key only: their ids come from the links first
    (`= ANY(ARRAY(...))`, an index condition), and their state is tested as `(...) IS TRUE`,
    which no index matches. Written as a join, with `flowq.jobs` analyzed while its rows were
    dead (an open snapshot), the planner walked the pending index for `run_at > now()`, or
    the whole primary key, at every completion: with 240,000 jobs pending behind the
    snapshot one completion ran for minutes (`flowq bench --scenario pressure`)."""
    return f"""woken_parents AS (
                UPDATE {S}.jobs p SET run_at = now()
                 WHERE p.id = ANY(ARRAY(
                       SELECT q.id FROM {S}.jobs q
                        WHERE q.id = ANY(ARRAY(SELECT c.parent_job_id FROM {done} d
                                                 JOIN {S}.children c ON c.run_id = d.run_id))
                          AND (q.status = 'pending' AND q.run_at > now()) IS TRUE
                          FOR UPDATE OF q SKIP LOCKED))
                RETURNING pg_notify(:channel, p.queue))"""


class ChildStatements(Statements):
    """The statements of `flowq.children`, for one schema."""

    @cached_property
    def insert_child(self) -> TextClause:
        """Link a child run to its parent, unless the parent's run is being cancelled.

        Lock the parent's job :job_id (waiting for a cancel in flight), and, unless it has
        `cancel_requested`, record run :child_run_id as a child of (:run_id, :step,
        :map_index), job :job_id, started by checkpoint :name; one row: `cancelled` (NULL when the job
        row does not exist: the test kit's synthetic job) and `linked` (0 or 1). A parent
        with a run deadline gives it to the child, unless the child's own is earlier: the
        deadline pass then cancels the child with its parent (the rows the child's enqueue
        just wrote, in this transaction; none is updated when nothing changes)."""
        return self.sql(f"""
            WITH parent AS (
                SELECT bool_or(p.cancel_requested) AS cancelled, max(p.deadline) AS deadline
                  FROM (SELECT j.cancel_requested, j.deadline FROM {S}.jobs j
                         WHERE j.id = CAST(:job_id AS bigint) FOR NO KEY UPDATE OF j) p
            ), capped AS (
                UPDATE {S}.jobs c SET deadline = parent.deadline
                  FROM parent
                 WHERE c.run_id = CAST(:child_run_id AS bigint)
                   AND parent.cancelled IS NOT TRUE AND parent.deadline IS NOT NULL
                   AND (c.deadline IS NULL OR c.deadline > parent.deadline)
            ), linked AS (
                INSERT INTO {S}.children (run_id, parent_run_id, parent_step,
                                          parent_map_index, parent_job_id, name)
                SELECT CAST(:child_run_id AS bigint), CAST(:run_id AS bigint),
                       CAST(:step AS text), COALESCE(CAST(:map_index AS int), {NO_MAP_INDEX}),
                       CAST(:job_id AS bigint), CAST(:name AS text)
                  FROM parent WHERE parent.cancelled IS NOT TRUE
                RETURNING run_id)
            SELECT (SELECT cancelled FROM parent) AS cancelled,
                   (SELECT count(*) FROM linked) AS linked""")

    @cached_property
    def select_children_status(self) -> TextClause:
        """Read the status of some children of a run, with the database's clock.

        For each of the runs :run_ids that is a child of run :run_id: its id, when it was
        started, its status derived from its rows (`RUN_STATUS`; NULL when its rows are
        gone) and whether they have all finished; one row of NULLs but the clock when none
        is a child. A child a fork reuses (`flowq.runs.fork` copied the start's record,
        `flowq.child.N`, from the source run) counts as the fork's too: its link names the
        source run, and the fork's own record of its start is the proof."""
        return self.sql(f"""
            SELECT n.now, c.run_id, c.created_at, s.status, s.finished
              FROM (SELECT now() AS now) n
              LEFT JOIN {S}.children c
                     ON c.run_id = ANY(CAST(:run_ids AS bigint[]))
                    AND (c.parent_run_id = CAST(:run_id AS bigint)
                         OR EXISTS (SELECT 1 FROM {S}.checkpoints k
                                     WHERE k.run_id = CAST(:run_id AS bigint)
                                       AND k.name LIKE 'flowq.child.%'
                                       AND k.result = to_jsonb(c.run_id)))
              LEFT JOIN LATERAL (
                  SELECT {RUN_STATUS} AS status, {FINISHED} AS finished
                    FROM {S}.steps j WHERE j.run_id = c.run_id HAVING count(*) > 0) s ON true""")

    @cached_property
    def set_children_waiter(self) -> TextClause:
        """Point the links of some children at the step that waits for them.

        Make job :job_id the `parent_job_id` of those of the runs :run_ids that are children
        of run :run_id and name another job: a later step of the parent's pipeline waiting
        for a child an earlier step started, so that the child's end wakes that step
        (`wake_parents`). Writes nothing when the step waiting started them (the usual
        case); returns the links moved."""
        return self.sql(f"""
            UPDATE {S}.children c SET parent_job_id = CAST(:job_id AS bigint)
             WHERE c.parent_run_id = CAST(:run_id AS bigint)
               AND c.run_id = ANY(CAST(:run_ids AS bigint[]))
               AND c.parent_job_id <> CAST(:job_id AS bigint)""")

    @cached_property
    def select_descendants(self) -> TextClause:
        """List the descendants of a run (its children, theirs, ...), bounded in depth.

        Every run below run :run_id through `flowq.children`, down to :max_depth levels (a
        guard against a cycle of hand-written links), in run id order."""
        return self.sql(f"""
            WITH RECURSIVE tree(run_id, depth) AS (
                SELECT c.run_id, 1 FROM {S}.children c
                 WHERE c.parent_run_id = CAST(:run_id AS bigint)
              UNION
                SELECT c.run_id, t.depth + 1 FROM tree t
                  JOIN {S}.children c ON c.parent_run_id = t.run_id
                 WHERE t.depth < CAST(:max_depth AS int))
            SELECT DISTINCT run_id FROM tree
             WHERE run_id <> CAST(:run_id AS bigint) ORDER BY run_id""")

    @cached_property
    def select_run_family(self) -> TextClause:
        """Read a run's parent and children (inspection).

        The parent of run :run_id (`kind` 'parent': its run id, the step and map instance
        that started this one) and its first :limit children (`kind` 'child', in run id
        order, each with its derived status; NULL when its rows are gone)."""
        return self.sql(f"""
            SELECT 'parent' AS kind, c.parent_run_id AS run_id, c.parent_step AS step,
                   NULLIF(c.parent_map_index, {NO_MAP_INDEX}) AS map_index, c.name,
                   c.created_at, CAST(NULL AS text) AS status
              FROM {S}.children c WHERE c.run_id = CAST(:run_id AS bigint)
            UNION ALL
            (SELECT 'child', c.run_id, c.parent_step,
                    NULLIF(c.parent_map_index, {NO_MAP_INDEX}), c.name, c.created_at,
                    (SELECT {RUN_STATUS} FROM {S}.steps j WHERE j.run_id = c.run_id
                      HAVING count(*) > 0)
               FROM {S}.children c WHERE c.parent_run_id = CAST(:run_id AS bigint)
              ORDER BY c.run_id LIMIT :limit)""")

    @cached_property
    def select_waited_children(self) -> TextClause:
        """Read the children some jobs wait for (the test kit's drain).

        For each of the jobs :job_ids still in `flowq.jobs`: its status, whether it is due
        (`run_at <= now()`), and each child run linked to it (`parent_job_id`, the step that
        waits) with its status (`RUN_STATUS`; NULL when its rows are gone) and whether its rows
        have all finished; one row per (job, child), the child's columns NULL for a job
        waiting on none. In job, child order."""
        return self.sql(f"""
            SELECT p.id AS job_id, p.status AS job_status, p.run_at <= now() AS due,
                   c.run_id, s.status, s.finished
              FROM {S}.jobs p
              LEFT JOIN {S}.children c ON c.parent_job_id = p.id
              LEFT JOIN LATERAL (
                  SELECT {RUN_STATUS} AS status, {FINISHED} AS finished
                    FROM {S}.steps j WHERE j.run_id = c.run_id HAVING count(*) > 0) s ON true
             WHERE p.id = ANY(CAST(:job_ids AS bigint[]))
             ORDER BY p.id, c.run_id""")

    @cached_property
    def wake_jobs(self) -> TextClause:
        """Make some suspended jobs due now (the test kit's drain).

        Those of the jobs :job_ids that are pending and due later get `run_at = now()`: what
        `wake_parents` does when a child ends, for a waiting parent whose children ended
        without waking it (a cancel, say). Returns their ids."""
        return self.sql(f"""
            UPDATE {S}.jobs SET run_at = now()
             WHERE id = ANY(CAST(:job_ids AS bigint[]))
               AND status = 'pending' AND run_at > now()
            RETURNING id""")
