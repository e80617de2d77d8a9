"""The indexes scenario: every feature statement EXPLAINed over N retained rows (issue 21).

`fill` writes a fresh flowq schema's tables as a long-running deployment leaves them: N
finished rows (in `flowq.job_history`, where revision 0018 moves them) in runs of 1 to 3 steps (succeeded, some dead, some cancelled; idempotency
keys, map instances and their joins, signals, children, checkpoints) spread over four days
(so about a quarter is past the pruner's default retention of 3 days), retired into the day
partitions a running deployment's pruner has made for those days, beside a live part
that grows with N up to `LIVE` (pending, running, stale and waiting rows, deadlines, waits,
unique keys, two workers) in `flowq.jobs`. Then VACUUM ANALYZE: the statistics autovacuum
would leave.

`checks` lists the statements a user path sends, each with real parameters looked up in that
data: the worker's through `flowq.db.store.Store` verbs (so the parameters are the ones the
store builds), the others from `flowq.db.sql.Queries` as the CLI, dashboard and enqueue send
them. `explain` runs one under EXPLAIN (ANALYZE, BUFFERS) in a transaction it rolls back,
with the options of the connection that sends it (the worker's connections disable seq
scans: `flowq.worker.connection.PLANNER_OPTIONS`), and says whether it is index-served: no
Seq Scan (on a table or on a partition of job_history: `Plan.history_seq_scans`) and no
walk without a condition over most of an index that grows with retained rows (`BOUNDED`
tables hold a deployment's queues, workers and schedules).

tests/integration/test_index_plans.py runs the same list at 20,000 rows.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import cached_property
from typing import Any, Final

import psycopg
import sqlalchemy as sa
from sqlalchemy.sql.elements import TextClause

from flowq.db.history import DAYS_AHEAD, day_bounds
from flowq.db.rows import Claim, Completion, Spawned, Successor
from flowq.db.runner import Rows, raw_sql
from flowq.db.schema import JOIN_SHARDS
from flowq.db.sql import queries
from flowq.db.store import Store
from flowq.enqueueing.prepare import prepare_enqueue
from flowq.worker.config import DEFAULT_DEAD_RETENTION, DEFAULT_RETENTION
from flowq.worker.connection import HOT_PATH_OPTIONS
from flowq_bench.tables import HISTORY, HISTORY_SIZE, JOBS, JOBS_SIZE

__all__ = ["BOUNDED", "BY_DESIGN", "LIVE", "LIVE_COUNTS", "Check", "Plan", "checks", "explain",
           "fill", "indexes", "live_size", "plan_nodes", "statement_name"]

Q: Final = queries("flowq")
# Tables whose size is set by a deployment (its queues, workers, schedules, definitions,
# permits) or by what is in flight (`run_waiters`: the wait_run calls waiting now), not by
# the rows it retains: a Seq Scan there is reported, not flagged.
BOUNDED: Final = frozenset({"queues", "workers", "schedules", "definitions", "permits",
                            "run_waiters"})
# Statements no index serves, on purpose: reported as such, not counted as a failure.
BY_DESIGN: Final = {
    "dashboard: search args": "no index on args (it would cost every enqueue): a walk from "
                              "the newest id, bounded by :limit and a statement timeout",
}
# Statements that count every live row of flowq.jobs: since revision 0018 it holds the live
# rows only, so reading it whole costs the backlog, not what is retained (a Seq Scan is the
# plan at any retention: seen at 400,000 and 10,000,000 rows). Only that read is allowed.
LIVE_COUNTS: Final = {
    "status: queues": "counts the pending, waiting and running rows of every queue",
    "status: table health": "counts the pending rows",
    "metrics: queues": "counts the pending and running rows of every queue",
}
# The live part at its largest: pending rows (running, waiting, ... are fractions of it).
LIVE: Final = 2_000
# A walk of an index without a condition over at least this share of its entries (and at
# least MIN_WALK of them: more than the live part holds) is a whole walk, however ordered.
WALKED: Final = 0.1
MIN_WALK: Final = 5_000
RUNS_PER_FILL: Final = 1_000_000  # runs per INSERT of the finished rows
SPAN: Final = "4 days"            # finished rows' age range
SPAN_DAYS: Final = 4
MAP_EVERY: Final = 1_000          # one map run (50 instances and a join) per this many runs
MAP_ITEMS: Final = 50


def live_size(rows: int) -> int:
    """Pending rows beside `rows` finished ones: 1%, at least 20, at most `LIVE`."""
    return max(20, min(LIVE, rows // 100))


# The finished runs :lo..:hi of :runs, steps 0..r%3; run r was created at a point of SPAN
# proportional to r, its steps a second apart. Every 50th run's last step is dead, every 97th
# cancelled; every 10th holds an idempotency key on its first step.
_FILL_FINISHED: Final = f"""
    INSERT INTO flowq.job_history (id, run_id, task, step, step_index, queue, status, priority,
                                   attempts, max_attempts, args, result, last_error,
                                   idempotency_key, cancel_requested, joined, run_at,
                                   locked_at, started_at, locked_by, created_at, finished_at,
                                   lease, retired_at)
    SELECT nextval(pg_get_serial_sequence('flowq.jobs', 'id')), r, 'task_' || r % 20,
           'step_' || s, s,
           (ARRAY['default', 'emails', 'reports'])[1 + (r / 3) % 3], st, 0,
           CASE st WHEN 'dead' THEN 3 ELSE 1 END, 3, jsonb_build_object('user_id', r),
           CASE st WHEN 'succeeded' THEN '{{"ok": true}}'::jsonb END,
           CASE st WHEN 'dead' THEN 'ValueError: boom' END,
           CASE WHEN s = 0 AND r % 10 = 0 THEN 'key-' || r END, false, false,
           t, t, t, 'w-old', t, t + interval '1 second', r * 3 + s, t + interval '1 second'
      FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) r
     CROSS JOIN LATERAL generate_series(0, (r % 3)::int) s
     CROSS JOIN LATERAL (SELECT
           CASE WHEN s < r % 3 THEN 'succeeded' WHEN r % 50 = 0 THEN 'dead'
                WHEN r % 97 = 0 THEN 'cancelled' ELSE 'succeeded' END AS st,
           now() - interval '{SPAN}' * (1 - r::float8 / :runs) + s * interval '1 second'
               AS t) x
