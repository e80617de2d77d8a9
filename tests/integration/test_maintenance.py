"""The maintenance services (heartbeat, reaper, waits' expiry, workers registry, pruner), one
`run_once()` at a time against a real PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from flowq.db.runner import runner
from flowq.db.store import Store
from flowq.testing import job_rows
from flowq.worker.connection import DedicatedConnection
from flowq.worker.heartbeat import Heartbeat
from flowq.worker.pruner import Pruner
from flowq.worker.reaper import Reaper
from flowq.worker.registry import Registry, WorkerExpirer
from flowq.worker.waits import WaitExpirer

DAY = 86400.0


def add_job(conn: sa.Connection, *, run_id: int | None = None, status: str = "pending",
            attempts: int = 0, max_attempts: int = 10, heartbeat_ago: float | None = None,
            finished_ago: float | None = None, cancel_requested: bool = False,
            lease: int | None = None) -> int:
    """Insert one row in a given state; times are seconds before the database's now()."""
    return int(conn.execute(sa.text("""
        INSERT INTO flowq.jobs (run_id, task, step, status, attempts, max_attempts,
                                locked_by, locked_at, heartbeat_at, finished_at,
                                cancel_requested, lease)
        VALUES (COALESCE(:run_id, nextval('flowq.run_id_seq')), 't', 't', :status, :attempts,
                :max_attempts, CASE WHEN :status = 'running' THEN 'old-worker' END,
                now() - make_interval(secs => :hb), now() - make_interval(secs => :hb),
                now() - make_interval(secs => :fin), :cancel, :lease)
        RETURNING id"""), {
        "run_id": run_id, "status": status, "attempts": attempts,
        "max_attempts": max_attempts, "cancel": cancel_requested,
        "hb": heartbeat_ago, "fin": finished_ago, "lease": lease}).scalar_one())


def heartbeat(engine: sa.Engine, held: list[tuple[int, int]], worker: str = "old-worker",
              on_cancelled: Callable[[list[tuple[int, int]]], None] | None = None
              ) -> Heartbeat:
    return Heartbeat(DedicatedConnection(engine.url, "test heartbeat"), "flowq", lambda: held,
                     worker=worker, on_cancelled=on_cancelled)


def rows_by_id(engine: sa.Engine) -> dict[int, Any]:
    return {r.id: r for r in job_rows(engine)}


# -- reaper ----------------------------------------------------------------------------------


