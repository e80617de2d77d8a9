"""The flowq tables, defined once: migrations, queries and the autogenerate check all use these.

One table, `flowq.jobs`, holds one row per step of a run. A plain task is a run of one step;
a pipeline's next step is a new row inserted in the transaction that completes the previous
one. A run has no row of its own: its id (`run_id`, from its own sequence) is shared by its
steps, its idempotency key sits on its first step, and its state is that of its latest step.
Keeping runs implicit keeps enqueue to one INSERT and completion to one UPDATE.

Every object lives in the schema `flowq` (`DEFAULT_SCHEMA`); another name is applied with
SQLAlchemy's `schema_translate_map` (see `schema_map`), so nothing here is ever rewritten.

What is not a table but is read with them (the statuses, the capabilities workers register,
the notify channels, the constants statements share with the declarations) is
`flowq.db.vocabulary`, re-exported here.
"""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from flowq.db.vocabulary import (
    ACTIVE_STATUSES,
    BATCH_ARGUMENTS,
    CAPABILITIES,
    HISTORY_CAPABILITY,
    HISTORY_PARTITION,
    JOBS_STORAGE_PARAMETERS,
    JOIN_SHARDS,
    JOIN_SHARDS_CAPABILITY,
    LIVENESS_CAPABILITY,
    NO_MAP_INDEX,
    PERMITS_CAPABILITY,
    STATUSES,
    TERMINAL_STATUSES,
    Status,
    metadata,
    notify_channel,
    run_end_channel,
    schema_map,
)
from flowq.db.workflow_tables import (
    batch_id_seq,
    batch_runs,
    batches,
    checkpoints,
    children,
    join_shards,
    joins,
    run_waiters,
    signals,
)

# Defined in flowq.names (a leaf the declarations may import); exported here too for the
# modules that read them beside the tables.
from flowq.names import DEFAULT_SCHEMA, validate_schema_name

__all__ = ["ACTIVE_STATUSES", "BATCH_ARGUMENTS", "CAPABILITIES", "DEFAULT_SCHEMA",
           "HISTORY_CAPABILITY", "HISTORY_PARTITION", "JOBS_STORAGE_PARAMETERS", "JOB_COLUMNS",
           "JOIN_SHARDS", "JOIN_SHARDS_CAPABILITY", "LIVENESS_CAPABILITY", "NO_MAP_INDEX",
           "PERMITS_CAPABILITY", "STATUSES", "TERMINAL_STATUSES", "Status", "batch_id_seq",
           "batch_runs", "batches", "checkpoints", "children", "definitions", "job_history",
           "jobs", "join_shards", "joins", "lease_seq", "metadata", "notify_channel", "permits",
           "queues", "run_end_channel", "run_id_seq", "run_keys", "run_waiters", "schedules",
           "schema_map", "signals", "uniques", "validate_schema_name", "workers"]

run_id_seq = sa.Sequence("run_id_seq", metadata=metadata, schema=DEFAULT_SCHEMA)
# The fence token: every claim draws a new one, so a lease never repeats (see `jobs.lease`).
lease_seq = sa.Sequence("lease_seq", metadata=metadata, schema=DEFAULT_SCHEMA)

