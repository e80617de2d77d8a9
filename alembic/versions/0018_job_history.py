"""Job history: finished steps leave `flowq.jobs` for `flowq.job_history`; run keys.

`flowq.jobs` keeps the live rows only (pending, running, waiting). A row that reaches a
terminal status (succeeded, dead, cancelled) moves to `flowq.job_history` in the same
transaction: the completion's own statement deletes it and writes it there, and the trigger
`jobs_retire` moves any other row that is inserted or updated into a terminal status (the
other end statements, a worker of the previous release, an operator's UPDATE). So every
writer keeps the rule without knowing it. `job_history` is partitioned by range on
`retired_at`, by day (`flowq.db.history` creates the days ahead; a DEFAULT partition takes
what comes before), so retention drops whole days. `flowq.steps` reads both tables, with the
same columns (and `retired_at`, NULL for a live row). `flowq.run_keys` holds the idempotency
keys of runs, for as long as the run is retained (the trigger also records the key of a
keyed row it moves, for a run enqueued by the previous release).

Online: a worker of the previous release reads finished rows from `jobs` only (a join's
mapped results, a child's end, a batch's runs), so while one is registered (it lacks the
capability `job_history`, revision 0009's mechanism) nothing moves: rows end in `jobs` as
before, and this release reads both tables. Once the last one is gone, ends move their rows
and the maintenance pass moves the rest.

Expand-only, and cheap: new tables, a view, a function and a trigger; no row moves here
(the maintenance pass moves the finished rows already in `jobs`, in batches, and the view
shows them meanwhile). The keys of runs already in `jobs` are copied to `run_keys`. The
indexes of `jobs` on finished rows stay for the previous release.

The view and the trigger function list the columns of `jobs` as of this revision: a
revision that adds a column to `jobs` adds it to `job_history` and replaces both.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from flowq.db.migrations import revision_schema

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

COLUMNS = ("id, run_id, task, step, step_index, queue, status, priority, attempts, "
           "max_attempts, args, result, last_error, idempotency_key, cancel_requested, "
           "run_at, locked_at, heartbeat_at, locked_by, created_at, finished_at, lease, "
           "map_index, joined, concurrency_key, key_limit, scheduled_at, trace_context, "
           "started_at, attempt_log, progress, forked_from, deadline, fingerprint")


def upgrade() -> None:
    s = revision_schema()
    new = ", ".join(f"NEW.{c.strip()}" for c in COLUMNS.split(","))
    op.execute(f"""
        CREATE TABLE {s}.job_history (LIKE {s}.jobs,
            retired_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (id, retired_at)) PARTITION BY RANGE (retired_at)""")
    op.execute(f"CREATE TABLE {s}.job_history_default PARTITION OF {s}.job_history DEFAULT")
    op.execute(f"CREATE INDEX job_history_run_id_idx ON {s}.job_history (run_id)")
    op.execute(f"CREATE INDEX job_history_finished_idx ON {s}.job_history (finished_at)")
    op.execute(f"CREATE INDEX job_history_dead_idx ON {s}.job_history (task, queue) "
               "WHERE status = 'dead'")
    op.create_table(
        "run_keys",
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("run_id", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        schema=s,
    )
    op.create_index("run_keys_run_id_idx", "run_keys", ["run_id"], schema=s)
    op.execute(f"""
        INSERT INTO {s}.run_keys (key, run_id, created_at)
        SELECT idempotency_key, run_id, created_at FROM {s}.jobs
         WHERE idempotency_key IS NOT NULL
        ON CONFLICT DO NOTHING""")
    op.execute(f"""
        CREATE VIEW {s}.steps AS
        SELECT {COLUMNS}, CAST(NULL AS timestamptz) AS retired_at FROM {s}.jobs
        UNION ALL
        SELECT {COLUMNS}, retired_at FROM {s}.job_history""")
    op.execute(f"""
        CREATE FUNCTION {s}.retire_job() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            -- A worker of an earlier release reads finished rows from jobs only.
            IF EXISTS (SELECT 1 FROM {s}.workers w
                        WHERE w.capabilities IS NULL
                           OR NOT 'job_history' = ANY(w.capabilities)) THEN
                RETURN NULL;
            END IF;
            DELETE FROM {s}.jobs WHERE id = NEW.id;
            IF FOUND THEN
                INSERT INTO {s}.job_history ({COLUMNS}) VALUES ({new});
                IF NEW.idempotency_key IS NOT NULL THEN
                    INSERT INTO {s}.run_keys (key, run_id)
                    VALUES (NEW.idempotency_key, NEW.run_id) ON CONFLICT DO NOTHING;
                END IF;
            END IF;
            RETURN NULL;
        END $$""")
    op.execute(f"""
        CREATE TRIGGER jobs_retire AFTER INSERT OR UPDATE OF status ON {s}.jobs
        FOR EACH ROW WHEN (NEW.status IN ('succeeded', 'dead', 'cancelled'))
        EXECUTE FUNCTION {s}.retire_job()""")


def downgrade() -> None:
    s = revision_schema()
    op.execute(f"DROP TRIGGER jobs_retire ON {s}.jobs")
    op.execute(f"DROP FUNCTION {s}.retire_job()")
    op.execute(f"DROP VIEW {s}.steps")
    # Back to one table: the finished rows return to `jobs` (their keys with them). A key
    # may be on more than one row by now (a producer of the release before this one found
    # only live runs by key, so it started a new run with the key of a finished one), and
    # `jobs` holds it once: it stays on a live row that has it, else on the row of the run
    # `run_keys` names, else on the newest; the other rows return without it.
    items = ", ".join("CASE WHEN h.id IN (SELECT id FROM holder) THEN h.idempotency_key END"
                      if c.strip() == "idempotency_key" else f"h.{c.strip()}"
                      for c in COLUMNS.split(","))
    op.execute(f"""
        WITH holder AS (
            SELECT DISTINCT ON (h.idempotency_key) h.id
              FROM {s}.job_history h
              LEFT JOIN {s}.run_keys k ON k.key = h.idempotency_key AND k.run_id = h.run_id
             WHERE h.idempotency_key IS NOT NULL
               AND NOT EXISTS (SELECT 1 FROM {s}.jobs j
                                WHERE j.idempotency_key = h.idempotency_key)
             ORDER BY h.idempotency_key, (k.run_id IS NOT NULL) DESC, h.id DESC)
        INSERT INTO {s}.jobs ({COLUMNS}) SELECT {items} FROM {s}.job_history h""")
    op.drop_table("run_keys", schema=s)
    op.execute(f"DROP TABLE {s}.job_history")