"""
# Map runs :lo..:hi: a first step, MAP_ITEMS instances, and the join that collected them.
_FILL_MAPS: Final = f"""
    INSERT INTO flowq.job_history (id, run_id, task, step, step_index, queue, status, priority,
                                   attempts, max_attempts, args, result, map_index,
                                   cancel_requested, joined, created_at, run_at, finished_at,
                                   lease, retired_at)
    SELECT nextval(pg_get_serial_sequence('flowq.jobs', 'id')), r, 'mapper', CASE WHEN i < 0 THEN 'split' WHEN i < {MAP_ITEMS} THEN 'item'
                             ELSE 'collect' END,
           CASE WHEN i < 0 THEN 0 WHEN i < {MAP_ITEMS} THEN 1 ELSE 2 END, 'default',
           'succeeded', 0, 1, 10, '{{}}', jsonb_build_object('n', i),
           CASE WHEN i BETWEEN 0 AND {MAP_ITEMS - 1} THEN i END, false, i = {MAP_ITEMS}, t, t,
           t + interval '1 second', r, t + interval '1 second'
      FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) r
     CROSS JOIN generate_series(-1, {MAP_ITEMS}) i
     CROSS JOIN LATERAL (SELECT now() - interval '{SPAN}' * random() AS t) x
"""
# The live runs after :base, :n pending of them (and fractions as running, stale, waiting).
_FILL_LIVE: Final = """
    INSERT INTO flowq.jobs (run_id, task, step, step_index, queue, status, attempts, args,
                            run_at, locked_at, started_at, heartbeat_at, locked_by, lease,
                            deadline, idempotency_key)
    SELECT :base + g, 'task_' || g % 20, 'step_0', 0,
           (ARRAY['default', 'emails', 'reports'])[1 + g % 3], st,
           CASE st WHEN 'running' THEN 1 ELSE 0 END, jsonb_build_object('user_id', g),
           CASE WHEN st = 'waiting' AND g % 10 = 0 THEN now() - interval '1 minute'
                WHEN st = 'waiting' THEN now() + interval '1 hour'
                WHEN g % 5 = 0 THEN now() + interval '1 hour' ELSE now() - interval '1 second'
           END,
           hb, hb, hb, CASE st WHEN 'running' THEN 'w-live' END,
           CASE st WHEN 'running' THEN :base * 3 + g END,
           CASE WHEN g % 10 = 3 THEN now() + interval '1 hour'
                WHEN g % 100 = 7 THEN now() - interval '1 minute' END,
           CASE WHEN g % 10 = 0 THEN 'live-' || g END
      FROM generate_series(1, :n * 2) g
     CROSS JOIN LATERAL (SELECT
           CASE WHEN g <= :n THEN 'pending' WHEN g <= :n * 3 / 2 THEN 'running'
                ELSE 'waiting' END AS st) x
     CROSS JOIN LATERAL (SELECT
           CASE WHEN st <> 'running' THEN NULL WHEN g % 10 = 1
                THEN now() - interval '10 minutes' ELSE now() END AS hb) y