def test_reaper_requeues_stale_running_jobs_and_counts_the_attempt(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        stale = add_job(conn, status="running", attempts=2, heartbeat_ago=120)
        fresh = add_job(conn, status="running", attempts=1, heartbeat_ago=1)
        pending = add_job(conn)
    assert Reaper(engine, "flowq", stale_after=30).run_once() == 1
    rows = rows_by_id(engine)
    r = rows[stale]
    assert (r.status, r.attempts, r.locked_by, r.heartbeat_at) == ("pending", 2, None, None)
    assert r.finished_at is None
    assert r.last_error.startswith("WorkerLost: worker old-worker stopped heartbeating during "
                                   "attempt 2 of 10")
    assert rows[fresh].status == "running" and rows[fresh].locked_by == "old-worker"
    assert rows[pending].status == "pending" and rows[pending].last_error is None
    with engine.connect() as conn:  # due at once
        assert conn.execute(sa.text("SELECT run_at <= now() FROM flowq.steps WHERE id = :i"),
                            {"i": stale}).scalar()
    assert Reaper(engine, "flowq", stale_after=30).run_once() == 0  # nothing left to reap


def test_reaper_buries_jobs_that_spent_their_attempts(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        poisoned = add_job(conn, status="running", attempts=3, max_attempts=3, heartbeat_ago=99)
    assert Reaper(engine, "flowq", stale_after=30).run_once() == 1
    r = rows_by_id(engine)[poisoned]
    assert (r.status, r.attempts) == ("dead", 3)
    assert r.finished_at is not None
    assert r.last_error.startswith("WorkerLost:")


def test_reaper_honours_cancel_requested(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        job = add_job(conn, status="running", attempts=1, heartbeat_ago=99,
                      cancel_requested=True)
    assert Reaper(engine, "flowq", stale_after=30).run_once() == 1
    r = rows_by_id(engine)[job]
    assert r.status == "cancelled" and r.finished_at is not None


def test_reaper_respects_its_limit(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        for _ in range(5):
            add_job(conn, status="running", attempts=1, heartbeat_ago=99)
    reaper = Reaper(engine, "flowq", stale_after=30, limit=2)
    assert [reaper.run_once() for _ in range(4)] == [2, 2, 1, 0]


def test_only_one_reaper_runs_at_a_time(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        add_job(conn, status="running", attempts=1, heartbeat_ago=99)
    with engine.connect() as other:
        other.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext('flowq.reaper'))"))
        assert Reaper(engine, "flowq", stale_after=30).run_once() == 0  # another pass holds it
        other.rollback()
    assert Reaper(engine, "flowq", stale_after=30).run_once() == 1


def test_the_reaper_leaves_waits_and_registry_entries_to_their_own_services(
        engine: sa.Engine) -> None:
    with engine.begin() as conn:
        waiting = add_job(conn, status="waiting")
        conn.execute(sa.text("UPDATE flowq.jobs SET run_at = now() - interval '1 second' "
                             "WHERE id = :i"), {"i": waiting})
        add_worker(conn, "gone", beat_ago=3600)
    assert Reaper(engine, "flowq", stale_after=30).run_once() == 0
    assert rows_by_id(engine)[waiting].status == "waiting"
    assert worker_names(engine) == ["gone"]


# -- waits -------------------------------------------------------------------------------


def test_waits_past_their_timeout_become_runnable(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        late = add_job(conn, status="waiting")
        early = add_job(conn, status="waiting")
        conn.execute(sa.text("UPDATE flowq.jobs SET run_at = now() - interval '1 second' "
                             "WHERE id = :i"), {"i": late})
        conn.execute(sa.text("UPDATE flowq.jobs SET run_at = now() + interval '1 hour' "
                             "WHERE id = :i"), {"i": early})
    assert WaitExpirer(engine, "flowq").run_once() == 1
    rows = rows_by_id(engine)
    assert (rows[late].status, rows[early].status) == ("pending", "waiting")
    assert WaitExpirer(engine, "flowq").run_once() == 0


def test_waits_expire_in_bounded_passes_one_at_a_time(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        for _ in range(3):
            job = add_job(conn, status="waiting")
            conn.execute(sa.text("UPDATE flowq.jobs SET run_at = now() - interval '1 second' "
                                 "WHERE id = :i"), {"i": job})
    with engine.connect() as other:
        other.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext('flowq.waits'))"))
        assert WaitExpirer(engine, "flowq").run_once() == 0  # another pass holds it
        other.rollback()
    expirer = WaitExpirer(engine, "flowq", limit=2)
    assert [expirer.run_once() for _ in range(3)] == [2, 1, 0]


# -- the workers registry ------------------------------------------------------------------


def add_worker(conn: sa.Connection, name: str, *, beat_ago: float) -> None:
    conn.execute(sa.text(
        "INSERT INTO flowq.workers (name, host, pid, queues, tasks, concurrency, version, "
        "heartbeat_at) VALUES (:name, 'h', 1, '{q}', '{t}', 1, 'x', "
        "now() - make_interval(secs => :ago))"), {"name": name, "ago": beat_ago})


def worker_names(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT name FROM flowq.workers ORDER BY name"))
                    .scalars())


def test_workers_that_stopped_beating_expire_from_the_registry(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        add_worker(conn, "gone", beat_ago=120)
        add_worker(conn, "alive", beat_ago=1)
    with engine.connect() as other:
        other.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext('flowq.registry'))"))
        assert WorkerExpirer(engine, "flowq", stale=60).run_once() == 0  # another pass holds it
        other.rollback()
    assert WorkerExpirer(engine, "flowq", stale=60).run_once() == 1
    assert worker_names(engine) == ["alive"]


def test_a_registry_entry_beats_enters_again_when_expired_and_leaves(engine: sa.Engine) -> None:
    registry = Registry(engine, "flowq", worker="w1", queues=["a", "b"], tasks=["t"], concurrency=3)
    registry.register()
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.workers SET heartbeat_at = now() - interval '1 hour'"))
    assert registry.run_once() == 0  # a look: the entry is there (the heartbeat beats it)
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT queues, tasks, concurrency, "
                                   "heartbeat_at > now() - interval '1 minute' AS fresh "
                                   "FROM flowq.workers")).one()
    assert (row.queues, row.tasks, row.concurrency, row.fresh) == (["a", "b"], ["t"], 3, False)
    heartbeat(engine, [], worker="w1").run_once()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT heartbeat_at > now() - interval '1 minute' "
                                    "FROM flowq.workers")).scalar_one()
    with engine.begin() as conn:  # as if it stalled past the expiry
        conn.execute(sa.text("DELETE FROM flowq.workers"))
    assert registry.run_once() == 1  # entered again
    assert worker_names(engine) == ["w1"]
    registry.leave()
    assert worker_names(engine) == []


# -- heartbeat ---------------------------------------------------------------------------


def test_heartbeat_refreshes_held_jobs_and_reports_lost_ones(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        mine = add_job(conn, status="running", attempts=1, heartbeat_ago=20, lease=11)
        reaped = add_job(conn, status="running", attempts=1, heartbeat_ago=20, lease=12)
        taken = add_job(conn, status="running", attempts=1, heartbeat_ago=20, lease=14)
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'pending' WHERE id = :i"),
                     {"i": reaped})
    # `taken` was re-claimed under a new lease (its attempts may well be the same again)
    held = [(mine, 11), (reaped, 12), (taken, 13)]
    beat = heartbeat(engine, held)
    assert beat.run_once() == 1  # still ours: `mine`
    assert sorted(beat.lost) == sorted([reaped, taken])
    with engine.connect() as conn:
        ages: dict[int, float] = dict(conn.execute(sa.text(
            "SELECT id, extract(epoch FROM now() - heartbeat_at) FROM flowq.steps "
            "WHERE heartbeat_at IS NOT NULL")).all())
    assert ages[mine] < 10 and ages[taken] >= 19


def test_heartbeat_with_nothing_held_beats_the_entry_alone(engine: sa.Engine) -> None:
    beat = heartbeat(engine, [])
    assert beat.run_once() == 0
    assert beat.lost == []
    assert beat.conn.statements == 1


# -- liveness: a job is alive while its own heartbeat or its worker's entry beats -----------


def register(engine: sa.Engine, name: str = "old-worker") -> None:
    """Enter worker `name` in the registry with this release's capabilities."""
    Registry(engine, "flowq", worker=name, queues=["q"], tasks=["t"], concurrency=1).register()


def age_entry(engine: sa.Engine, seconds: float, name: str = "old-worker") -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.workers SET heartbeat_at = now() - "
                             "make_interval(secs => :s) WHERE name = :n"),
                     {"s": seconds, "n": name})


