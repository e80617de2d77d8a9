"""The tables of workflow state beside the queue: joins, signals, checkpoints, batches, children.

A run's steps are rows of `flowq.jobs` (`flowq.db.schema`); what a workflow keeps between
them lives here: the counters of a join and of a large map's shards, the signals sent and
awaited, a step's checkpoints and durable sleeps, `session.batch()`'s batches and their
runs, the child runs a step started, and who waits for a run's end. Declared on the same
`metadata` as every flowq table; `flowq.db.schema` re-exports them.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

from flowq.db.vocabulary import metadata
from flowq.names import DEFAULT_SCHEMA

__all__ = ["batch_id_seq", "batch_runs", "batches", "checkpoints", "children", "join_shards",
           "joins", "run_waiters", "signals"]


# One counter per join step of a run: the parent units still to succeed (a parent, or each
# instance of a mapped parent), and the static parents' results so far. Updated with
# INSERT ... ON CONFLICT DO UPDATE, which always sees the newest row: so two parents completing
# at the same instant are serialized on it, and exactly one of them sees zero.
joins = sa.Table(
    "joins",
    metadata,
    sa.Column("run_id", sa.BigInteger, primary_key=True),
    sa.Column("step", sa.Text, primary_key=True),
    sa.Column("parents", sa.Integer, nullable=False),
    sa.Column("remaining", sa.Integer, nullable=False),
    sa.Column("inputs", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
)

# The instance counters of a large map (revision 0009): the instances of mapped step `parent`
# of a run count down, for join `step`, on `JOIN_SHARDS` rows instead of the join's one row
# (instance i on shard i % JOIN_SHARDS), so that completing instances do not all wait for
# one row lock: a map of `ctx.session` instances committed one by one ran at 0.29x the
# same jobs as plain tasks. The join's own row counts each shard as one unit; the
# instance that brings a shard to zero takes that unit off it, so exactly one completion
# still sees the join reach zero. Upserted like `joins` (one lock order per batch).
join_shards = sa.Table(
    "join_shards",
    metadata,
    sa.Column("run_id", sa.BigInteger, primary_key=True),
    sa.Column("step", sa.Text, primary_key=True),
    sa.Column("parent", sa.Text, primary_key=True),
    sa.Column("shard", sa.SmallInteger, primary_key=True),
    sa.Column("remaining", sa.Integer, nullable=False),
)

# One row per (run, signal name), written by whichever comes first: the sender (payload,
# sent_at) or the step that waits for it (step, timeout_s, reached_at). Both upsert on the
# primary key, so the second always sees the first, even when both commit at once.
signals = sa.Table(
    "signals",
    metadata,
    sa.Column("run_id", sa.BigInteger, primary_key=True),
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("payload", JSONB),
    sa.Column("sent_at", sa.DateTime(timezone=True)),
    sa.Column("step", sa.Text),
    sa.Column("timeout_s", sa.Float(precision=53)),
    sa.Column("reached_at", sa.DateTime(timezone=True)),
)

# What a step recorded inside its handler (revision 0011, see flowq.durable): one row per
# (run, step, map instance, name), the result of a `ctx.checkpoint`, a durable sleep's
# deadline, a step's snooze count. `map_index` is `NO_MAP_INDEX` outside a mapped step (a
# primary key column cannot be NULL); the reads give NULL back. Written fenced on the claim,
# in the transaction of the checkpoint's own session; pruned with the run.
checkpoints = sa.Table(
    "checkpoints",
    metadata,
    sa.Column("run_id", sa.BigInteger, primary_key=True),
    sa.Column("step", sa.Text, primary_key=True),
    sa.Column("map_index", sa.Integer, primary_key=True),
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("position", sa.Integer, nullable=False),
    sa.Column("result", JSONB, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
              server_default=sa.func.now()),
)

# Batches (revision 0013, see flowq.enqueueing.batch): the runs a `session.batch()` block
# enqueued, and the callback enqueued once they have all finished. The block draws the id
# from `batch_id_seq` when it opens and writes both tables when it closes, in the caller's
# transaction (a rollback leaves no batch). The reaper's pass deletes each `batch_runs` row
# once its run has finished, adding the run's end to the batch's counts; the pass that
# finds the counts complete stamps `fired_at` and enqueues the callback, in one statement
# that locks the batch's row (exactly once). The callback is stored as the row enqueue
# would insert (checked when the block opened); its arguments get `batch_id` and the counts.
batch_id_seq = sa.Sequence("batch_id_seq", metadata=metadata, schema=DEFAULT_SCHEMA)
batches = sa.Table(
    "batches",
    metadata,
    sa.Column("id", sa.BigInteger, primary_key=True),
    sa.Column("task", sa.Text, nullable=False),
    sa.Column("step", sa.Text, nullable=False),
    sa.Column("queue", sa.Text, nullable=False),
    sa.Column("priority", sa.SmallInteger, nullable=False),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("args", JSONB, nullable=False),
    sa.Column("runs", sa.Integer, nullable=False),
    sa.Column("succeeded", sa.Integer, nullable=False, server_default=sa.text("0")),
    sa.Column("dead", sa.Integer, nullable=False, server_default=sa.text("0")),
    sa.Column("cancelled", sa.Integer, nullable=False, server_default=sa.text("0")),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
              server_default=sa.func.now()),
    sa.Column("fired_at", sa.DateTime(timezone=True)),
    sa.Column("callback_run_id", sa.BigInteger),
    # The batches whose callback is still to come: what the pass reads.
    sa.Index("batches_open_idx", "id", postgresql_where=sa.text("fired_at IS NULL")),
    # The fired ones by age: the pruner deletes them after the retention.
    sa.Index("batches_fired_idx", "fired_at", postgresql_where=sa.text("fired_at IS NOT NULL")),
)
batch_runs = sa.Table(
    "batch_runs",
    metadata,
    sa.Column("batch_id", sa.BigInteger, primary_key=True),
    sa.Column("run_id", sa.BigInteger, primary_key=True),
)

# Which runs a step started with `ctx.start_child` (revision 0015, see flowq.children): one
# row per child run, naming its parent's run, step and map instance (`NO_MAP_INDEX` outside a
# mapped step), the job woken by the child's completion (that step's, or a later step's that
# waits for it) and the checkpoint that
# started it. Written with the child's enqueue and that
# checkpoint, in one transaction; pruned with the parent.
children = sa.Table(
    "children",
    metadata,
    sa.Column("run_id", sa.BigInteger, primary_key=True),
    sa.Column("parent_run_id", sa.BigInteger, nullable=False),
    sa.Column("parent_step", sa.Text, nullable=False),
    sa.Column("parent_map_index", sa.Integer, nullable=False),
    sa.Column("parent_job_id", sa.BigInteger, nullable=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
              server_default=sa.func.now()),
    sa.Index("children_parent_idx", "parent_run_id"),
)

# Who waits for a run's end (revision 0016, flowq.ops.results): one row per `wait_run` in
# progress, naming the run, a token of that wait, and the backend pid of the process's LISTEN
# connection. A completion announces a run's end on the run-end channel only when a row
# names the run, so a run nobody waits for costs no NOTIFY (whose commit takes a lock every
# notifying transaction of the database queues on). Deleted by the wait when it returns;
# rows of a LISTEN connection that no longer exists are deleted by the pruner.
run_waiters = sa.Table(
    "run_waiters",
    metadata,
    sa.Column("run_id", sa.BigInteger, primary_key=True),
    sa.Column("token", sa.Text, primary_key=True),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
              server_default=sa.func.now()),
)
