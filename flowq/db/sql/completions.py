"""A success written, fenced: the completion statements of plain jobs, of chains and of workflows.

Every statement here marks claims succeeded on (id, lease) and `running`, creates what the
successes spawn (only for a claim that landed, in a run not cancelled meanwhile), wakes the
parents of children that ended, and names the runs that ended for `flowq.wait_run`'s waiters.
A single claim is written with the one-row shape (a primary-key lookup), a batch with `unnest`.
"""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.schema import HISTORY_CAPABILITY, JOIN_SHARDS, JOIN_SHARDS_CAPABILITY
from flowq.db.sql.children import wake_parents
from flowq.db.sql.fragments import (
    CLAIM_KEY,
    SPAWN,
    SUCCESSOR,
    UNLOCK,
    UNLOCKED,
    S,
    Statements,
    copy_rows,
    fence,
    notify_ended,
    notify_new,
    registered_without,
    rows,
)

__all__ = ["CompletionStatements"]

# The runs of a completion's successes that created nothing (a run's last step, a cancelled
# run, a join still waiting for its other parents): `notify_ended` names them.
ENDED = """SELECT d.run_id FROM done d
                  WHERE NOT EXISTS (SELECT 1 FROM inserted i WHERE i.run_id = d.run_id)"""


def succeed(single: bool) -> str:
    """Mark claims succeeded with their results (`c(id, lease, result)`, batch or single),
    fenced; every completing statement starts with it: CTEs ending in `done`, the rows that
    were still ours. A success is the common end, so it moves its row to `job_history`
    itself (a DELETE and an INSERT: no new version of the row in `jobs`), where every other
    end relies on the trigger `jobs_retire` (revision 0018). While a worker of an earlier
    release is registered (`HISTORY_CAPABILITY`), the row is updated in place instead, as
    before, and stays in `jobs` (the trigger leaves it there too)."""
    claims = rows("c", (*CLAIM_KEY, ("result", "jsonb")), single=single)
    ends = {"status": "'succeeded'", "result": "g.new_result", "finished_at": "now()",
            "started_at": "g.locked_at", **UNLOCKED}
    done = ("id, lease, run_id, priority, cancel_requested, trace_context, fingerprint, "
            "step, map_index, deadline")
    return f"""history AS (
                SELECT NOT {registered_without(HISTORY_CAPABILITY)} AS moves
            ), gone AS (
                DELETE FROM {S}.jobs j
                 USING {claims}
                 WHERE {fence(single)} AND (SELECT moves FROM history)
                RETURNING j.*, c.result AS new_result
            ), retired AS ({copy_rows("job_history", "gone g", ends)}
            ), kept_keys AS (
                -- A run an earlier release enqueued has its key on its row only.
                INSERT INTO {S}.run_keys (key, run_id)
                SELECT idempotency_key, run_id FROM gone WHERE idempotency_key IS NOT NULL
                ON CONFLICT (key) DO NOTHING
            ), stayed AS (
                UPDATE {S}.jobs j
                   SET status = 'succeeded', result = c.result, finished_at = now(),
                       started_at = j.locked_at, {UNLOCK}
                  FROM {claims}
                 WHERE {fence(single)} AND NOT (SELECT moves FROM history)
                RETURNING j.{done.replace(", ", ", j.")}
            ), done AS (
                SELECT {done} FROM gone UNION ALL SELECT {done} FROM stayed)"""


