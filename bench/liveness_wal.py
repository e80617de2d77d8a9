"""WAL written by the heartbeat: one worker holds N long-sleeping jobs for a minute.

Run from the repository root with the flowq under test first on PYTHONPATH (it uses only the
public API, so the same script measures any release):

    PYTHONPATH=. python bench/liveness_wal.py [--jobs 200] [--heartbeat 1] [--seconds 60]

It starts an embedded PostgreSQL (durable defaults, nothing else connected), migrates,
enqueues N jobs whose handlers sleep until the end, runs one worker (concurrency N,
maintenance on) until all N run, vacuums the database and checkpoints, waits 15 s, then
reads `pg_current_wal_insert_lsn()`, `pg_stat_wal` and `pg_stat_user_tables` of
`flowq.jobs` before and after the window. Prints WAL bytes, records and full-page images per
minute, the updates of `flowq.jobs` (and how many were HOT), the rows written to
`flowq.job_history` (summed over its partitions: finished rows move there; none while the
jobs are held), each table's size at the end, and the autovacuum or autoanalyze runs in the
window (PostgreSQL 14 or later).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import sqlalchemy as sa

import flowq
from flowq.local.postgres import LocalPostgres
from flowq.worker import Worker, WorkerConfig

# flowq.job_history (revision 0018: finished rows move there) over all its partitions; none
# before that revision (to_regclass is NULL, the partition tree empty), so any release runs.
HISTORY_PARTS = """SELECT relid FROM pg_partition_tree(to_regclass('flowq.job_history'))
                    WHERE isleaf"""
MARK = sa.text(f"""
    SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::float8 AS wal,
           (SELECT wal_records FROM pg_stat_wal) AS records,
           (SELECT wal_fpi FROM pg_stat_wal) AS fpi,
           n_tup_upd, n_tup_hot_upd,
           (SELECT sum(autovacuum_count + autoanalyze_count) FROM pg_stat_all_tables)
               AS autovacuums,
           pg_total_relation_size(relid) AS jobs_size,
           (SELECT coalesce(sum(h.n_tup_ins + h.n_tup_upd + h.n_tup_del), 0)::float8
              FROM pg_stat_user_tables h WHERE h.relid IN ({HISTORY_PARTS})) AS history_writes,
           (SELECT coalesce(sum(pg_total_relation_size(p.relid)), 0)::bigint
              FROM ({HISTORY_PARTS}) p) AS history_size
      FROM pg_stat_user_tables WHERE schemaname = 'flowq' AND relname = 'jobs'""")


def measure(url: str, jobs: int, heartbeat: float, seconds: float) -> dict[str, float]:
    engine = sa.create_engine(url)
    flowq.migrate(engine)
    app = flowq.FlowQ()
    release = threading.Event()

    @app.task()
    def hold(ctx: flowq.Context) -> None:
        release.wait(seconds + 120)

    with flowq.Session(bind=engine) as s, s.begin():
        for _ in range(jobs):
            s.enqueue(hold)
    config = WorkerConfig(concurrency=max(jobs, 1), heartbeat_interval=heartbeat,
                          stale_after=max(30.0, 3 * heartbeat), claim_ahead=0)

    def running() -> int:
        with engine.connect() as c:
            return int(c.execute(sa.text(
                "SELECT count(*) FROM flowq.jobs WHERE status = 'running'")).scalar_one())

    worker = Worker(app, url, config)
    with worker.running():
        deadline = time.monotonic() + 60
        while running() < jobs:
            if time.monotonic() > deadline:
                raise RuntimeError("the jobs did not all start")
            time.sleep(0.2)
        # The migration's and the claims' leftovers vacuumed, and a checkpoint: what the
        # window writes is the steady state's (its full-page images are taken in the wait).
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(sa.text("VACUUM ANALYZE"))
            c.execute(sa.text("CHECKPOINT"))
        time.sleep(15)  # the claims' statistics reach pg_stat_user_tables late
        with engine.connect() as c:
            c.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
            before = c.execute(MARK).one()
        time.sleep(seconds)
        with engine.connect() as c:
            after = c.execute(MARK).one()
        release.set()
    engine.dispose()
    per_minute = 60.0 / seconds
    return {"jobs": jobs, "heartbeat_s": heartbeat, "window_s": seconds,
            "wal_bytes_per_min": round((after.wal - before.wal) * per_minute),
            "wal_records_per_min": round((after.records - before.records) * per_minute),
            "full_page_images_per_min": round((after.fpi - before.fpi) * per_minute),
            "autovacuum_or_analyze_runs": int(after.autovacuums - before.autovacuums),
            "jobs_updates_per_min": round((after.n_tup_upd - before.n_tup_upd) * per_minute),
            "jobs_hot_updates_per_min": round(
                (after.n_tup_hot_upd - before.n_tup_hot_upd) * per_minute),
            "jobs_size_bytes": int(after.jobs_size),
            "job_history_writes_per_min": round(
                (after.history_writes - before.history_writes) * per_minute),
            "job_history_size_bytes": int(after.history_size)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--heartbeat", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    with LocalPostgres() as pg:
        print(json.dumps(measure(pg.url, args.jobs, args.heartbeat, args.seconds)))


if __name__ == "__main__":
    main()
