"""The hot table and its history (revision 0018): `flowq.jobs` holds live rows only; a row
that ends moves to `flowq.job_history` in the transaction that ends it, whoever writes the
end; idempotency keys outlive the row that carried them; the previous release's workers keep
their layout while they are registered; an existing database migrates with its data, and
rolls back after the previous release reused a key; `flowq runs cancel` racing the
completion that moves a row; the keys of runs a pruner of the previous release deleted."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import sqlalchemy as sa
from support import scalar
from tenacity import stop_after_attempt

import flowq
import flowq.ops.runs as runs_module
from flowq.db.migrations import downgrade, migrate
from flowq.db.schema import JOB_COLUMNS
from flowq.db.sql import Queries
from flowq.define.pipeline import Pipeline
from flowq.ops.runs import cancel_run, get_run, retry_run
from flowq.testing import drain, wait_until

Q = Queries("flowq")


def where(engine: sa.Engine, job_id: int) -> tuple[int, int]:
    """How many rows of job `job_id` are in (jobs, job_history)."""
    return (scalar(engine, "SELECT count(*) FROM flowq.jobs WHERE id = :i", i=job_id),
            scalar(engine, "SELECT count(*) FROM flowq.job_history WHERE id = :i", i=job_id))


def first_job(engine: sa.Engine, run_id: int) -> int:
    return int(scalar(engine, "SELECT min(id) FROM flowq.steps WHERE run_id = :r", r=run_id))


def defined(app: flowq.FlowQ, name: str) -> Pipeline:
    """`app`'s own definition of `name`. An enqueue by name takes the definition of any live
    app of the schema, and other modules' apps (kept alive by their imports) define "chain"
    or "ok" with other steps and policies."""
    found = app.get(name)
    assert found is not None, name
    return found


@pytest.fixture
def hist_app() -> flowq.FlowQ:
    app = flowq.FlowQ()

    @app.task(name="ok")
    def ok(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"n": n}

    @app.task(name="boom", retry=flowq.Retry(stop=stop_after_attempt(1)))
    def boom(ctx: flowq.Context) -> None:
        raise RuntimeError("boom")

    pipe = app.pipeline("two")

    @pipe.step()
    def a(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"m": n + 1}

    @pipe.step()
    def b(ctx: flowq.Context, m: int) -> int:
        return m * 2

    chain = app.pipeline("chain")

    @chain.step()
    def s1(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"n": n}

    @chain.step()
    def s2(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"n": n}

    @chain.step()
    def s3(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"n": n}

    return app


def test_every_end_moves_its_row_and_live_rows_stay(engine: sa.Engine,
                                                    hist_app: flowq.FlowQ) -> None:
    with engine.begin() as conn:
        ok = flowq.enqueue(conn, defined(hist_app, "ok"), n=1)
        bad = flowq.enqueue(conn, defined(hist_app, "boom"))
        later = flowq.enqueue(conn, defined(hist_app, "ok"), n=2, delay=3600)
        two = flowq.enqueue(conn, defined(hist_app, "two"), n=3)
        doomed = flowq.enqueue(conn, defined(hist_app, "ok"), n=4, delay=3600)
    drain(engine, hist_app, raise_on_dead=False)
    assert where(engine, first_job(engine, ok.id)) == (0, 1)      # a success: the fast path
    assert where(engine, first_job(engine, bad.id)) == (0, 1)     # dead: the trigger
    assert where(engine, first_job(engine, later.id)) == (1, 0)   # pending: live
    assert scalar(engine, "SELECT count(*) FROM flowq.job_history WHERE run_id = :r",
                  r=two.id) == 2                                   # both steps of a pipeline
    assert get_run(engine, two.id).status == "succeeded"
    assert get_run(engine, two.id).steps[-1].result == 8
    with engine.begin() as conn:  # an operator's UPDATE by hand moves it too
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'cancelled', finished_at = now() "
                             "WHERE run_id = :r"), {"r": doomed.id})
    assert where(engine, first_job(engine, doomed.id)) == (0, 1)
    assert scalar(engine, "SELECT count(*) FROM flowq.jobs WHERE status IN "
                          "('succeeded', 'dead', 'cancelled')") == 0
    row = get_run(engine, ok.id).steps[0]
    assert (row.status, row.result, row.locked_by) == ("succeeded", {"n": 1}, None)
    assert row.finished_at is not None and row.started_at is not None


def test_a_key_outlives_its_first_row(engine: sa.Engine, hist_app: flowq.FlowQ) -> None:
    with engine.begin() as conn:
        first = flowq.enqueue(conn, defined(hist_app, "ok"), n=1, idempotency_key="order-7")
    drain(engine, hist_app, raise_on_dead=False)
    assert where(engine, first_job(engine, first.id)) == (0, 1)
    with engine.begin() as conn:
        again = flowq.enqueue(conn, defined(hist_app, "ok"), n=2, idempotency_key="order-7")
    assert (again.id, again.created) == (first.id, False)
    assert scalar(engine, "SELECT count(*) FROM flowq.steps WHERE task = 'ok'") == 1
    with engine.begin() as conn:  # a workflow's multi-root enqueue meets the same key
        again = flowq.enqueue(conn, defined(hist_app, "two"), n=2, idempotency_key="order-7")
    assert (again.id, again.created) == (first.id, False)


def test_two_enqueues_of_one_key_meet_on_its_entry(engine: sa.Engine,
                                                   hist_app: flowq.FlowQ) -> None:
    results: list[flowq.Enqueued] = []
    with engine.connect() as holder:
        holder.begin()
        mine = flowq.enqueue(holder, defined(hist_app, "ok"), n=1, idempotency_key="k")

        def other() -> None:
            with engine.begin() as conn:
                results.append(flowq.enqueue(conn, defined(hist_app, "ok"), n=2, idempotency_key="k"))

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive()  # waiting for the holder's entry in run_keys
        holder.commit()
        thread.join(30)
    assert [(r.id, r.created) for r in results] == [(mine.id, False)]
    assert scalar(engine, "SELECT count(*) FROM flowq.steps") == 1


def test_a_retried_dead_run_comes_back_to_jobs(engine: sa.Engine,
                                                hist_app: flowq.FlowQ) -> None:
    with engine.begin() as conn:
        bad = flowq.enqueue(conn, defined(hist_app, "boom"))
    drain(engine, hist_app, raise_on_dead=False)
    job = first_job(engine, bad.id)
    assert get_run(engine, bad.id).status == "dead"
    assert retry_run(engine, bad.id).job_ids == (job,)
    assert where(engine, job) == (1, 0)
    assert get_run(engine, bad.id).status == "pending"
    drain(engine, hist_app, raise_on_dead=False)  # dies again, and moves again
    assert where(engine, job) == (0, 1)
    (row,) = get_run(engine, bad.id).steps
    assert (row.status, row.attempts) == ("dead", 1)


def test_while_a_previous_release_worker_is_registered_rows_stay(
        engine: sa.Engine, hist_app: flowq.FlowQ) -> None:
    """A worker without the `job_history` capability reads finished rows from `jobs` only
    (a join's mapped results, a child's end): until it is gone nothing moves."""
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO flowq.workers (name, host, pid, queues, tasks, concurrency, version) "
            "VALUES ('old', 'h', 1, '{default}', '{ok}', 1, '0.9')"))  # capabilities NULL
        ok = flowq.enqueue(conn, defined(hist_app, "ok"), n=1)
        bad = flowq.enqueue(conn, defined(hist_app, "boom"))
    drain(engine, hist_app, raise_on_dead=False)
    assert where(engine, first_job(engine, ok.id)) == (1, 0)
    assert where(engine, first_job(engine, bad.id)) == (1, 0)
    assert get_run(engine, ok.id).status == "succeeded"
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM flowq.workers WHERE name = 'old'"))
        later = flowq.enqueue(conn, defined(hist_app, "ok"), n=2)
    drain(engine, hist_app, raise_on_dead=False)
    assert where(engine, first_job(engine, later.id)) == (0, 1)


def test_an_existing_database_migrates_with_its_data(engine: sa.Engine,
                                                   hist_app: flowq.FlowQ) -> None:
    """From revision 0017 with finished, live and keyed rows: nothing is lost, keys hold,
    the finished rows stay readable (in `jobs` until the maintenance pass moves them)."""
    downgrade(engine, revision="0017")
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO flowq.jobs (task, step, status, result, finished_at, "
            "idempotency_key) VALUES ('ok', 'ok', 'succeeded', '{\"n\": 1}', now(), 'k1'), "
            "('ok', 'ok', 'pending', NULL, NULL, 'k2'), ('ok', 'ok', 'dead', NULL, now(), NULL)"))
        before = conn.execute(sa.text("SELECT id, run_id, status FROM flowq.jobs ORDER BY id")
                              ).all()
    migrate(engine)
    with engine.connect() as conn:
        after = conn.execute(sa.text("SELECT id, run_id, status FROM flowq.steps ORDER BY id")
                             ).all()
        keys = conn.execute(sa.text("SELECT key, run_id FROM flowq.run_keys ORDER BY key")
                            ).all()
    assert after == before
    assert keys == [("k1", before[0].run_id), ("k2", before[1].run_id)]
    with engine.begin() as conn:
        for key, row in (("k1", before[0]), ("k2", before[1])):
            again = flowq.enqueue(conn, defined(hist_app, "ok"), n=9, idempotency_key=key)
            assert (again.id, again.created) == (row.run_id, False)
    downgrade(engine, revision="0017")  # and back: the finished rows return to jobs
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id, run_id, status FROM flowq.jobs ORDER BY id")
                            ).all() == before
    migrate(engine)


def test_steps_has_the_columns_of_jobs(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        names = conn.execute(sa.text(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = 'flowq' "
            "AND table_name = :t ORDER BY ordinal_position"), {"t": "steps"}).scalars().all()
    assert names == [*JOB_COLUMNS.split(", "), "retired_at"]


def someone_waits_for_a_lock(engine: sa.Engine) -> bool:
    return bool(scalar(engine, "SELECT count(*) FROM pg_stat_activity "
                               "WHERE datname = current_database() AND wait_event_type = 'Lock'"))


def complete_with_successor(conn: sa.Connection, claimed: Any, step: str, index: int) -> None:
    """What a worker's completer sends for a chain step: its success and its successor."""
    conn.execute(Q.complete_steps, {
        "ids": [claimed.id], "leases": [claimed.lease], "results": ['{"n": 1}'],
        "next_ids": [claimed.id], "next_leases": [claimed.lease], "next_tasks": ["chain"],
        "next_steps": [step], "next_step_indexes": [index], "next_queues": ["default"],
        "next_max_attempts": [3], "next_args": ['{"n": 1}'], "next_map_indexes": [None],
        "next_delays": [0.0], "channel": "flowq"})