"""
_FILL_OTHERS: Final = [
    # Signals: every 30th finished run got one; each waiting row waits for one.
    """INSERT INTO flowq.signals (run_id, name, payload, sent_at, step, reached_at)
       SELECT r, 'approve', '{"ok": true}', now() - interval '1 day', 'step_1',
              now() - interval '1 day'
         FROM generate_series(30, :runs, 30) r""",
    """INSERT INTO flowq.signals (run_id, name, step, timeout_s, reached_at)
       SELECT run_id, 'approve', step, 3600, now() FROM flowq.jobs
        WHERE status = 'waiting'""",
    # Joins of the map runs (all collected).
    """INSERT INTO flowq.joins (run_id, step, parents, remaining)
       SELECT r, 'collect', 1, 0 FROM generate_series(:runs + 1, :runs + :maps) r""",
    # Children: run r + 1 is a child of step 0 of every 100th finished run, and each running
    # live row waits for the pending row after it.
    """INSERT INTO flowq.children (run_id, parent_run_id, parent_step, parent_map_index,
                                   parent_job_id, name)
       SELECT j.run_id + 1, j.run_id, j.step, -1, j.id, 'child'
         FROM flowq.steps j
        WHERE (j.step_index = 0 AND j.run_id % 100 = 3 AND j.run_id < :runs)
           OR (j.status = 'running' AND j.run_id > :runs + :maps)""",
    # Checkpoints: three on step 0 of every 20th finished run, one on each running row.
    """INSERT INTO flowq.checkpoints (run_id, step, map_index, name, position, result)
       SELECT r, 'step_0', -1, 'cp_' || k, k, '1'
         FROM generate_series(20, :runs, 20) r CROSS JOIN generate_series(0, 2) k""",
    """INSERT INTO flowq.checkpoints (run_id, step, map_index, name, position, result)
       SELECT run_id, step, -1, 'cp_0', 0, '1' FROM flowq.jobs WHERE status = 'running'""",
    # Unique keys of every 40th finished run and every 4th pending one; wait_run
    # registrations on running ones.
    """INSERT INTO flowq.uniques (key, run_id)
       SELECT 'task_' || r % 20 || ' key u-' || r, r FROM generate_series(40, :runs, 40) r""",
    """INSERT INTO flowq.uniques (key, run_id)
       SELECT task || ' key u-' || run_id, run_id FROM flowq.jobs
        WHERE status = 'pending' AND run_id % 4 = 0""",
    # The map runs' instance counters, and session.batch(): a fired batch of 10 runs per
    # MAP_EVERY finished runs, and one still open.
    f"""INSERT INTO flowq.join_shards (run_id, step, parent, shard, remaining)
        SELECT r, 'collect', 'item', k, 0 FROM generate_series(:runs + 1, :runs + :maps) r
         CROSS JOIN generate_series(0, {JOIN_SHARDS - 1}) k""",
    f"""INSERT INTO flowq.batches (id, task, step, queue, priority, max_attempts, args, runs,
                                   succeeded, created_at, fired_at, callback_run_id)
        SELECT b, 'done', 'done', 'default', 0, 3, '{{}}'::jsonb, 10, 10, t, t, b * {MAP_EVERY}
          FROM generate_series(1, :maps) b
         CROSS JOIN LATERAL (SELECT now() - interval '{SPAN}' * (1 - b::float8 / :maps)
                             AS t) x
        UNION ALL
        SELECT :maps + 1, 'done', 'done', 'default', 0, 3, '{{}}', 10, 0, now(), NULL, NULL""",
    f"""INSERT INTO flowq.batch_runs (batch_id, run_id)
        SELECT b, b * {MAP_EVERY} - k FROM generate_series(1, :maps + 1) b
         CROSS JOIN generate_series(1, 10) k""",
    "SELECT setval('flowq.batch_id_seq', :maps + 1)",
    """INSERT INTO flowq.run_waiters (run_id, token, pid)
       SELECT run_id, 't' || id, pg_backend_pid() FROM flowq.jobs
        WHERE status = 'running' AND id % 10 = 0""",
    """INSERT INTO flowq.workers (name, host, pid, queues, tasks, concurrency, version)
       VALUES ('w-live', 'h', 1, '{default,emails,reports}', '{task_0,task_1}', 16, '1'),
              ('w-other', 'h', 2, '{default}', '{task_0}', 16, '1')""",
    # The idempotency keys of runs (revision 0018), finished and live: what the migration
    # copies and the keyed enqueue writes.
    """INSERT INTO flowq.run_keys (key, run_id, created_at)
       SELECT idempotency_key, run_id, created_at FROM flowq.steps
        WHERE idempotency_key IS NOT NULL""",
    """SELECT setval('flowq.run_id_seq', (SELECT max(run_id) FROM flowq.steps)),
              setval('flowq.lease_seq', (SELECT max(lease) FROM flowq.steps))""",
]


# The secondary indexes of both job tables (job_history's on the partitioned table: dropping
# one drops its partitions' indexes, creating one builds them).
_SECONDARY: Final = ("SELECT {} FROM pg_index i WHERE i.indrelid IN "
                     "('flowq.jobs'::regclass, 'flowq.job_history'::regclass) "
                     "AND NOT i.indisprimary")


def fill(url: str, rows: int, progress: Callable[[str], None] = lambda _: None) -> None:
    """Write about `rows` finished rows (into `flowq.job_history`, where a finished row
    lives since revision 0018, retired when it finished) and the live part (into
    `flowq.jobs`) into the fresh flowq schema at `url` (a psycopg URL), then VACUUM ANALYZE.
    Both tables' secondary indexes are dropped first and built again after (as
    `pg_get_indexdef` gave them; job_history's are partitioned indexes, built on each
    partition): one build per index is minutes faster than maintaining them for every row
    inserted."""
    runs = max(1, rows // 2)
    maps = max(1, runs // MAP_EVERY)
    live = live_size(rows)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET maintenance_work_mem = '512MB'")
        # The day partitions the pruner of a deployment that ran those days made (today's
        # and the next ones', as a starting worker does, too): rows retire into them, not
        # into DEFAULT. Made before the indexes are dropped, so theirs go and come back too.
        clock = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()
        assert clock is not None
        for n in range(-SPAN_DAYS - 1, DAYS_AHEAD + 1):
            day = clock[0] + timedelta(days=n)
            conn.execute(raw_sql(Q.create_partition(day)))
            conn.execute(raw_sql(Q.attach_partition(day)))
        defs = [r[0] for r in conn.execute(_SECONDARY.format("pg_get_indexdef(i.indexrelid)"))]
        names = [r[0] for r in conn.execute(_SECONDARY.format("i.indexrelid::regclass::text"))]
        for name in names:
            conn.execute(f"DROP INDEX {name}")
        for lo in range(1, runs + 1, RUNS_PER_FILL):
            progress(f"  fill: runs {lo:,}-{min(runs, lo + RUNS_PER_FILL - 1):,} of {runs:,}\n")
            _execute(conn, _FILL_FINISHED, {"lo": lo, "hi": min(runs, lo + RUNS_PER_FILL - 1),
                                            "runs": runs})
        _execute(conn, _FILL_MAPS, {"lo": runs + 1, "hi": runs + maps})
        _execute(conn, _FILL_LIVE, {"base": runs + maps, "n": live})
        progress("  fill: indexes\n")
        for ddl in defs:
            # A partitioned index's definition reads `ON ONLY`: built so, it would cover no
            # partition (an invalid parent); without it, each partition's index is built.
            conn.execute(ddl.replace(" ON ONLY ", " ON "))
        for statement in _FILL_OTHERS:
            _execute(conn, statement, {"runs": runs, "maps": maps})
        progress("  fill: VACUUM ANALYZE\n")
        conn.execute("VACUUM ANALYZE")
        # The live heartbeats as of now, not of before the index builds and the vacuum (the
        # stale tenth stays ten minutes old: the reaper's work).
        conn.execute("UPDATE flowq.jobs SET heartbeat_at = now() WHERE status = 'running' "
                     "AND heartbeat_at > now() - interval '5 minutes'")


def _execute(conn: psycopg.Connection[Any], text: str, params: dict[str, Any]) -> None:
    conn.execute(raw_sql(sa.text(text)), params)


def statement_name(statement: TextClause) -> str:
    """The `Queries` name of `statement` (its verb_noun)."""
    return next(name for cls in type(Q).__mro__ for name, attr in vars(cls).items()
                if isinstance(attr, cached_property) and getattr(Q, name) is statement)


@dataclass(frozen=True)
class Check:
    """One statement of a user path with real parameters, and whether a worker connection
    (seq scans disabled) or a user's (the default planner) sends it."""

    label: str
    statement: TextClause
    params: dict[str, Any]
    worker: bool


