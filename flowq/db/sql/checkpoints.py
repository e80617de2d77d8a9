"""The statements of `flowq.checkpoints`: what a step records inside its handler.

A checkpoint is recorded fenced on the claim, like every write after it: the record takes
the job's row lock through the fence (`FENCE`, by primary key, `FOR NO KEY UPDATE`), so a
worker that lost its claim (reaped, released, cancelled) records nothing, and the reaper
cannot requeue the row between the check and the commit. The record is sent in the
transaction of the checkpoint's own session, so the writes the checkpoint made there commit
with it, or neither does. `map_index` is stored as `NO_MAP_INDEX` outside a mapped step.
"""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.schema import NO_MAP_INDEX
from flowq.db.sql.fragments import (
    CLAIM_KEY,
    FENCE,
    UNLOCK,
    S,
    Statements,
    notify_ended_row,
    rows,
)

__all__ = ["CheckpointStatements"]



def step_key(alias: str) -> str:
    """The key of one step's checkpoints (a map instance's own), from :run_id, :step and
    :map_index, on the checkpoints row `alias`."""
    return f"""{alias}.run_id = CAST(:run_id AS bigint) AND {alias}.step = CAST(:step AS text)
               AND {alias}.map_index = COALESCE(CAST(:map_index AS int), {NO_MAP_INDEX})"""

# The claim, locked through its fence: a CTE `fenced` of one row while the claim is ours.
FENCED = f"""fenced AS (
                SELECT j.id FROM {S}.jobs j, {rows("c", CLAIM_KEY, single=True)}
                 WHERE {FENCE}
                   FOR NO KEY UPDATE OF j)"""


# A sleep's deadline: :until, else `now()` plus :sleep seconds; written as ISO 8601 in UTC
# with six fraction digits whatever the session's time zone (Python 3.10 parses only that).
UNTIL = """COALESCE(CAST(:until AS timestamptz),
                            now() + make_interval(secs => CAST(:sleep AS float8)))"""
ISO_UTC = """to_char({when} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')"""