def claim_one(conn: sa.Connection) -> Any:
    return conn.execute(Q.claim_jobs, {"queue": "default", "limit": 1, "worker": "w"}).first()


def test_cancel_racing_a_completion_that_moves_a_row_still_locks_the_run(
        engine: sa.Engine, hist_app: flowq.FlowQ, monkeypatch: pytest.MonkeyPatch) -> None:
    """`flowq.ops.runs._lock` repeats `lock_run_jobs` until the set of locked ids stops
    changing. It started from an empty set; a completion DELETEs its row
    (`completions.succeed`), so a lock pass that waited for it finds the row gone (FOR UPDATE
    skips a deleted row; before 0018 it followed the UPDATE to the new version and locked
    it), and its moved copy in history is newer than the pass's snapshot: the first pass
    returns no id, equal to the initial empty set, and the loop stops with NOTHING locked.
    `cancel_run` then went on believing no step could complete until it committed: the
    successor s2 was claimed and completed (creating s3) while the cancel ran, and the run
    kept running (s3 pending, nothing cancelled). Now at least two passes are made."""
    with engine.begin() as conn:
        run = flowq.enqueue(conn, defined(hist_app, "chain"), n=1)
    paused, go = threading.Event(), threading.Event()
    real_read_run = runs_module.read_run
    calls: list[int] = []

    def read_run_then_pause(conn: sa.Connection, q: Queries, run_id: int) -> Any:
        info = real_read_run(conn, q, run_id)
        if not calls:  # the read at the end of `_lock`: the run's rows are locked by now
            calls.append(run_id)
            paused.set()
            go.wait(30)
        return info

    monkeypatch.setattr(runs_module, "read_run", read_run_then_pause)
    with engine.connect() as worker:
        with worker.begin():
            first = claim_one(worker)
        tx = worker.begin()
        complete_with_successor(worker, first, "s2", 1)  # in flight when the cancel starts
        with ThreadPoolExecutor(1) as pool:
            cancelling = pool.submit(cancel_run, engine, run.id)
            wait_until(lambda: someone_waits_for_a_lock(engine), timeout=30,
                       message="cancel's lock pass to wait for the completion")
            tx.commit()
            assert paused.wait(30)
            # The cancel holds its run's locks: a worker's claim must skip s2 (SKIP LOCKED).
            with worker.begin():
                second = claim_one(worker)
            if second is not None:  # it did not: s2 runs and completes meanwhile
                tx = worker.begin()
                complete_with_successor(worker, second, "s3", 2)
                go.set()
                wait_until(lambda: someone_waits_for_a_lock(engine), timeout=30,
                           message="cancel's UPDATE to wait for s2's completion")
                tx.commit()
            go.set()
            res = cancelling.result(timeout=30)
    steps = [(s.step, s.status) for s in get_run(engine, run.id).steps]
    assert (res.run.status, steps) == ("cancelled", [("s1", "succeeded"), ("s2", "cancelled")]), (
        f"cancel_run returned {res.run.status!r} (cancelled={res.cancelled}) and left {steps}")
    assert second is None, "cancel_run's _lock returned holding no lock on the run's rows"