def _captured(verb: Callable[[Store], object]) -> tuple[TextClause, dict[str, Any]]:
    """The statement and parameters a `Store` verb sends (sent nowhere)."""
    sent: list[tuple[TextClause, dict[str, Any]]] = []

    def capture(statement: sa.ClauseElement, params: Mapping[str, Any]) -> Rows:
        assert isinstance(statement, TextClause)
        sent.append((statement, dict(params)))
        return Rows()

    verb(Store(capture))
    [(statement, params)] = sent
    return statement, params


def checks(url: str) -> list[Check]:
    """The statements to EXPLAIN, with parameters read from the data `fill` wrote at `url`."""
    with psycopg.connect(url) as conn:
        def one(sql: str) -> Any:
            row = conn.execute(sql).fetchone()
            assert row is not None, sql
            return row

        running = one("SELECT id, lease, run_id FROM flowq.jobs WHERE status = 'running' "
                      "ORDER BY heartbeat_at DESC LIMIT 1")
        batch = conn.execute("SELECT id, lease FROM flowq.jobs WHERE status = 'running' "
                             "ORDER BY id LIMIT 20").fetchall()
        pending = one("SELECT priority, run_at, id FROM flowq.jobs WHERE status = 'pending' "
                      "AND run_at <= now() AND queue = 'default' ORDER BY id LIMIT 1")
        # Finished runs' parameters from job_history, where their rows are.
        [key] = one("SELECT idempotency_key FROM flowq.job_history "
                    "WHERE idempotency_key LIKE 'key-%' ORDER BY run_id DESC LIMIT 1")
        [finished] = one("SELECT max(run_id) FROM flowq.job_history WHERE idempotency_key = "
                         f"'{key}'")
        [dead] = one("SELECT max(run_id) FROM flowq.job_history WHERE status = 'dead'")
        [mapped] = one("SELECT max(run_id) FROM flowq.job_history WHERE map_index IS NOT NULL")
        waiting = one("SELECT run_id, step FROM flowq.jobs WHERE status = 'waiting' "
                      "ORDER BY id LIMIT 1")
        [parent] = one("SELECT max(parent_run_id) FROM flowq.children")
        kids = [r[0] for r in conn.execute(
            f"SELECT run_id FROM flowq.children WHERE parent_run_id = {parent}")]
        runs = [r[0] for r in conn.execute(
            "SELECT run_id FROM flowq.job_history WHERE status = 'succeeded' "
            "ORDER BY run_id DESC LIMIT 20")]
        # `prepare_enqueue` writes a unique key as "<task> key <unique_key>".
        [held_key] = one("SELECT 'u-' || max(run_id) FROM flowq.jobs WHERE status = "
                         "'pending' AND run_id % 4 = 0 AND task = 'task_0'")
        ended_key = "u-40"  # run 40 (task_0) ended: its key is taken over
        conn.rollback()

    now = datetime.now(timezone.utc)
    claim: Claim = (running[0], running[1])
    claims = [(i, lease) for i, lease in batch]
    successor = Successor(running[0], running[1], "task_0", "step_1", 1, "default", 3,
                          '{"a": 1}', None, 0.0)
    join = Spawned(**{**vars(successor), "step": "collect", "step_index": 2},
                   parents=1, delta=-1, input='{"a": 1}', source="step_0")
    runs_filter = {"before": None, "task": None, "fingerprints": None, "since": None,
                   "status": None, "queue": None, "until": None, "limit": 50}
    day = now - timedelta(days=1)
    # The oldest day past the retention, as the pruner's pass sweeps it (a batch of runs).
    swept_lower, swept_upper = day_bounds((now - timedelta(days=SPAN_DAYS)).date())

    def worker(label: str, verb: Callable[[Store], object]) -> Check:
        return Check(label, *_captured(verb), worker=True)

    def user(label: str, statement: TextClause, **params: Any) -> Check:
        return Check(label, statement, params, worker=False)

    def enqueue(label: str, **options: Any) -> Check:
        call = prepare_enqueue("task_0", {"user_id": 1}, queue="default", **options)
        assert isinstance(call.statement, TextClause)
        return Check(label, call.statement, call.params, worker=False)

    def maintain(label: str, statement: TextClause, **params: Any) -> Check:
        return Check(label, statement, params, worker=True)

    return [
        # The worker's hot path.
        worker("claim", lambda s: s.claim("default", 16, "w-live")),
        worker("claim after a cursor", lambda s: s.claim("default", 16, "w-live",
                                                         after=tuple(pending))),
        worker("heartbeat", lambda s: s.heartbeat("w-live", claims)),
        worker("heartbeat with progress", lambda s: s.heartbeat(
            "w-live", claims, {claims[0][0]: '{"done": 1}'})),
        worker("complete one", lambda s: s.complete([Completion(*claim, "{}")])),
        worker("complete a batch", lambda s: s.complete(
            [Completion(i, lease, "{}") for i, lease in claims])),
        worker("complete with next step", lambda s: s.complete(
            [Completion(*claim, "{}")], [successor])),
        worker("complete into a join", lambda s: s.complete(
            [Completion(*claim, "{}")], [join])),
        worker("complete a batch into joins", lambda s: s.complete(
            [Completion(i, lease, "{}") for i, lease in claims],
            [Spawned(**{**vars(join), "id": i, "lease": lease}) for i, lease in claims])),
        worker("retry", lambda s: s.retry(claim, 5.0, "boom")),
        worker("end as dead", lambda s: s.end(claim, "dead", "boom")),
        worker("release", lambda s: s.release(claims)),
        worker("record checkpoint", lambda s: s.record_checkpoint(
            claim, running[2], "step_0", None, "cp_1", 1, result="1")),
        worker("suspend (sleep)", lambda s: s.suspend(claim, "step_0", until=None, delay=60.0,
                                                      snoozes=None)),
        maintain("select checkpoints", Q.select_checkpoints, run_id=running[2],
                 step="step_0", map_index=None),
        maintain("select map results (join)", Q.select_map_results, run_id=mapped,
                 step="item"),
        maintain("children status (wait)", Q.select_children_status, run_id=parent,
                 run_ids=kids),
        maintain("insert child", Q.insert_child, run_id=running[2], step="step_0",
                 map_index=None, job_id=running[0], child_run_id=finished, name="c"),
        maintain("exists due jobs (poll)", Q.exists_due_jobs, queues=["default", "emails"],
                 horizon=5.0),
        # Maintenance: reaper, deadlines, waits, pruner, waiters, registry.
        worker("reap", lambda s: s.reap(60.0, 100)),
        worker("deadlines pass", lambda s: s.expire_deadlines("deadline %s", 100)),
        maintain("expire waits", Q.expire_waits, limit=100, channel="flowq"),
        maintain("prune", Q.prune_jobs, retention=DEFAULT_RETENTION,
                 dead_retention=DEFAULT_DEAD_RETENTION, limit=1000),
        maintain("sweep an old day", Q.prune_partition, lower=swept_lower, upper=swept_upper,
                 after=0, retention=DEFAULT_RETENTION, dead_retention=DEFAULT_DEAD_RETENTION,
                 limit=1000),
        maintain("prune waiters", Q.prune_waiters, limit=1000),
        maintain("expire workers", Q.expire_workers, stale=60.0),
        maintain("unserved jobs", Q.select_unserved_jobs, stale=60.0, limit=100),
        maintain("runs in flight", Q.select_runs_in_flight, limit=100),
        maintain("handed-over jobs", Q.select_handed_over_jobs, limit=100),
        worker("advance batches", lambda s: s.advance_batches(100)),
        worker("start batch callbacks", lambda s: s.start_batch_callbacks(100)),
        # Enqueue and signals, on the caller's connection.
        enqueue("enqueue"),
        enqueue("enqueue, existing key", idempotency_key=key),
        user("find run by key", Q.find_run_by_key, idempotency_key=key),
        user("release orphaned key", Q.release_orphaned_key, idempotency_key=key),
        enqueue("enqueue, unique key held", unique_key=held_key),
        enqueue("enqueue, unique key taken over", unique_key=ended_key),
        user("signal: run state", Q.select_run_state, run_id=waiting[0]),
        user("signal: send", Q.send_signal, run_id=waiting[0], name="approve",
             payload='{"ok": true}'),
        user("signal: wake step", Q.wake_signalled_step, run_id=waiting[0], step=waiting[1],
             name="approve", payload='{"ok": true}', channel="flowq"),
        user("signal: find", Q.find_signal, run_id=waiting[0], name="approve"),
        user("wait_run: register", Q.register_waiter, run_id=finished, token="tok", pid=1),
        user("wait_run: unregister", Q.unregister_waiter, run_id=finished, token="tok"),
        # Runs: show, list, cancel, retry, redrive (the CLI's and the dashboard's).
        user("runs show", Q.select_run_jobs, run_id=finished),
        user("runs show: checkpoints", Q.select_run_checkpoints, run_id=finished, limit=100),
        user("runs show: family", Q.select_run_family, run_id=parent, limit=100),
        user("runs show: descendants", Q.select_descendants, run_id=parent, max_depth=10),
        user("runs list", Q.list_runs, **runs_filter),
        user("runs list --status dead", Q.list_runs, **{**runs_filter, "status": "dead"}),
        user("runs list --task", Q.list_runs, **{**runs_filter, "task": "task_3"}),
        user("runs list --queue", Q.list_runs, **{**runs_filter, "queue": "emails"}),
        user("runs list --since", Q.list_runs, **{**runs_filter, "since": day}),
        user("runs list, page 2", Q.list_runs, **{**runs_filter, "before": runs[-1]}),
        user("runs of a page", Q.select_runs_jobs, run_ids=runs),
        user("dead errors of a page", Q.select_dead_errors, run_ids=[dead, *runs]),
        user("dead runs (redrive)", Q.select_dead_runs, after=None, fingerprints=None,
             limit=100, queue=None, since=None, task=None, until=None),
        user("cancel: lock", Q.lock_run_jobs, run_id=running[2]),
        user("cancel", Q.cancel_run_jobs, run_ids=[running[2]], error="cancelled"),
        user("retry dead run", Q.retry_dead_jobs, run_id=dead, channel="flowq"),
        user("redrive: lock runs", Q.lock_runs_jobs, run_ids=[dead]),
        user("redrive: retry runs", Q.retry_dead_runs, run_ids=[dead], channel="flowq"),
        # Status, queues, dashboard.
        user("status: queues", Q.list_queues),
        user("status: completions", Q.select_completions),
        user("status: dead by task", Q.select_dead_by_task, limit=20),
        user("status: table health", Q.select_table_health),
        user("metrics: queues", Q.select_queue_metrics),
        user("dashboard: activity", Q.select_queue_activity, since=now - timedelta(hours=1),
             bucket=60, limit=10_000),
        user("dashboard: running", Q.select_running_jobs, limit=100),
        user("dashboard: search args", Q.find_jobs_by_args, args='{"user_id": 12345}',
             limit=50),
        user("dashboard: due times", Q.select_due_times, run_ids=runs),
        user("dashboard: known tasks", Q.select_known_tasks, recent=1000, limit=100),
    ]