def beat_ages(engine: sa.Engine) -> dict[int, float]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.text(  # type: ignore[arg-type]
            "SELECT id, extract(epoch FROM now() - heartbeat_at) FROM flowq.steps "
            "WHERE heartbeat_at IS NOT NULL")).all())


def test_a_job_of_a_live_worker_is_not_reaped_however_old_its_own_heartbeat(
        engine: sa.Engine) -> None:
    register(engine)
    with engine.begin() as conn:
        job = add_job(conn, status="running", attempts=1, heartbeat_ago=3600, lease=11)
    heartbeat(engine, [(job, 11)]).run_once()  # the entry lists the lease
    assert Reaper(engine, "flowq", stale_after=30).run_once() == 0
    age_entry(engine, 120)  # the worker stopped beating its entry: dead
    assert Reaper(engine, "flowq", stale_after=30).run_once() == 1
    r = rows_by_id(engine)[job]
    assert r.status == "pending"
    assert r.last_error.startswith("WorkerLost: worker old-worker")


def test_a_claim_its_live_worker_does_not_list_is_reaped(engine: sa.Engine) -> None:
    """A claim whose result never reached its worker, or whose acknowledged completion a
    crash lost: its worker beats on, but does not vouch for it."""
    register(engine)
    with engine.begin() as conn:
        orphan = add_job(conn, status="running", attempts=1, heartbeat_ago=120, lease=11)
        held = add_job(conn, status="running", attempts=1, heartbeat_ago=120, lease=12)
    heartbeat(engine, [(held, 12)]).run_once()
    assert Reaper(engine, "flowq", stale_after=30).run_once() == 1
    assert (rows_by_id(engine)[orphan].status, rows_by_id(engine)[held].status) == (
        "pending", "running")