def test_downgrade_after_a_previous_release_producer_reused_a_moved_key(
        engine: sa.Engine, hist_app: flowq.FlowQ) -> None:
    """docs/operations.md: a producer of the previous release enqueuing
    with an idempotency_key finds a live run only, so a key enqueued again after its run
    moved to history creates a new run (its row in `jobs` carries the key; the old run's
    first row in `job_history` carries it too). The documented rollback,
    `downgrade(engine, revision="0017")`, then INSERTs the history rows back into `jobs`
    (0018 downgrade), where the two rows collided on the unique `jobs_idempotency_key_idx`
    (an IntegrityError). The key now stays on the live row, and the finished one returns
    without it."""
    with engine.begin() as conn:
        first = flowq.enqueue(conn, defined(hist_app, "ok"), n=1, idempotency_key="order-1")
    drain(engine, hist_app)
    assert scalar(engine, "SELECT count(*) FROM flowq.job_history WHERE run_id = :r",
                  r=first.id) == 1
    with engine.begin() as conn:  # the previous release's keyed enqueue (jobs only)
        conn.execute(sa.text(
            "INSERT INTO flowq.jobs (task, step, args, idempotency_key) "
            "VALUES ('ok', 'ok', '{\"n\": 2}', 'order-1') "
            "ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING"))
    assert scalar(engine, "SELECT count(*) FROM flowq.steps "
                          "WHERE idempotency_key = 'order-1'") == 2  # as documented
    downgrade(engine, revision="0017")
    assert scalar(engine, "SELECT count(*) FROM flowq.jobs") == 2