class CheckpointStatements(Statements):
    """The statements of `flowq.checkpoints`, for one schema."""

    @cached_property
    def select_checkpoints(self) -> TextClause:
        """Read one step's checkpoints, with the database's clock.

        The checkpoints of (:run_id, :step, :map_index), in position order, each with the
        database's `now()` (a durable sleep returns once its deadline is past it); one row
        of NULLs but the clock when there are none."""
        return self.sql(f"""
            SELECT k.name, k.position, k.result::text AS result, n.now
              FROM (SELECT now() AS now) n
              LEFT JOIN {S}.checkpoints k ON {step_key("k")}
             ORDER BY k.position, k.name""")

    @cached_property
    def record_checkpoint(self) -> TextClause:
        """Record one checkpoint of a running claim, fenced.

        Insert checkpoint :name at :position with :result (JSON text, or, with :sleep set,
        a sleep's deadline `{"until": ...}`: :until, else `now()` plus :sleep seconds) for
        (:run_id, :step, :map_index), only while the claim (:id, :lease) is ours, its row
        locked until the caller's transaction ends; the stored result, or no row."""
        return self.sql(f"""
            WITH {FENCED}
            INSERT INTO {S}.checkpoints (run_id, step, map_index, name, position, result)
            SELECT CAST(:run_id AS bigint), CAST(:step AS text),
                   COALESCE(CAST(:map_index AS int), {NO_MAP_INDEX}), CAST(:name AS text),
                   CAST(:position AS int),
                   CASE WHEN CAST(:sleep AS float8) IS NULL THEN CAST(:result AS jsonb)
                        ELSE jsonb_build_object('until', {ISO_UTC.format(when=UNTIL)}) END
              FROM fenced
            ON CONFLICT (run_id, step, map_index, name) DO UPDATE
               SET result = excluded.result, position = excluded.position
            RETURNING result::text AS result""")

    @cached_property
    def suspend_job(self) -> TextClause:
        """Send a running claim back to pending until a time, giving its attempt back, fenced.

        A durable sleep, a snooze, or a job this worker's definition cannot run left to
        another live worker's (`flowq.worker.resolution.resolve`, with :note as its
        `last_error`): back to `pending` (or `cancelled` if its run was cancelled meanwhile)
        due at :until (else `now()` plus :delay seconds), its attempt given back (a
        suspension is not a failure), nothing appended to `attempt_log`.
        With :snoozes set, the step's snooze count is stored as checkpoint `flowq.snoozes`
        of :step in the same statement. A job ended `cancelled` announces its run's end to
        `flowq.wait_run` (`notify_ended_row`). Returns the new status and run_at, or nothing
        if the claim is no longer ours."""
        return self.sql(f"""
            WITH moved AS (
                UPDATE {S}.jobs j
                   SET status = CASE WHEN j.cancel_requested THEN 'cancelled'
                                     ELSE 'pending' END,
                       finished_at = CASE WHEN j.cancel_requested THEN now() END,
                       attempts = greatest(j.attempts - 1, 0),
                       run_at = COALESCE(CAST(:until AS timestamptz),
                                         now() + make_interval(secs => CAST(:delay AS float8))),
                       last_error = COALESCE(CAST(:note AS text), j.last_error),
                       {UNLOCK}
                  FROM {rows("c", CLAIM_KEY, single=True)}
                 WHERE {FENCE}
                RETURNING j.run_id, j.map_index, j.status, j.run_at,
                          {notify_ended_row("j.status = 'cancelled'")} AS ended
            ), counted AS (
                INSERT INTO {S}.checkpoints AS k (run_id, step, map_index, name, position,
                                                  result)
                SELECT m.run_id, CAST(:step AS text), COALESCE(m.map_index, {NO_MAP_INDEX}),
                       'flowq.snoozes', -1, to_jsonb(CAST(:snoozes AS int))
                  FROM moved m WHERE CAST(:snoozes AS int) IS NOT NULL
                ON CONFLICT (run_id, step, map_index, name) DO UPDATE SET result = excluded.result
            )
            SELECT status, run_at, ended FROM moved""")

    @cached_property
    def select_run_checkpoints(self) -> TextClause:
        """List the checkpoints of a run (inspection).

        Every checkpoint of run :run_id, by step, map instance and position, at most
        :limit (a step recording thousands is shown in part)."""
        return self.sql(f"""
            SELECT step, NULLIF(map_index, {NO_MAP_INDEX}) AS map_index, name, position,
                   result::text AS result, created_at
              FROM {S}.checkpoints
             WHERE run_id = CAST(:run_id AS bigint)
             ORDER BY step, map_index, position, name
             LIMIT :limit""")

    @cached_property
    def copy_checkpoints(self) -> TextClause:
        """Copy some of a step's checkpoints to a forked run (`flowq.runs.fork`).

        The checkpoints named :names of (:source_run_id, :step, outside a map) recorded
        again, unchanged (position, result, when), for run :run_id: the fork's step finds
        them recorded and returns their results instead of running them. Written in the
        fork's transaction, before its first row can be claimed; returns the names copied."""
        return self.sql(f"""
            INSERT INTO {S}.checkpoints (run_id, step, map_index, name, position, result,
                                         created_at)
            SELECT CAST(:run_id AS bigint), k.step, k.map_index, k.name, k.position, k.result,
                   k.created_at
              FROM {S}.checkpoints k
             WHERE k.run_id = CAST(:source_run_id AS bigint) AND k.step = CAST(:step AS text)
               AND k.map_index = {NO_MAP_INDEX} AND k.name = ANY(CAST(:names AS text[]))
            ON CONFLICT (run_id, step, map_index, name) DO NOTHING
            RETURNING name""")
