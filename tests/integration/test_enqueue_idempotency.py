"""Idempotent enqueue under concurrency, sync and async: who waits for whom, and for what.

A duplicate enqueue must not lock the existing run (a worker's heartbeat of it would wait
behind the caller's transaction); a caller racing an uncommitted inserter of its key waits
for that transaction and then gets its run, or inserts its own if it rolled back; under
REPEATABLE READ an old key is returned whatever happened to its row since the snapshot.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, cast

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker
from sqlalchemy.orm import sessionmaker
from support import run_async as arun

import flowq
from flowq.db.runner import raw_sql
from flowq.enqueueing.aio import AsyncSession
from flowq.enqueueing.prepare import KEY_RACE_ATTEMPTS, prepare_enqueue
from flowq.testing import job_rows, wait_until

KEY = "order-1"


@pytest.fixture
def existing(Session: sessionmaker[flowq.Session]) -> flowq.Enqueued:
    """A run committed under KEY before the test starts."""
    with Session.begin() as s:
        return s.enqueue("pay", queue="default", idempotency_key=KEY, who="first")


def heartbeat(engine: sa.Engine, job_id: int) -> None:
    """What a worker's heartbeat does to a running job's row, refusing to wait for a lock long."""
    with engine.begin() as worker:
        worker.execute(sa.text("SET LOCAL lock_timeout = '1s'"))
        updated = worker.execute(sa.text(
            "UPDATE flowq.jobs SET heartbeat_at = now() WHERE id = :id"), {"id": job_id})
        assert updated.rowcount == 1


def backend_pid(session: flowq.Session) -> int:
    return int(session.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())


def blocked_by(engine: sa.Engine, waiter_pid: int, holder_pid: int) -> bool:
    with engine.connect() as c:
        return bool(c.execute(sa.text("SELECT :h = ANY(pg_blocking_pids(:w))"),
                              {"h": holder_pid, "w": waiter_pid}).scalar_one())


def waiting_on_locks(engine: sa.Engine) -> int:
    with engine.connect() as c:
        return int(c.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'")).scalar_one())


class Inserter:
    """A transaction that has enqueued KEY and not ended: it ends once `waiter_pid` is seen
    waiting for it (the check runs in a thread, so the waiter may be this very thread's
    caller, sync or async)."""

    def __init__(self, engine: sa.Engine, outcome: str) -> None:
        self.engine = engine
        self.outcome = outcome
        self.session = sessionmaker(engine, class_=flowq.Session)()
        self.run = self.session.enqueue("pay", queue="default", idempotency_key=KEY, who="inserter")
        assert self.run.created
        self.pid = backend_pid(self.session)
        self.errors: list[BaseException] = []

    def end_when_waited_for(self, waiter_pid: int) -> threading.Thread:
        def end() -> None:
            try:
                wait_until(lambda: blocked_by(self.engine, waiter_pid, self.pid),
                           message="the racing enqueue to wait for the inserter")
                if self.outcome == "commit":
                    self.session.commit()
                else:
                    self.session.rollback()
            except BaseException as exc:  # reported by the test, with the thread's context
                self.errors.append(exc)
            finally:
                self.session.close()

        thread = threading.Thread(target=end)
        thread.start()
        return thread


# -- no lock on the existing run ------------------------------------------------------------


def test_a_duplicate_enqueue_does_not_lock_the_existing_run(
        Session: sessionmaker[flowq.Session], engine: sa.Engine,
        existing: flowq.Enqueued) -> None:
    with Session() as s:
        again = s.enqueue("pay", queue="default", idempotency_key=KEY, who="again")
        assert (again.id, again.job_id, again.created) == (existing.id, existing.job_id, False)
        heartbeat(engine, existing.job_id)  # while the duplicate's transaction is open
        s.commit()
    [row] = job_rows(engine)
    assert row.args == {"who": "first"}


def test_a_duplicate_enqueue_does_not_wait_for_a_worker_updating_the_run(
        Session: sessionmaker[flowq.Session], engine: sa.Engine,
        existing: flowq.Enqueued) -> None:
    with engine.connect() as worker:
        worker.execute(sa.text("UPDATE flowq.jobs SET heartbeat_at = now() WHERE id = :id"),
                       {"id": existing.job_id})  # row locked until the worker commits
        with Session() as s:
            s.execute(sa.text("SET LOCAL lock_timeout = '1s'"))
            again = s.enqueue("pay", queue="default", idempotency_key=KEY)
            s.commit()
        worker.commit()
    assert (again.id, again.created) == (existing.id, False)


# -- REPEATABLE READ ------------------------------------------------------------------------


def test_repeatable_read_returns_an_old_key_whose_row_changed_after_the_snapshot(
        engine: sa.Engine, existing: flowq.Enqueued) -> None:
    rr = sessionmaker(engine.execution_options(isolation_level="REPEATABLE READ"),
                      class_=flowq.Session)
    with rr() as s:
        s.execute(sa.text("SELECT 1"))  # the snapshot is taken here
        heartbeat(engine, existing.job_id)  # a worker updates the row and commits
        again = s.enqueue("pay", queue="default", idempotency_key=KEY)
        s.commit()
    assert (again.id, again.job_id, again.created) == (existing.id, existing.job_id, False)
    assert len(job_rows(engine)) == 1


def test_repeatable_read_refuses_a_key_inserted_after_the_snapshot(
        Session: sessionmaker[flowq.Session], engine: sa.Engine) -> None:
    """The one documented serialization failure: the caller retries its transaction."""
    rr = sessionmaker(engine.execution_options(isolation_level="REPEATABLE READ"),
                      class_=flowq.Session)
    with rr() as s:
        s.execute(sa.text("SELECT 1"))
        with Session.begin() as other:
            winner = other.enqueue("pay", queue="default", idempotency_key=KEY)
        with pytest.raises(sa.exc.OperationalError) as info:
            s.enqueue("pay", queue="default", idempotency_key=KEY)
        assert getattr(info.value.orig, "sqlstate", None) == "40001"
        s.rollback()
        retried = s.enqueue("pay", queue="default", idempotency_key=KEY)
        s.commit()
    assert (retried.id, retried.created) == (winner.id, False)


# -- racing an uncommitted inserter ---------------------------------------------------------


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_caller_racing_an_uncommitted_inserter_waits_for_its_outcome(
        Session: sessionmaker[flowq.Session], engine: sa.Engine, outcome: str) -> None:
    inserter = Inserter(engine, outcome)
    with Session() as s:
        ender = inserter.end_when_waited_for(backend_pid(s))
        run = s.enqueue("pay", queue="default", idempotency_key=KEY, who="racer")
        s.commit()
    ender.join(30)
    assert inserter.errors == []
    [row] = job_rows(engine)
    if outcome == "commit":  # it waited, then read the winner's run
        assert (run.id, run.job_id, run.created) == (inserter.run.id, inserter.run.job_id, False)
        assert row.args == {"who": "inserter"}
    else:  # it waited, then inserted its own
        assert run.created
        assert run.id != inserter.run.id
        assert (row.run_id, row.args) == (run.id, {"who": "racer"})


def test_50_concurrent_enqueuers_of_one_key_agree_on_one_run(engine: sa.Engine) -> None:
    """Every creator holds its insert open until all callers still in `enqueue` wait for it,
    then some roll back: one run survives, every committer holds its id, and nobody returned
    before the transaction it raced had ended."""
    n = 50
    Session = sessionmaker(engine, class_=flowq.Session)
    with engine.begin() as c:  # committed callers record what they got, in their transaction
        c.execute(sa.text("CREATE TABLE ledger (who int PRIMARY KEY, run_id bigint NOT NULL, "
                          "created boolean NOT NULL)"))
    lock = threading.Lock()
    in_enqueue = [n]
    first_returned, go = threading.Event(), threading.Event()
    returned_at: dict[int, float] = {}
    creator_ended_at: dict[int, float] = {}  # run id -> just before its creator ended
    results: dict[int, tuple[str, flowq.Enqueued]] = {}
    errors: list[BaseException] = []

    def caller(i: int) -> None:
        try:
            if i:
                go.wait(30)
            with Session() as s:
                run = s.enqueue("charge", queue="default", idempotency_key="concurrent", who=i)
                returned_at[i] = time.monotonic()
                with lock:
                    in_enqueue[0] -= 1
                if i == 0:
                    first_returned.set()
                if run.created:
                    wait_until(lambda: waiting_on_locks(engine) >= in_enqueue[0],
                               message="the other callers to wait for the creator")
                    creator_ended_at[run.id] = time.monotonic()
                if i % 4 == 0:  # the first creator and some others roll back
                    s.rollback()
                    results[i] = ("rolled back", run)
                else:
                    s.execute(sa.text("INSERT INTO ledger VALUES (:who, :run_id, :created)"),
                              {"who": i, "run_id": run.id, "created": run.created})
                    s.commit()
                    results[i] = ("committed", run)
        except BaseException as exc:  # reported below, with the thread's context
            errors.append(exc)
            first_returned.set()

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(n)]
    threads[0].start()
    assert first_returned.wait(30)
    for t in threads[1:]:
        t.start()
    go.set()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []

    [row] = job_rows(engine)
    committed = {i: run for i, (outcome, run) in results.items() if outcome == "committed"}
    assert {run.id for run in committed.values()} == {row.run_id}
    with engine.connect() as c:
        ledger = {who: (run_id, created) for who, run_id, created in c.execute(
            sa.text("SELECT who, run_id, created FROM ledger"))}
    assert ledger == {i: (run.id, run.created) for i, run in committed.items()}
    assert sum(created for _, created in ledger.values()) == 1
    first_run = results[0][1]
    assert first_run.created and first_run.id != row.run_id  # the first creator's run is gone
    for i, (_, run) in results.items():
        if i:  # everyone raced the first creator's uncommitted insert, and waited for it
            assert returned_at[i] > creator_ended_at[first_run.id]
        if not run.created:  # a matched run was returned only once its creator had ended
            assert returned_at[i] > creator_ended_at[run.id]


# -- the async path -------------------------------------------------------------------------


def test_async_duplicate_enqueue_does_not_lock_the_existing_run(
        db_url: str, engine: sa.Engine, existing: flowq.Enqueued) -> None:
    async def go(aengine: AsyncEngine) -> flowq.Enqueued:
        async with async_sessionmaker(aengine, class_=AsyncSession)() as s:
            again = await s.enqueue("pay", queue="default", idempotency_key=KEY, who="again")
            await asyncio.to_thread(heartbeat, engine, existing.job_id)
            fresh = await s.enqueue("pay", queue="default", idempotency_key="another-key")
            await s.commit()
        assert fresh.created
        return again

    again = arun(db_url, go)
    assert (again.id, again.job_id, again.created) == (existing.id, existing.job_id, False)
    assert len(job_rows(engine)) == 2


def test_async_repeatable_read_returns_an_old_key_whose_row_changed(
        db_url: str, engine: sa.Engine, existing: flowq.Enqueued) -> None:
    async def go(aengine: AsyncEngine) -> flowq.Enqueued:
        rr = aengine.execution_options(isolation_level="REPEATABLE READ")
        async with async_sessionmaker(rr, class_=AsyncSession)() as s:
            await s.execute(sa.text("SELECT 1"))
            await asyncio.to_thread(heartbeat, engine, existing.job_id)
            again = await s.enqueue("pay", queue="default", idempotency_key=KEY)
            await s.commit()
        return again

    again = arun(db_url, go)
    assert (again.id, again.created) == (existing.id, False)


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_async_caller_racing_an_uncommitted_inserter_waits_for_its_outcome(
        db_url: str, engine: sa.Engine, outcome: str) -> None:
    inserter = Inserter(engine, outcome)

    async def go(aengine: AsyncEngine) -> flowq.Enqueued:
        async with async_sessionmaker(aengine, class_=AsyncSession)() as s:
            pid = (await s.execute(sa.text("SELECT pg_backend_pid()"))).scalar_one()
            ender = inserter.end_when_waited_for(pid)
            run = await s.enqueue("pay", queue="default", idempotency_key=KEY, who="racer")
            await s.commit()
        await asyncio.to_thread(ender.join, 30)
        return run

    run = arun(db_url, go)
    assert inserter.errors == []
    [row] = job_rows(engine)
    assert run.created is (outcome == "rollback")
    assert row.run_id == run.id
    if outcome == "commit":
        assert (run.id, run.job_id) == (inserter.run.id, inserter.run.job_id)



@pytest.mark.parametrize("races", [1, KEY_RACE_ATTEMPTS])
def test_a_winner_deleted_before_it_is_read_is_retried_then_reported(
        db_url: str, engine: sa.Engine, races: int) -> None:
    """Each time the keyed INSERT is sent, another transaction inserts the key first and
    commits while the INSERT waits; the row is deleted before the follow-up read. A bounded
    number of such races is survived; more raise a flowq error, not an SQL one."""
    inserters: list[tuple[Inserter, threading.Thread]] = []
    pid: list[int] = []

    def interfere(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statement = statement.strip()
        if statement.startswith("WITH existing") and len(inserters) < races:
            inserter = Inserter(engine, "commit")
            inserters.append((inserter, inserter.end_when_waited_for(pid[0])))
        elif statement.startswith("SELECT") and "idempotency_key =" in statement:
            with engine.begin() as c:  # the winner is pruned before we can read it
                c.execute(sa.text("DELETE FROM flowq.jobs WHERE idempotency_key = :k"),
                          {"k": KEY})
                c.execute(sa.text("DELETE FROM flowq.run_keys WHERE key = :k"), {"k": KEY})

    async def go(aengine: AsyncEngine) -> flowq.Enqueued | None:
        sa.event.listen(aengine.sync_engine, "before_cursor_execute", interfere)
        async with async_sessionmaker(aengine, class_=AsyncSession)() as s:
            pid.append((await s.execute(sa.text("SELECT pg_backend_pid()"))).scalar_one())
            run: flowq.Enqueued | None = None
            try:
                run = await s.enqueue("pay", queue="default", idempotency_key=KEY, who="racer")
            except flowq.FlowqError as exc:
                assert "deleted" in str(exc) and KEY in str(exc)
                await s.enqueue("after", queue="default")  # the transaction is still usable
            await s.commit()
        return run

    run = arun(db_url, go)
    for inserter, ender in inserters:
        ender.join(30)
        assert inserter.errors == []
    assert len(inserters) == races
    if races < KEY_RACE_ATTEMPTS:
        assert run is not None and run.created
        assert [(r.run_id, r.args) for r in job_rows(engine)] == [(run.id, {"who": "racer"})]
    else:
        assert run is None
        assert [r.task for r in job_rows(engine)] == ["after"]


def test_keys_in_another_schema(db_url: str, engine: sa.Engine) -> None:
    flowq.migrate(engine, schema="flowq_alt")
    Session = sessionmaker(engine, class_=flowq.Session)
    with Session.begin() as s:
        default = s.enqueue("pay", queue="default", idempotency_key=KEY)
        first = s.enqueue("pay", queue="default", idempotency_key=KEY, schema="flowq_alt", who="first")
    with Session.begin() as s:
        again = s.enqueue("pay", queue="default", idempotency_key=KEY, schema="flowq_alt")

    async def go(aengine: AsyncEngine) -> flowq.Enqueued:
        async with async_sessionmaker(aengine, class_=AsyncSession).begin() as s:
            return await s.enqueue("pay", queue="default", idempotency_key=KEY, schema="flowq_alt")

    via_async = arun(db_url, go)
    assert (default.created, first.created, again.created, via_async.created) == (
        True, True, False, False)
    assert again.id == via_async.id == first.id
    assert [r.args for r in job_rows(engine, "flowq_alt")] == [{"who": "first"}]
    assert [r.run_id for r in job_rows(engine)] == [default.id]


def test_the_key_is_read_through_its_unique_index(
        Session: sessionmaker[flowq.Session], engine: sa.Engine) -> None:
    with Session.begin() as s:
        s.enqueue_many("filler", [{"n": i} for i in range(2000)], queue="default")
        s.enqueue("pay", queue="default", idempotency_key=KEY)
    with engine.begin() as c:
        c.execute(sa.text("ANALYZE flowq.jobs"))
    call = prepare_enqueue("pay", {}, idempotency_key=KEY, queue="default")
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url) as raw:
        for statement in (call.statement, call.lookup):
            assert statement is not None
            sql = raw_sql(cast(sa.ClauseElement, statement))
            plan = "\n".join(r[0] for r in raw.execute(f"EXPLAIN {sql}", call.params))
            assert "jobs_idempotency_key_idx" in plan, plan
            assert "Seq Scan" not in plan, plan