def test_every_other_end_moves_once_with_its_key(engine: sa.Engine, hist_app: flowq.FlowQ) -> None:
    """The reaper burying a keyed row dead, a deadline cancelling a keyed pending row,
    `cancel_run`, and a late completion of a row already moved (the fence) each leave the
    row once in history, its key recorded once in run_keys, and change nothing after."""
    with engine.begin() as conn:
        reaped = flowq.enqueue(conn, defined(hist_app, "boom"), idempotency_key="reaped")  # one attempt
        timed = flowq.enqueue(conn, defined(hist_app, "ok"), n=2, idempotency_key="timed", delay=3600,
                              deadline=7200)
        cancelled = flowq.enqueue(conn, defined(hist_app, "ok"), n=3, idempotency_key="cancelled", delay=3600)
    with engine.begin() as conn:
        claimed = claim_one(conn)
        conn.execute(sa.text("UPDATE flowq.jobs SET heartbeat_at = now() - interval '1 hour' "
                             "WHERE id = :i"), {"i": claimed.id})
        conn.execute(sa.text("UPDATE flowq.jobs SET deadline = now() - interval '1 second' "
                             "WHERE run_id = :r"), {"r": timed.id})
    with engine.begin() as conn:
        assert len(conn.execute(Q.reap_jobs, {"stale": 60, "limit": 10,
                                              "channel": "flowq"}).all()) == 1
        assert len(conn.execute(Q.cancel_expired_jobs, {"error": "late %s",
                                                         "limit": 10}).all()) == 1
    cancel_run(engine, cancelled.id)
    with engine.begin() as conn:  # the reaped attempt's worker completes late: nothing
        assert conn.execute(Q.complete_jobs, {"ids": [claimed.id], "leases": [claimed.lease],
                                              "results": ["1"], "channel": "flowq"}).all() == []
    for run, status in ((reaped, "dead"), (timed, "cancelled"), (cancelled, "cancelled")):
        assert scalar(engine, "SELECT count(*) FROM flowq.jobs WHERE run_id = :r",
                      r=run.id) == 0
        assert scalar(engine, "SELECT count(*) FROM flowq.job_history WHERE run_id = :r "
                              "AND status = :s", r=run.id, s=status) == 1
        assert scalar(engine, "SELECT count(*) FROM flowq.run_keys WHERE run_id = :r",
                      r=run.id) == 1
        assert get_run(engine, run.id).status == status