jobs = sa.Table(
    "jobs",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
    sa.Column("run_id", sa.BigInteger, run_id_seq, server_default=run_id_seq.next_value(),
              nullable=False),
    sa.Column("task", sa.Text, nullable=False),
    sa.Column("step", sa.Text, nullable=False),
    sa.Column("step_index", sa.SmallInteger, nullable=False, server_default=sa.text("0")),
    sa.Column("queue", sa.Text, nullable=False, server_default=sa.text("'default'")),
    sa.Column("status", sa.Text, nullable=False, server_default=sa.text("'pending'")),
    sa.Column("priority", sa.SmallInteger, nullable=False, server_default=sa.text("0")),
    sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
    sa.Column("max_attempts", sa.Integer, nullable=False, server_default=sa.text("10")),
    sa.Column("args", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("result", JSONB),
    sa.Column("last_error", sa.Text),
    sa.Column("idempotency_key", sa.Text),
    sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("run_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    sa.Column("locked_at", sa.DateTime(timezone=True)),
    sa.Column("heartbeat_at", sa.DateTime(timezone=True)),
    sa.Column("locked_by", sa.Text),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
              server_default=sa.func.now()),
    sa.Column("finished_at", sa.DateTime(timezone=True)),
    # The current claim's fence token, from `lease_seq`; NULL until the first claim. Every
    # write after a claim matches (id, lease), so a worker that lost its claim changes nothing.
    sa.Column("lease", sa.BigInteger),
    # Workflows: the item position of a map instance, and whether a join created the row
    # (its mapped parents' results are collected when it runs).
    sa.Column("map_index", sa.Integer),
    sa.Column("joined", sa.Boolean, nullable=False, server_default=sa.false()),
    # Flow control: the job's concurrency key (JSON text of the argument its task names) and
    # how many jobs of that key may run at once in its queue.
    sa.Column("concurrency_key", sa.Text),
    sa.Column("key_limit", sa.Integer),
    # Periodic schedules: the tick a scheduled run runs for, on the steps it starts with.
    sa.Column("scheduled_at", sa.DateTime(timezone=True)),
    # Tracing (flowq.tracing, revision 0007): the W3C trace context the run was enqueued
    # under, {"traceparent": ..., "tracestate": ...}; copied to the steps it creates.
    sa.Column("trace_context", JSONB),
    # Attempt history (revision 0008): when the latest attempt started (kept from the claim's
    # locked_at when the attempt ends), and the earlier failed attempts, a bounded list
    # appended by the fenced retry and end statements (NULL while no attempt failed).
    sa.Column("started_at", sa.DateTime(timezone=True)),
    sa.Column("attempt_log", JSONB),
    # Progress and forks (revision 0012): the latest `ctx.progress` of the row's attempt,
    # {"done", "total", "message", "at"}, written by the heartbeat; and on a forked run's
    # first row, the run it was forked from (`flowq.ops.fork`).
    sa.Column("progress", JSONB),
    sa.Column("forked_from", sa.BigInteger),
    # Run deadlines (revision 0013): when the run's unfinished steps are cancelled (NULL:
    # never), the same on every row of the run (copied to the steps it creates later).
    sa.Column("deadline", sa.DateTime(timezone=True)),
    # Deploys (revision 0014, flowq.define.shape): the fingerprint of the definition the run
    # started under (NULL: enqueued by name without it, or before 0014); copied to the steps
    # it creates, like `trace_context`.
    sa.Column("fingerprint", sa.Text),
    sa.CheckConstraint(
        "status IN ('pending', 'running', 'succeeded', 'dead', 'cancelled', 'waiting')",
        name="jobs_status_check",
    ),
    sa.CheckConstraint("attempts >= 0 AND max_attempts >= 1", name="jobs_attempts_check"),
    # The claim reads only this index: one queue, by priority then due time. Being partial,
    # it holds the backlog only, however many finished rows are retained.
    sa.Index("jobs_pending_idx", "queue", "priority", "run_at", "id",
             postgresql_where=sa.text("status = 'pending'")),
    # The reaper's scan: only running rows, ordered by heartbeat age.
    sa.Index("jobs_running_idx", "heartbeat_at", postgresql_where=sa.text("status = 'running'")),
    # Run inspection and control, and the pruner's "whole run finished" check.
    sa.Index("jobs_run_id_idx", "run_id"),
    # The pruner's scan over finished rows.
    sa.Index("jobs_finished_idx", "finished_at",
             postgresql_where=sa.text("status IN ('succeeded', 'dead', 'cancelled')")),
    # Waiting steps by timeout: the reaper makes the expired ones runnable.
    sa.Index("jobs_waiting_idx", "run_at", postgresql_where=sa.text("status = 'waiting'")),
    # An idempotency key names a run: one per schema, held by the run's first step.
    sa.Index("jobs_idempotency_key_idx", "idempotency_key", unique=True,
             postgresql_where=sa.text("idempotency_key IS NOT NULL")),
    # Dead jobs by task and queue (`flowq status`), without reading the retained finished rows.
    sa.Index("jobs_dead_idx", "task", "queue", postgresql_where=sa.text("status = 'dead'")),
    # The reaper's deadline pass (flowq.db.sql.deadlines): only rows with a deadline that a
    # cancellation still changes, so it stays as small as the runs that have one.
    sa.Index("jobs_deadline_idx", "deadline", postgresql_where=sa.text(
        "deadline IS NOT NULL AND status IN ('pending', 'running', 'waiting') "
        "AND NOT cancel_requested")),
)

# Finished steps (revision 0018): a row leaves `jobs` in the statement (or the trigger) that
# gives it a terminal status and is written here with the same columns, plus `retired_at`,
# the time it moved: the partition key. Partitioned by day (`flowq.db.history`), with a DEFAULT
# partition so that a completion never waits for maintenance; retention drops whole
# partitions instead of deleting rows. So `jobs` holds only live rows, its heap and indexes
# stay the size of the backlog, and vacuum's work there is bounded by live jobs whatever is
# retained. Only the indexes the readers of finished rows need: by id and retirement (the
# primary key, which must hold the partition key), by run, by finish time (recent activity),
# and dead rows by run. `steps` (a view) reads both tables.
job_history = sa.Table(
    "job_history",
    metadata,
    *(sa.Column(c.name, c.type, nullable=c.nullable, primary_key=c.primary_key,
                autoincrement=False) for c in jobs.columns),
    sa.Column("retired_at", sa.DateTime(timezone=True), primary_key=True,
              server_default=sa.func.now()),
    sa.Index("job_history_run_id_idx", "run_id"),
    sa.Index("job_history_finished_idx", "finished_at"),
    # Dead runs in run id order (a page of `runs list --status dead`, a bulk redrive), and
    # the dead counts and dead rows by task and queue, index-only (revision 0019; 0020
    # dropped the (task, queue) index it made redundant).
    sa.Index("job_history_dead_run_idx", "run_id", postgresql_include=["task", "queue"],
             postgresql_where=sa.text("status = 'dead'")),
    postgresql_partition_by="RANGE (retired_at)",
)

# The idempotency keys of runs (revision 0018): a key names its run for as long as the run is
# retained. A run's first step leaves `jobs` when it ends, and a partitioned `job_history`
# cannot hold a unique index without its partition key, so the keys have their own table,
# written by the keyed enqueue (its INSERT ... ON CONFLICT DO NOTHING is where two enqueues
# of one key meet), and by the move to history of a keyed row that has none (a run enqueued
# by an earlier release); pruned with the run.
run_keys = sa.Table(
    "run_keys",
    metadata,
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("run_id", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
              server_default=sa.func.now()),
    sa.Index("run_keys_run_id_idx", "run_id"),
)

# The columns of a job row, in `jobs`' order: what moves a row to `job_history` lists.
JOB_COLUMNS: Final[str] = ", ".join(c.name for c in jobs.columns)


# The live workers: one row per worker process, registered at start, heartbeated, deleted at
# a clean stop and expired by the reaper after a crash. What they serve tells which due jobs
# no live worker serves.
workers = sa.Table(
    "workers",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("host", sa.Text, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("queues", ARRAY(sa.Text), nullable=False),
    sa.Column("tasks", ARRAY(sa.Text), nullable=False),
    sa.Column("concurrency", sa.Integer, nullable=False),
    sa.Column("version", sa.Text, nullable=False),
    sa.Column("started_at", sa.DateTime(timezone=True), nullable=False,
              server_default=sa.func.now()),
    sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False,
              server_default=sa.func.now()),
    # What this worker's code understands of the shared tables (revision 0009), NULL for a
    # worker of an earlier release (`CAPABILITIES`): a change of how workers share a table
    # is used only while every registered worker understands it.
    sa.Column("capabilities", ARRAY(sa.Text)),
    # What it serves (revision 0014): {pipeline: [{"version": N, "fingerprint": F}, ...]};
    # NULL for a worker of an earlier release. The shapes are in `definitions`.
    sa.Column("definitions", JSONB),
    # The leases of the claims it holds, written by its heartbeat (revision 0017): a running
    # job is alive while its own heartbeat_at is recent, or this entry is and lists its
    # lease. NULL: none written (an earlier release, or no beat since it registered).
    sa.Column("leases", ARRAY(sa.BigInteger)),
)

# Every definition a worker ever served (revision 0014): its shape by fingerprint, written
# once per fingerprint at worker start (ON CONFLICT DO NOTHING), so that the deploy check
# knows the shape a run in flight started under after the code that served it stopped.
definitions = sa.Table(
    "definitions",
    metadata,
    sa.Column("fingerprint", sa.Text, primary_key=True),
    sa.Column("pipeline", sa.Text, nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("shape", JSONB, nullable=False),
    sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False,
              server_default=sa.func.now()),
)


# Declared queues: limits enforced in the claim, pause. See flowq.queues.
queues = sa.Table(
    "queues",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("concurrency", sa.Integer),
    sa.Column("rate_limit", sa.Integer),
    sa.Column("rate_period", sa.Float(precision=53)),
    sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("keyed", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("tokens", sa.Float(precision=53)),
    sa.Column("refilled_at", sa.DateTime(timezone=True)),
    sa.Column("declared_at", sa.DateTime(timezone=True)),
    sa.Column("declared_by", sa.Text),
    sa.CheckConstraint("concurrency IS NULL OR concurrency >= 1",
                       name="queues_concurrency_check"),
    sa.CheckConstraint("(rate_limit IS NULL) = (rate_period IS NULL) AND "
                       "(rate_limit IS NULL OR (rate_limit >= 1 AND rate_period > 0))",
                       name="queues_rate_check"),
)

# Uniqueness while active: the run holding each key (taken over once that run finished).
uniques = sa.Table(
    "uniques",
    metadata,
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("run_id", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
              server_default=sa.func.now()),
    # The pruner deletes the keys of the runs it prunes.
    sa.Index("uniques_run_id_idx", "run_id"),
)

# Periodic schedules: the last tick enqueued (each tick once, by an idempotency key).
schedules = sa.Table(
    "schedules",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("task", sa.Text, nullable=False),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("last_tick", sa.DateTime(timezone=True)),
    sa.Column("last_run_id", sa.BigInteger),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False,
              server_default=sa.func.now()),
)


# A concurrency-limited queue's permits (revision 0010, see flowq.db.sql.queues): each row is
# what one worker holds of a queue's `concurrency`. A worker leases them in batches under the
# queue's row lock, claims under them locking only its own row (`FOR SHARE`), and returns
# them when idle and at shutdown; a worker that stopped beating loses them at the next lease.
# `concurrency` is the limit they were leased under: a changed declaration voids them.
permits = sa.Table(
    "permits",
    metadata,
    sa.Column("queue", sa.Text, primary_key=True),
    sa.Column("worker", sa.Text, primary_key=True),
    sa.Column("held", sa.Integer, nullable=False),
    sa.Column("concurrency", sa.Integer, nullable=False),
    sa.Column("leased_at", sa.DateTime(timezone=True), nullable=False,
              server_default=sa.func.now()),
    sa.CheckConstraint("held >= 0", name="permits_held_check"),
)