class CompletionStatements(Statements):
    """The completion statements, for one schema."""

    def _complete(self, *, single: bool) -> TextClause:
        return self.sql(f"""
            WITH {succeed(single)}, {wake_parents("done")}
            SELECT id, cancel_requested,
                   {notify_ended("SELECT run_id FROM done")} AS ended
              FROM done""")

    @cached_property
    def complete_jobs(self) -> TextClause:
        """Mark a batch of claims succeeded, fenced.

        Mark claims (:ids, :leases) succeeded with :results; returns the rows that were
        still ours (with whether their run was cancelled meanwhile). Their runs may have
        ended: one notification names them (`fragments.notify_ended`)."""
        return self._complete(single=False)

    @cached_property
    def complete_job(self) -> TextClause:
        """Mark one claim succeeded, fenced, by primary key.

        `complete_jobs` for one claim (:id, :lease, :result), by primary key: what a
        `ctx.session` handler's own transaction sends."""
        return self._complete(single=True)

    def _complete_steps(self, *, single: bool) -> TextClause:
        # Successors are always a batch: one success may create many (a map's instances).
        successors = rows("n", SUCCESSOR, single=False, prefix="next_")
        return self.sql(f"""
            WITH {succeed(single)}, {wake_parents("done")}, inserted AS (
                INSERT INTO {S}.jobs (run_id, task, step, step_index, queue, priority,
                                        max_attempts, args, map_index, run_at, trace_context,
                                        deadline, fingerprint)
                SELECT d.run_id, n.task, n.step, n.step_index, n.queue, d.priority,
                       n.max_attempts, n.args, n.map_index,
                       now() + make_interval(secs => n.delay), d.trace_context, d.deadline,
                       d.fingerprint
                  FROM done d JOIN {successors} ON n.id = d.id AND n.lease = d.lease
                 WHERE NOT d.cancel_requested
                RETURNING run_id, queue, run_at
            )
            SELECT d.id, d.cancel_requested, {notify_new("inserted")} AS woken,
                   {notify_ended(ENDED)} AS ended
              FROM done d""")

    @cached_property
    def complete_steps(self) -> TextClause:
        """Mark a batch of claims succeeded and create their pipeline successors.

        `complete_jobs` plus, in the same statement, the steps the successes create (a
        chain's next step, a map's instances; `:next_ids`, `:next_leases` name the claim each
        follows; none when the run was cancelled meanwhile), waking the workers of their
        queues. One statement, so it is atomic even in autocommit: no step is ever done
        without its successors, nor a successor created for a step that was not ours."""
        return self._complete_steps(single=False)

    @cached_property
    def complete_step(self) -> TextClause:
        """Mark one claim succeeded and create its pipeline successors.

        `complete_steps` for one claim (`:id`, `:lease`, `:result`), by primary key (see
        `complete_job`)."""
        return self._complete_steps(single=True)

    def _complete_flow(self, *, single: bool) -> TextClause:
        spawns = rows("n", SPAWN, single=False, prefix="next_")
        waits = "r.signal IS NOT NULL AND m.sent_at IS NULL"
        return self.sql(f"""
            WITH {succeed(single)}, {wake_parents("done")}, spawn AS (
                SELECT d.run_id, d.priority, d.trace_context, d.fingerprint,
                       d.step AS done_step,
                       d.map_index AS instance, d.deadline, n.*
                  FROM done d JOIN {spawns} ON n.id = d.id AND n.lease = d.lease
                 WHERE NOT d.cancel_requested
            ), shares AS (
                -- Each share in a join: an instance of a map counted in shards takes its
                -- shard (whose row the map's success created, so the snapshot sees it); a
                -- large map counts in shards only while every registered worker does.
                SELECT s.run_id, s.step, s.parents, s.delta, s.source, s.input, x.shard,
                       s.done_step,
                       CASE WHEN s.mapped IS NOT NULL
                                 AND NOT {registered_without(JOIN_SHARDS_CAPABILITY)}
                            THEN s.mapped END AS mapped,
                       s.items
                  FROM spawn s LEFT JOIN {S}.join_shards x
                    ON s.instance IS NOT NULL AND x.run_id = s.run_id AND x.step = s.step
                   AND x.parent = s.done_step AND x.shard = s.instance % {JOIN_SHARDS}
                 WHERE s.parents > 0
            ), split AS (
                -- A map counted in shards: instance i counts on shard i % {JOIN_SHARDS}.
                INSERT INTO {S}.join_shards (run_id, step, parent, shard, remaining)
                SELECT s.run_id, s.step, s.mapped, g.shard,
                       (s.items - g.shard + {JOIN_SHARDS} - 1) / {JOIN_SHARDS}
                  FROM shares s
                 CROSS JOIN generate_series(0, least(s.items, {JOIN_SHARDS}) - 1) AS g(shard)
                 WHERE s.mapped IS NOT NULL
            ), sharded AS (
                INSERT INTO {S}.join_shards AS x (run_id, step, parent, shard, remaining)
                SELECT run_id, step, done_step, shard, sum(delta)
                  FROM shares WHERE shard IS NOT NULL
                 GROUP BY run_id, step, done_step, shard
                 ORDER BY run_id, step, done_step, shard  -- one lock order, as for `counted`
                ON CONFLICT (run_id, step, parent, shard) DO UPDATE
                   SET remaining = x.remaining + excluded.remaining
                RETURNING run_id, step, remaining
            ), units AS (
                -- What the join's own row counts: every other share (a map counted in
                -- shards as one unit per shard), and one unit per shard brought to zero.
                SELECT run_id, step, parents,
                       CASE WHEN mapped IS NOT NULL THEN least(items, {JOIN_SHARDS}) - 1
                            ELSE delta END AS delta,
                       source, input
                  FROM shares WHERE shard IS NULL
                UNION ALL
                SELECT h.run_id, h.step, p.parents, -1, NULL, NULL
                  FROM sharded h
                  JOIN (SELECT DISTINCT run_id, step, parents FROM shares
                         WHERE shard IS NOT NULL) p ON p.run_id = h.run_id AND p.step = h.step
                 WHERE h.remaining = 0
            ), counted AS (
                INSERT INTO {S}.joins (run_id, step, parents, remaining, inputs)
                SELECT run_id, step, max(parents), max(parents) + sum(delta),
                       COALESCE(jsonb_object_agg(source, input)
                                FILTER (WHERE source IS NOT NULL), '{{}}'::jsonb)
                  FROM units
                 GROUP BY run_id, step
                 ORDER BY run_id, step  -- one lock order for every batch: fewer deadlocks
                ON CONFLICT (run_id, step) DO UPDATE
                   SET remaining = joins.remaining + excluded.remaining - excluded.parents,
                       inputs = joins.inputs || excluded.inputs
                RETURNING run_id, step, remaining, inputs
            ), ready AS (
                SELECT run_id, priority, task, step, step_index, queue, max_attempts, args,
                       map_index, delay, signal, wait, false AS joined, trace_context,
                       deadline, fingerprint
                  FROM spawn WHERE parents = 0
                UNION ALL
                SELECT * FROM (
                    SELECT DISTINCT ON (s.run_id, s.step)
                           s.run_id, s.priority, s.task, s.step, s.step_index, s.queue,
                           s.max_attempts, c.inputs, NULL::int, s.delay, s.signal, s.wait, true,
                           s.trace_context,  -- the context of the parent completing the join
                           s.deadline, s.fingerprint
                      FROM spawn s JOIN counted c ON c.run_id = s.run_id AND c.step = s.step
                     WHERE s.parents > 0 AND c.remaining = 0) joined
            ), met AS (
                INSERT INTO {S}.signals (run_id, name, step, timeout_s, reached_at)
                SELECT run_id, signal, step, wait, now() FROM ready WHERE signal IS NOT NULL
                ON CONFLICT (run_id, name) DO UPDATE
                   SET step = excluded.step, timeout_s = excluded.timeout_s,
                       reached_at = excluded.reached_at
                RETURNING run_id, name, payload, sent_at
            ), inserted AS (
                INSERT INTO {S}.jobs (run_id, task, step, step_index, queue, priority,
                                        max_attempts, args, map_index, joined, status, run_at,
                                        trace_context, deadline, fingerprint)
                SELECT r.run_id, r.task, r.step, r.step_index, r.queue, r.priority,
                       r.max_attempts,
                       CASE WHEN m.sent_at IS NULL THEN r.args
                            ELSE r.args || jsonb_build_object(r.signal, m.payload) END,
                       r.map_index, r.joined,
                       CASE WHEN {waits} THEN 'waiting' ELSE 'pending' END,
                       now() + make_interval(secs => CASE WHEN {waits} THEN r.wait
                                                          ELSE r.delay END),
                       r.trace_context, r.deadline, r.fingerprint
                  FROM ready r LEFT JOIN met m ON m.run_id = r.run_id AND m.name = r.signal
                RETURNING run_id, queue, status, run_at
            )
            SELECT d.id, d.cancel_requested,
                   {notify_new("inserted WHERE status = 'pending'")} AS woken,
                   {notify_ended(ENDED)} AS ended
              FROM done d""")

    @cached_property
    def complete_flows(self) -> TextClause:
        """Mark a batch of claims succeeded and apply their workflow spawns.

        `complete_steps` for workflows: besides the steps created at once, each success
        adds its share to the counters of the joins it is a parent of (`flowq.joins`; the
        success that brings one to zero creates that step, exactly once, even when two
        parents complete at the same instant: the counter row serializes them), and a step
        that waits for a signal meets it on `flowq.signals` (created `waiting` until its
        timeout, or `pending` with the payload if it was already sent)."""
        return self._complete_flow(single=False)

    @cached_property
    def complete_flow(self) -> TextClause:
        """Mark one claim succeeded and apply its workflow spawns.

        `complete_flows` for one claim, by primary key."""
        return self._complete_flow(single=True)