@dataclass(frozen=True)
class Plan:
    """What EXPLAIN ANALYZE showed of one `Check`."""

    label: str
    seq_scans: tuple[str, ...]    # flowq tables read by a Seq Scan (partitions by their name)
    full_walks: tuple[str, ...]   # indexes walked without a condition, most of them
    index_only: tuple[str, ...]   # the same, by an Index Only Scan (not flagged)
    hit: int                      # shared buffers found in cache
    read: int                     # shared buffers read in
    ms: float                     # execution time
    plan: Any
    history_seq_scans: tuple[str, ...] = ()  # the partitions of job_history among seq_scans
    # Empty partitions read by a Seq Scan (not in seq_scans): the days made ahead and the
    # DEFAULT partition hold no page, so the planner rightly reads them whole, for nothing.
    empty_scans: tuple[str, ...] = ()

    @property
    def served(self) -> bool:
        """No Seq Scan and no whole walk over a table that grows with retained rows (a
        partition of job_history is one, whatever its name)."""
        whole = BOUNDED | ({"jobs"} if self.label in LIVE_COUNTS else set())
        return not [t for t in self.seq_scans if t not in whole] and not self.full_walks

    def line(self) -> str:
        verdict = ("index-served, the live rows read whole" if self.served
                   and "jobs" in self.seq_scans else "index-served" if self.served
                   else "not index-served, by design" if self.label in BY_DESIGN
                   else "NOT INDEX-SERVED")
        why = "; ".join([*(f"Seq Scan on {t}" + (" (flowq.job_history)"
                                                  if t in self.history_seq_scans else "")
                           for t in self.seq_scans),
                         *(f"Seq Scan on {t} (empty)" for t in self.empty_scans),
                         *(f"whole {i}" for i in self.full_walks),
                         *(f"whole {i}, index-only" for i in self.index_only)])
        return (f"{self.label}: {verdict}, {self.hit + self.read:,} buffers "
                f"({self.read:,} read)" + (f" [{why}]" if why else ""))