# The pre-0018 pruner's DELETE (git show 13ec97b^:flowq/db/sql/jobs.py, `prune_jobs`), the
# part that matters here: whole finished runs deleted from `jobs`; it knows no `run_keys`.
PREVIOUS_RELEASE_PRUNE = """
    WITH old AS (
        SELECT DISTINCT j.run_id FROM flowq.jobs j
         WHERE j.status IN ('succeeded', 'dead', 'cancelled')
           AND j.finished_at < now() - make_interval(secs => :retention)
           AND NOT EXISTS (
               SELECT 1 FROM flowq.jobs o
                WHERE o.run_id = j.run_id
                  AND (o.status IN ('pending', 'running', 'waiting')
                       OR o.finished_at >= now() - make_interval(secs => :retention))
               OFFSET 0)
         LIMIT 100)
    DELETE FROM flowq.jobs WHERE run_id IN (SELECT run_id FROM old)"""


def test_a_key_pruned_by_a_previous_release_pruner_after_the_migration_is_not_wedged(
        engine: sa.Engine, hist_app: flowq.FlowQ) -> None:
    """Revision 0018 copies the key of every keyed row of `jobs` into
    `run_keys`, and the previous release's workers keep running (docs: migrate first, then
    start the new workers, then stop the old ones), pruner included. That pruner deletes a
    finished run's rows from `jobs` and knows nothing of `run_keys`, so the key's entry stays,
    naming a run with no row. From then on `FIND_RUN_BY_KEY` finds nothing (its run_keys arm
    needs a row in `steps`, its jobs arm needs no entry in run_keys), `claim_key` conflicts
    on the entry and inserts nothing: every enqueue of that key failed with FlowqError
    ("could not enqueue with idempotency_key ..."), forever. Now the enqueue frees such an
    entry (`release_orphaned_key`) and starts a new run, as a pruned key did before 0018."""
    downgrade(engine, revision="0017")
    with engine.begin() as conn:  # a keyed run that ended 4 days ago, under 0017
        run_id = conn.execute(sa.text(
            "INSERT INTO flowq.jobs (task, step, status, result, finished_at, idempotency_key) "
            "VALUES ('ok', 'ok', 'succeeded', '{\"n\": 1}', now() - interval '4 days', "
            "'order-9') RETURNING run_id")).scalar_one()
    flowq.migrate(engine)
    assert scalar(engine, "SELECT run_id FROM flowq.run_keys WHERE key = 'order-9'") == run_id
    with engine.begin() as conn:  # a worker of the previous release, still running its pass
        conn.execute(sa.text(
            "INSERT INTO flowq.workers (name, host, pid, queues, tasks, concurrency, version) "
            "VALUES ('old', 'h', 1, '{default}', '{ok}', 1, '0.9')"))
        conn.execute(sa.text(PREVIOUS_RELEASE_PRUNE), {"retention": 3 * 86400.0})
        conn.execute(sa.text("DELETE FROM flowq.workers WHERE name = 'old'"))  # it stops
    from flowq.worker.pruner import Pruner
    Pruner(engine, "flowq").run_once()  # this release's pass leaves the entry: the enqueue frees it
    with engine.begin() as conn:
        again = flowq.enqueue(conn, defined(hist_app, "ok"), n=2, idempotency_key="order-9")
    assert again.created and again.id != run_id


def claim(conn: sa.Connection, job_id: int) -> Any:
    """Claim job `job_id` (and only it: its run's), as a worker would."""
    run_id = conn.execute(sa.text("SELECT run_id FROM flowq.jobs WHERE id = :i"),
                          {"i": job_id}).scalar_one()
    row = conn.execute(Q.claim_run_jobs, {"queue": "default", "limit": 1, "worker": "w",
                                          "run_ids": [run_id]}).one()
    assert row.id == job_id
    return row


