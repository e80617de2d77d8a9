"""Uniqueness while active: `enqueue(..., unique=True)` / `unique_key=` returns the task's run
that is still pending, waiting or running instead of starting another, and lets a new one start
once it has finished; race-free under concurrent enqueuers (threads with their own
connections), sync and async, and under REPEATABLE READ (a serialization failure in the race).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker
from support import enqueue

import flowq
from flowq.db.sql import Queries
from flowq.define.options import RESERVED_OPTIONS
from flowq.enqueueing.aio import AsyncSession
from flowq.enqueueing.aio import enqueue as aenqueue
from flowq.testing import drain, job_rows, wait_until

app = flowq.FlowQ()
done: list[Any] = []


@app.task(name="uq_refresh")
def refresh(ctx: flowq.Context, account: int, full: bool = False) -> int:
    done.append(account)
    return account


@app.task(name="uq_other")
def other(ctx: flowq.Context, account: int) -> int:
    return account


fan = app.pipeline("uq_fan")


@fan.step()
def left(ctx: flowq.Context, n: int) -> dict[str, int]:
    return {"n": n}


@fan.step(parents=[])
def right(ctx: flowq.Context, n: int) -> dict[str, int]:
    return {"n": n}


@pytest.fixture(autouse=True)
def _clear() -> Iterator[None]:
    done.clear()
    yield


def uniques(engine: sa.Engine) -> list[tuple[str, int]]:
    with engine.connect() as c:
        return [(r.key, r.run_id) for r in c.execute(sa.text(
            "SELECT key, run_id FROM flowq.uniques ORDER BY key"))]


def active_runs(engine: sa.Engine, task: str) -> set[int]:
    return {r.run_id for r in job_rows(engine, where="task = :t AND status IN "
                                       "('pending', 'running', 'waiting')", t=task)}


# -- the semantics ------------------------------------------------------------------------------


def test_same_arguments_return_the_active_run_until_it_finishes(engine: sa.Engine) -> None:
    first = enqueue(engine, refresh, account=1, unique=True)
    assert first.created
    again = enqueue(engine, refresh, account=1, unique=True)
    assert (again.id, again.job_id, again.created) == (first.id, first.job_id, False)
    # Keyword order does not matter; other arguments, or no uniqueness, start another run.
    assert enqueue(engine, refresh, full=False, account=1, unique=True).id != first.id
    assert enqueue(engine, refresh, account=1, full=False, unique=True).created is False
    assert enqueue(engine, refresh, account=2, unique=True).created
    assert enqueue(engine, refresh, account=1).created
    assert enqueue(engine, other, account=1, unique=True).created  # another task
    assert len(job_rows(engine, where="task = 'uq_refresh'")) == 4

    drain(engine, app)
    after = enqueue(engine, refresh, account=1, unique=True)
    assert after.created and after.id != first.id
    assert enqueue(engine, refresh, account=1, unique=True).id == after.id
    assert dict(uniques(engine))  # held by the new run now
    assert after.id in {run_id for _, run_id in uniques(engine)}


def test_a_running_step_keeps_the_run_active(engine: sa.Engine) -> None:
    first = enqueue(engine, refresh, account=7, unique=True)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'running', attempts = 1 "
                             "WHERE id = :id"), {"id": first.job_id})
    assert enqueue(engine, refresh, account=7, unique=True).id == first.id
    for status in ("dead", "cancelled", "succeeded"):
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE flowq.jobs SET status = :s WHERE run_id = :r"),
                         {"s": status, "r": first.id})
        new = enqueue(engine, refresh, account=7, unique=True)
        assert new.created, status
        with engine.begin() as conn:  # finish it too, for the next status
            conn.execute(sa.text("UPDATE flowq.jobs SET status = 'succeeded' "
                                 "WHERE run_id = :r"), {"r": new.id})
        first = new


def test_unique_key_dedupes_whatever_the_arguments_per_task(engine: sa.Engine) -> None:
    first = enqueue(engine, refresh, account=1, unique_key="nightly")
    assert enqueue(engine, refresh, account=99, unique_key="nightly").id == first.id
    assert enqueue(engine, refresh, account=1, unique_key="hourly").created
    assert enqueue(engine, other, account=1, unique_key="nightly").created
    # unique=True is another key: the task and its arguments.
    assert enqueue(engine, refresh, account=1, unique=True).created
    keys = [k for k, _ in uniques(engine)]
    assert "uq_refresh key nightly" in keys and "uq_other key nightly" in keys
    drain(engine, app)
    assert enqueue(engine, refresh, account=5, unique_key="nightly").created


def test_the_same_transaction_sees_its_own_run(Session: sessionmaker[flowq.Session],
                                               engine: sa.Engine) -> None:
    with Session.begin() as s:
        first = s.enqueue(refresh, account=3, unique=True)
        assert s.enqueue(refresh, account=3, unique=True).id == first.id
    with Session() as s:
        rolled = s.enqueue(refresh, account=4, unique=True)
        s.rollback()
    assert rolled.created
    assert enqueue(engine, refresh, account=4, unique=True).id != rolled.id  # key freed


def test_typed_options_and_by_name(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        first = refresh.options(unique=True).enqueue(conn, 11)
        assert refresh.options(unique=True, priority=3).enqueue(conn, account=11).id == first.id
        keyed = refresh.options(unique_key="k").enqueue(conn, account=12)
        assert refresh.options(unique_key="k").enqueue(conn, 13).id == keyed.id
        by_name = flowq.enqueue(conn, "uq_refresh", account=11, unique=True)
        assert by_name.id == first.id
        # A task this process does not define: the key is made from the name alone.
        far = flowq.enqueue(conn, "uq_elsewhere", queue="default", x=1, unique=True)
        assert flowq.enqueue(conn, "uq_elsewhere", queue="default", x=1, unique=True).id == far.id


def test_a_workflow_starting_with_several_rows(engine: sa.Engine) -> None:
    first = enqueue(engine, fan, n=1, unique=True)
    assert first.created
    assert len(job_rows(engine, where="run_id = :r", r=first.id)) == 2
    again = enqueue(engine, fan, n=1, unique=True)
    assert (again.id, again.job_id, again.created) == (first.id, first.job_id, False)
    assert len(job_rows(engine, where="task = 'uq_fan'")) == 2
    drain(engine, app)
    assert enqueue(engine, fan, n=1, unique=True).created


def test_with_an_idempotency_key_both_are_checked(engine: sa.Engine) -> None:
    first = enqueue(engine, refresh, account=1, unique=True, idempotency_key="i-1")
    # The idempotency key first, whatever the arguments and the run's state.
    assert enqueue(engine, refresh, account=2, unique=True, idempotency_key="i-1").id == first.id
    # Then the unique key: the active run, even under another idempotency key.
    assert enqueue(engine, refresh, account=1, unique=True, idempotency_key="i-2").id == first.id
    drain(engine, app)
    assert enqueue(engine, refresh, account=1, unique=True, idempotency_key="i-1").id == first.id
    new = enqueue(engine, refresh, account=1, unique=True, idempotency_key="i-3")
    assert new.created
    assert [r.idempotency_key for r in job_rows(engine, where="run_id = :r", r=new.id)] == ["i-3"]


def test_a_duplicate_locks_nothing(Session: sessionmaker[flowq.Session],
                                   engine: sa.Engine) -> None:
    """A duplicate reads the key in its snapshot: another duplicate, a worker's heartbeat of
    the run, never wait for its open transaction."""
    first = enqueue(engine, refresh, account=1, unique=True)
    with Session() as open_tx:
        assert open_tx.enqueue(refresh, account=1, unique=True).id == first.id
        with Session() as s:
            s.execute(sa.text("SET LOCAL lock_timeout = '1s'"))
            assert s.enqueue(refresh, account=1, unique=True).id == first.id
            s.execute(sa.text("UPDATE flowq.jobs SET heartbeat_at = now() WHERE id = :id"),
                      {"id": first.job_id})
            s.commit()
        open_tx.commit()


def test_a_claim_whose_run_vanished_is_taken_over(engine: sa.Engine) -> None:
    first = enqueue(engine, refresh, account=1, unique=True)
    with engine.begin() as conn:  # rows deleted by hand, the claim left behind
        conn.execute(sa.text("DELETE FROM flowq.jobs WHERE run_id = :r"), {"r": first.id})
    assert enqueue(engine, refresh, account=1, unique=True).created


def test_the_pruner_deletes_the_keys_of_pruned_runs(engine: sa.Engine) -> None:
    kept = enqueue(engine, refresh, account=1, unique=True)
    gone = enqueue(engine, refresh, account=2, unique=True)
    taken_over = enqueue(engine, refresh, account=3, unique_key="k")
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'succeeded', finished_at = "
                             "now() - interval '2 days' WHERE run_id IN (:a, :b)"),
                     {"a": gone.id, "b": taken_over.id})
    newer = enqueue(engine, refresh, account=4, unique_key="k")  # takes "k" over
    assert newer.created
    with engine.begin() as conn:
        pruned = conn.execute(Queries("flowq").prune_jobs, {
            "retention": 86400, "dead_retention": 86400, "limit": 100}).scalar_one()
    assert pruned == 2
    assert sorted(run_id for _, run_id in uniques(engine)) == sorted([kept.id, newer.id])


# -- concurrency --------------------------------------------------------------------------------


def _race(engine: sa.Engine, n: int, task: Any, hold: float = 0.05,
          **kwargs: Any) -> list[flowq.Enqueued]:
    """`n` threads, each with its own connection, enqueue at the same instant and hold their
    transaction open a moment before committing."""
    barrier = threading.Barrier(n)
    results: list[flowq.Enqueued] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
                conn.commit()
                barrier.wait(timeout=60)
                with conn.begin():
                    run = flowq.enqueue(conn, task, **kwargs)
                    conn.execute(sa.text("SELECT pg_sleep(:s)"), {"s": hold})
            with lock:
                results.append(run)
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert len(results) == n
    return results


def test_fifty_concurrent_enqueuers_give_one_active_run(engine: sa.Engine) -> None:
    results = _race(engine, 50, refresh, account=1, unique=True)
    assert len({r.id for r in results}) == 1
    assert sum(r.created for r in results) == 1
    assert len(active_runs(engine, "uq_refresh")) == 1
    assert len(job_rows(engine)) == 1

    # Once it finished: the next race takes the key over, again exactly once.
    drain(engine, app)
    results = _race(engine, 50, refresh, account=1, unique=True, hold=0.0)
    assert sum(r.created for r in results) == 1
    assert len({r.id for r in results}) == 1
    assert len(active_runs(engine, "uq_refresh")) == 1
    assert len(job_rows(engine)) == 2


def test_concurrent_enqueuers_of_a_key_held_by_a_finished_run(engine: sa.Engine) -> None:
    """The take-over race on its own (the key's row exists, its run has finished): several
    rounds, each with a fresh finished holder."""
    for _ in range(3):
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE flowq.jobs SET status = 'succeeded', "
                                 "finished_at = now()"))
        results = _race(engine, 20, refresh, account=5, unique_key="round", hold=0.02)
        assert sum(r.created for r in results) == 1
        assert len(active_runs(engine, "uq_refresh")) == 1


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_racer_waits_for_an_uncommitted_claim_then_returns_it_or_takes_the_key(
        Session: sessionmaker[flowq.Session], engine: sa.Engine, outcome: str) -> None:
    holder = Session()
    claimed = holder.enqueue(refresh, account=8, unique=True)
    holder_pid = holder.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    result: list[flowq.Enqueued] = []

    def racer() -> None:
        with Session.begin() as s:
            result.append(s.enqueue(refresh, account=8, unique=True))

    t = threading.Thread(target=racer)
    t.start()
    wait_until(lambda: waiting_for(engine, holder_pid),
               message="the racer to wait for the uncommitted claim")
    getattr(holder, outcome)()
    holder.close()
    t.join(30)
    [run] = result
    if outcome == "commit":
        assert (run.id, run.created) == (claimed.id, False)
    else:
        assert run.created and run.id != claimed.id
    assert len(active_runs(engine, "uq_refresh")) == 1


def waiting_for(engine: sa.Engine, holder_pid: int) -> bool:
    with engine.connect() as c:
        return bool(c.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND :h = ANY(pg_blocking_pids(pid))"), {"h": holder_pid}).scalar_one())


def test_async_enqueuers(db_url: str, engine: sa.Engine) -> None:
    async def main() -> list[flowq.Enqueued]:
        aengine = create_async_engine(db_url, pool_size=20)
        try:
            Async = async_sessionmaker(aengine, class_=AsyncSession)

            async def one(i: int) -> flowq.Enqueued:
                if i % 3 == 0:
                    async with aengine.begin() as conn:
                        return await aenqueue(conn, refresh, account=21, unique=True)
                async with Async.begin() as s:
                    if i % 3 == 1:
                        run: flowq.Enqueued = await s.enqueue(refresh, account=21, unique=True)
                    else:
                        run = await refresh.options(unique=True).aenqueue(s, account=21)
                    await s.execute(sa.text("SELECT pg_sleep(0.02)"))
                    return run

            return list(await asyncio.gather(*(one(i) for i in range(15))))
        finally:
            await aengine.dispose()

    results = asyncio.run(main())
    assert len({r.id for r in results}) == 1
    assert sum(r.created for r in results) == 1
    assert len(job_rows(engine)) == 1


# -- REPEATABLE READ ----------------------------------------------------------------------------


def test_repeatable_read(Session: sessionmaker[flowq.Session], engine: sa.Engine) -> None:
    rr = sessionmaker(engine.execution_options(isolation_level="REPEATABLE READ"),
                      class_=flowq.Session)
    # A run committed before the snapshot is returned, even if it finished since.
    first = enqueue(engine, refresh, account=1, unique=True)
    with rr() as s:
        s.execute(sa.text("SELECT 1"))  # the snapshot
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE flowq.jobs SET status = 'succeeded'"))
        assert s.enqueue(refresh, account=1, unique=True).id == first.id
        s.commit()
    # Finished before the snapshot: taken over.
    with rr.begin() as s:
        second = s.enqueue(refresh, account=1, unique=True)
    assert second.created
    # A claim committed after the snapshot: a serialization failure; the retry returns it.
    with rr() as s:
        s.execute(sa.text("SELECT 1"))
        with Session.begin() as other:
            winner = other.enqueue(refresh, account=2, unique=True)
        with pytest.raises(sa.exc.OperationalError) as info:
            s.enqueue(refresh, account=2, unique=True)
        assert getattr(info.value.orig, "sqlstate", None) == "40001"
        s.rollback()
        again = s.enqueue(refresh, account=2, unique=True)
        s.commit()
    assert (again.id, again.created) == (winner.id, False)
    assert len(active_runs(engine, "uq_refresh")) == 2


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["unique", "unique_key"])
def test_a_handler_parameter_named_like_the_options_is_refused(name: str) -> None:
    assert name in RESERVED_OPTIONS
    ns: dict[str, Any] = {}
    exec(f"def handler(ctx, {name}): pass", ns)
    with pytest.raises(flowq.ConfigurationError, match=f"'{name}'.*reserved"):
        flowq.FlowQ().task()(ns["handler"])


@pytest.mark.parametrize(("options", "message"), [
    ({"unique": "yes"}, "unique must be True or False"),
    ({"unique": 1}, "unique must be True or False"),
    ({"unique": True, "unique_key": "k"}, "not both"),
    ({"unique_key": ""}, "unique_key must be a non-empty string"),
    ({"unique_key": 5}, "unique_key must be a non-empty string"),
    ({"unique_key": "x" * 1001}, "unique_key is longer than 1000 bytes"),
    ({"unique_key": "a\x00b"}, "NUL"),
])
def test_bad_options_are_refused_before_any_sql(engine: sa.Engine, options: dict[str, Any],
                                                message: str) -> None:
    with engine.begin() as conn:
        with pytest.raises(flowq.InvalidArgumentsError, match=message):
            flowq.enqueue(conn, refresh, account=1, **options)
        conn.execute(sa.text("SELECT 1"))  # the transaction is still usable
    assert job_rows(engine) == []