def plan_nodes(plan: Any) -> Iterator[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) document, depth first (the plan tests' too)."""
    if isinstance(plan, dict):
        yield plan
        for v in plan.values():
            yield from plan_nodes(v)
    elif isinstance(plan, list):
        for v in plan:
            yield from plan_nodes(v)


def _visited(node: dict[str, Any]) -> float:
    """Entries a scan node returned or filtered out, over all its loops."""
    return float((node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0))
                 * node.get("Actual Loops", 1))


def explain(url: str, check: Check, options: str | None = None) -> Plan:
    """EXPLAIN (ANALYZE, BUFFERS) `check` on a connection like the one that sends it (or
    with the server `options` given), in a transaction rolled back: its writes are undone."""
    if options is None:
        options = HOT_PATH_OPTIONS if check.worker else ""
    with psycopg.connect(url, options=options) as conn:
        # pg_tables lists partitions too (job_history_default, a day's job_history_...).
        ours = {r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'flowq'")}
        partitions = {r[0] for r in conn.execute(
            "SELECT relid::regclass::text FROM pg_partition_tree('flowq.job_history') "
            "WHERE isleaf")}
        partitions = {p.rsplit(".", 1)[-1] for p in partitions}
        empty = {r[0] for r in conn.execute(  # as VACUUM ANALYZE counted them
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'flowq' AND c.relkind = 'r' AND c.relpages = 0")} & partitions
        bounded_indexes = {r[0] for r in conn.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = 'flowq' "
            "AND tablename = ANY(%s)", [list(BOUNDED)])}
        sizes: dict[str, float] = dict(conn.execute(  # rows per index, as ANALYZE counted them
            "SELECT c.relname, c.reltuples FROM pg_class c JOIN pg_namespace n "
            "ON n.oid = c.relnamespace WHERE n.nspname = 'flowq' AND c.relkind = 'i'"
        ).fetchall())
        t = time.perf_counter()
        [raw] = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                             + raw_sql(check.statement), check.params).fetchone() or [None]
        elapsed = (time.perf_counter() - t) * 1000
        conn.rollback()
    doc = raw if isinstance(raw, list) else json.loads(str(raw))
    top = doc[0]
    nodes = list(plan_nodes(top["Plan"]))
    scanned = {n["Relation Name"] for n in nodes if n.get("Node Type") == "Seq Scan"
               and n.get("Relation Name") in ours}
    seq = tuple(sorted(scanned - empty))
    # An index walked without a condition is a whole walk when it visited at least WALKED
    # of its entries and MIN_WALK of them: a walk in index order under a LIMIT stops early,
    # and a partial index of live rows (pending, running, ...) stays as small as the work
    # in flight; a partial index of finished rows (jobs_dead_idx) grows with retention. An
    # Index Only Scan's whole walk is reported, not flagged: it reads the index alone (a
    # count of the dead rows by task reads ~170 pages at 10,000,000 rows).
    whole = [n for n in nodes
             if n.get("Node Type") in ("Index Scan", "Index Only Scan", "Bitmap Index Scan")
             and "Index Cond" not in n and n["Index Name"] not in bounded_indexes
             and _visited(n) >= max(MIN_WALK, WALKED * sizes.get(n["Index Name"], 0))]
    walks = tuple(sorted({n["Index Name"] for n in whole
                          if n["Node Type"] != "Index Only Scan"}))
    only = tuple(sorted({n["Index Name"] for n in whole
                         if n["Node Type"] == "Index Only Scan"}))
    return Plan(check.label, seq, walks, only, int(top["Plan"].get("Shared Hit Blocks", 0)),
                int(top["Plan"].get("Shared Read Blocks", 0)),
                float(top.get("Execution Time", elapsed)), top,
                tuple(t for t in seq if t in partitions), tuple(sorted(scanned & empty)))


def indexes(server: Any, o: Any) -> list[Any]:
    """The scenario: `fill` with `o.rows` rows, then one row of the table per `check`."""
    from flowq_bench.report import Figure, Row

    with server.fresh_database() as url:
        pg_url = sa.make_url(url).set(drivername="postgresql").render_as_string(
            hide_password=False)
        t = time.perf_counter()
        fill(pg_url, o.index_rows, progress=lambda m: print(m, end="", file=sys.stderr, flush=True))
        filled = time.perf_counter() - t
        with psycopg.connect(pg_url) as conn:
            [(jobs, size, finished, history_size)] = conn.execute(
                f"SELECT (SELECT count(*) FROM {JOBS}), pg_size_pretty({JOBS_SIZE}), "
                f"(SELECT count(*) FROM {HISTORY}), pg_size_pretty({HISTORY_SIZE})"
            ).fetchall()
        found = checks(pg_url)
        plans = [explain(pg_url, c) for c in found]
    bad = [p.label for p in plans if not p.served and p.label not in BY_DESIGN]
    rows = [Row("indexes", Figure(p.line(), "ms", [p.ms], False),
                extra={"statement": statement_name(c.statement), "worker": c.worker,
                       "served": p.served, "seq_scans": list(p.seq_scans),
                       "full_walks": list(p.full_walks),
                       "index_only_walks": list(p.index_only), "hit": p.hit, "read": p.read,
                       **({} if p.served else {"plan": p.plan})})
            for c, p in zip(found, plans, strict=True)]
    rows[0].note = (f"{finished:,} rows in flowq.job_history ({history_size}, all partitions) "
                    f"and {jobs:,} in flowq.jobs ({size}), filled in {filled:.0f} s; "
                    + (f"NOT index-served: {', '.join(bad)}" if bad
                       else "every statement index-served")
                    + "".join(f"; {label}: {why}" for label, why in BY_DESIGN.items()))
    rows[0].extra["not_served"] = bad
    return rows