def test_a_row_inserted_already_terminal_is_moved_by_the_trigger(engine: sa.Engine) -> None:
    """`jobs_retire` fires AFTER INSERT too: a row written straight into a terminal status (a
    restore, an operator's INSERT) ends in history, its key recorded in run_keys."""
    with engine.begin() as conn:
        job_id = conn.execute(sa.text(
            "INSERT INTO flowq.jobs (task, step, status, finished_at, idempotency_key) "
            "VALUES ('t', '', 'dead', now(), 'restored') RETURNING id")).scalar_one()
    assert where(engine, job_id) == (0, 1)
    assert scalar(engine, "SELECT count(*) FROM flowq.run_keys WHERE key = 'restored'") == 1


def test_a_suspension_of_a_cancelled_claim_moves_it_once_and_keeps_its_snooze_count(
        engine: sa.Engine) -> None:
    """`suspend_job` (a durable sleep, a snooze) of a claim whose run was cancelled meanwhile
    ends it `cancelled` through the trigger; the snooze count written by the same statement
    is kept, and a second suspension of the (moved) claim changes nothing."""
    with engine.begin() as conn:
        run = flowq.enqueue(conn, "sleeper", queue="default")
    job_id = first_job(engine, run.id)
    with engine.begin() as conn:
        got = claim(conn, job_id)
        conn.execute(sa.text("UPDATE flowq.jobs SET cancel_requested = true WHERE id = :i"),
                     {"i": job_id})
    params = {"id": got.id, "lease": got.lease, "step": "", "until": None, "delay": 60.0,
              "snoozes": 3, "note": None}
    with engine.begin() as conn:
        out = conn.execute(Q.suspend_job, params).one()
    assert out.status == "cancelled"
    assert where(engine, job_id) == (0, 1)
    assert scalar(engine, "SELECT result::text FROM flowq.checkpoints WHERE run_id = :r "
                          "AND name = 'flowq.snoozes'", r=run.id) == "3"
    with engine.begin() as conn:
        assert conn.execute(Q.suspend_job, params).all() == []
    assert where(engine, job_id) == (0, 1)


def test_a_retried_dead_parent_keeps_its_job_id_so_its_childs_end_wakes_it(
        engine: sa.Engine) -> None:
    """A parent step that died after starting a child comes back to `jobs` with its id
    (`runs retry` moves the row back), so the child's link (`children.parent_job_id`) still
    names it: once it suspends in its wait again, the completion ending the child makes it
    due at once (`wake_parents`)."""
    with engine.begin() as conn:
        parent = flowq.enqueue(conn, "parent", queue="default")
        child = flowq.enqueue(conn, "child", queue="default", delay=3600)
    p_job, c_job = first_job(engine, parent.id), first_job(engine, child.id)
    with engine.begin() as conn:
        got = claim(conn, p_job)
        assert conn.execute(Q.insert_child, {
            "job_id": p_job, "child_run_id": child.id, "run_id": parent.id, "step": "",
            "map_index": None, "name": "flowq.child.0"}).one().linked == 1
        conn.execute(Q.end_job, {"id": got.id, "lease": got.lease, "status": "dead",
                                 "error": "crashed", "channel": "flowq"})
    assert where(engine, p_job) == (0, 1)
    assert retry_run(engine, parent.id).job_ids == (p_job,)
    assert where(engine, p_job) == (1, 0)
    with engine.begin() as conn:  # the retried attempt suspends in ctx.wait
        got = claim(conn, p_job)
        conn.execute(Q.suspend_job, {"id": got.id, "lease": got.lease, "step": "",
                                     "until": None, "delay": 3600.0, "snoozes": None,
                                     "note": None})
        conn.execute(sa.text("UPDATE flowq.jobs SET run_at = now() WHERE id = :i"),
                     {"i": c_job})
    with engine.begin() as conn:
        got = claim(conn, c_job)
        conn.execute(Q.complete_jobs, {"ids": [got.id], "leases": [got.lease],
                                       "results": ["1"], "channel": "flowq"})
    assert scalar(engine, "SELECT run_at <= now() FROM flowq.jobs WHERE id = :i", i=p_job)