def test_a_job_whose_worker_entry_is_gone_is_reaped(engine: sa.Engine) -> None:
    with engine.begin() as conn:  # locked_by names a worker that is in no registry entry
        job = add_job(conn, status="running", attempts=1, heartbeat_ago=120)
    assert Reaper(engine, "flowq", stale_after=30).run_once() == 1
    assert rows_by_id(engine)[job].status == "pending"


def test_the_registry_expires_entries_at_the_reapers_limit(engine: sa.Engine) -> None:
    register(engine)
    with engine.begin() as conn:
        job = add_job(conn, status="running", attempts=1, heartbeat_ago=3600, lease=11)
    heartbeat(engine, [(job, 11)]).run_once()
    age_entry(engine, 40)
    # Both at one limit: the entry goes exactly when its jobs are reaped, never before.
    assert WorkerExpirer(engine, "flowq", stale=50).run_once() == 0
    assert Reaper(engine, "flowq", stale_after=50).run_once() == 0
    assert WorkerExpirer(engine, "flowq", stale=30).run_once() == 1
    assert Reaper(engine, "flowq", stale_after=30).run_once() == 1
    assert rows_by_id(engine)[job].status == "pending"


def test_a_beat_of_a_registered_worker_reads_its_jobs_without_writing_them(
        engine: sa.Engine) -> None:
    register(engine)
    with engine.begin() as conn:
        mine = add_job(conn, status="running", attempts=1, heartbeat_ago=20, lease=11)
        taken = add_job(conn, status="running", attempts=1, heartbeat_ago=20, lease=14)
        xmin = dict(conn.execute(sa.text("SELECT id, xmin::text FROM flowq.jobs")).all())
    age_entry(engine, 20)
    beat = heartbeat(engine, [(mine, 11), (taken, 13)])
    assert beat.run_once() == 1 and beat.lost == [taken]
    with engine.connect() as conn:
        assert dict(conn.execute(sa.text("SELECT id, xmin::text FROM flowq.jobs")).all()) == xmin
        assert conn.execute(sa.text("SELECT heartbeat_at > now() - interval '5 seconds' "
                                    "FROM flowq.workers")).scalar_one()
    ages = beat_ages(engine)
    assert ages[mine] >= 19  # its own heartbeat was left alone: the entry stands for it
    assert beat.conn.statements == 1


def test_a_missing_entry_makes_the_beat_refresh_each_job(engine: sa.Engine) -> None:
    """A worker whose entry expired (after a SIGSTOP, say) keeps its jobs alive by their own
    heartbeats until the registry enters it again."""
    with engine.begin() as conn:
        job = add_job(conn, status="running", attempts=1, heartbeat_ago=25, lease=11)
    beat = heartbeat(engine, [(job, 11)])  # "old-worker" has no entry
    assert beat.run_once() == 1
    assert beat_ages(engine)[job] < 5
    assert Reaper(engine, "flowq", stale_after=20).run_once() == 0


def test_a_registered_worker_of_an_earlier_release_makes_every_beat_per_job(
        engine: sa.Engine) -> None:
    register(engine)
    with engine.begin() as conn:
        add_worker(conn, "older-release", beat_ago=1)  # no capabilities: an earlier release
        job = add_job(conn, status="running", attempts=1, heartbeat_ago=20, lease=11)
    beat = heartbeat(engine, [(job, 11)])
    assert beat.run_once() == 1
    assert beat_ages(engine)[job] < 5  # its reaper reads the job's own heartbeat only
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM flowq.workers WHERE name = 'older-release'"))
        conn.execute(sa.text("UPDATE flowq.jobs SET heartbeat_at = now() - interval '20 s'"))
    assert beat.run_once() == 1
    assert beat_ages(engine)[job] >= 19  # every worker reads entries again: read only


def test_cancellation_and_progress_reach_a_beat_that_writes_no_heartbeat(
        engine: sa.Engine) -> None:
    register(engine)
    with engine.begin() as conn:
        quiet = add_job(conn, status="running", attempts=1, heartbeat_ago=20, lease=11)
        stopped = add_job(conn, status="running", attempts=1, heartbeat_ago=20, lease=12,
                          cancel_requested=True)
    told: list[list[tuple[int, int]]] = []
    beat = heartbeat(engine, [(quiet, 11), (stopped, 12)], on_cancelled=told.append)
    assert beat.run_once() == 2
    assert told == [[(stopped, 12)]]
    with engine.begin() as conn:  # progress is still written per job, and only for those
        store = Store(runner(conn), "flowq")
        (landed,) = store.heartbeat("old-worker", [(quiet, 11)], {quiet: '{"done": 3}'})
        assert landed.id == quiet
    with engine.connect() as conn:
        progress = conn.execute(sa.text("SELECT progress FROM flowq.steps WHERE id = :i"),
                                {"i": quiet}).scalar_one()
    assert progress["done"] == 3 and "at" in progress
    assert beat_ages(engine)[quiet] >= 19


# -- pruner ------------------------------------------------------------------------------


def test_pruner_deletes_whole_old_runs_and_keeps_the_rest(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        old = add_job(conn, status="succeeded", finished_ago=5 * DAY)
        old_run = conn.execute(sa.text("SELECT run_id FROM flowq.steps WHERE id = :i"),
                               {"i": old}).scalar_one()
        add_job(conn, run_id=old_run, status="succeeded", finished_ago=4 * DAY)
        recent = add_job(conn, status="succeeded", finished_ago=DAY)
        cancelled_old = add_job(conn, status="cancelled", finished_ago=5 * DAY)
        # A run whose first step finished long ago but whose next step is still pending.
        half = add_job(conn, status="succeeded", finished_ago=5 * DAY)
        half_run = conn.execute(sa.text("SELECT run_id FROM flowq.steps WHERE id = :i"),
                                {"i": half}).scalar_one()
        add_job(conn, run_id=half_run, status="pending")
        # A run with an old step and a recently finished one: kept whole.
        mixed = add_job(conn, status="succeeded", finished_ago=5 * DAY)
        mixed_run = conn.execute(sa.text("SELECT run_id FROM flowq.steps WHERE id = :i"),
                                 {"i": mixed}).scalar_one()
        add_job(conn, run_id=mixed_run, status="succeeded", finished_ago=60)
        running_run = add_job(conn, status="succeeded", finished_ago=5 * DAY)
        rr = conn.execute(sa.text("SELECT run_id FROM flowq.steps WHERE id = :i"),
                          {"i": running_run}).scalar_one()
        add_job(conn, run_id=rr, status="running", attempts=1, heartbeat_ago=1)
    assert Pruner(engine, "flowq", retention=3 * DAY).run_once() == 3
    left = rows_by_id(engine)
    assert old not in left and cancelled_old not in left
    assert {recent, half, mixed, running_run} <= set(left)
    assert len(left) == 7


def test_pruner_keeps_dead_runs_for_dead_retention(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        dead_recent = add_job(conn, status="dead", finished_ago=5 * DAY)
        add_job(conn, status="dead", finished_ago=20 * DAY)
    assert Pruner(engine, "flowq", retention=3 * DAY, dead_retention=14 * DAY).run_once() == 1
    assert set(rows_by_id(engine)) == {dead_recent}


def test_pruner_works_in_bounded_batches(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        for _ in range(7):
            add_job(conn, status="succeeded", finished_ago=5 * DAY)
    statements: list[str] = []
    sa.event.listen(engine, "before_cursor_execute",
                    lambda conn, cur, stmt, *a: statements.append(stmt))
    pruner = Pruner(engine, "flowq", retention=DAY, limit=3, max_batches=2)
    assert pruner.run_once() == 6  # two batches of at most 3 runs each
    assert sum("DELETE FROM flowq.jobs" in s for s in statements) == 2  # batches of runs
    assert pruner.run_once() == 1
    assert pruner.run_once() == 0
    assert job_rows(engine) == []


def test_only_one_pruner_runs_at_a_time(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        add_job(conn, status="succeeded", finished_ago=5 * DAY)
    with engine.connect() as other:
        other.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext('flowq.pruner'))"))
        assert Pruner(engine, "flowq", retention=DAY).run_once() == 0
        other.rollback()
    assert Pruner(engine, "flowq", retention=DAY).run_once() == 1
