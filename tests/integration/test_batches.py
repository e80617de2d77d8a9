"""Batches: `with session.batch(on_complete=task, **args)` enqueues `task` once, with the
batch's counts, when every run enqueued in the block has finished; the reaper's pass is
driven with `run_once()`. The real-process case (200 runs, a SIGKILLed worker, a ledger) is
marked slow."""

from __future__ import annotations

import signal
import threading
from typing import Any

import batch_app
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker
from tenacity import stop_after_attempt

import flowq
from flowq.db.runner import runner
from flowq.db.store import Store
from flowq.ops.runs import cancel_run, get_run
from flowq.testing import drain, job_rows, wait_until
from flowq.worker.pruner import Pruner
from flowq.worker.reaper import Reaper


def make_app() -> tuple[flowq.FlowQ, list[dict[str, Any]]]:
    app = flowq.FlowQ()
    calls: list[dict[str, Any]] = []

    @app.task(retry=flowq.Retry(stop=stop_after_attempt(1)))
    def work(ctx: flowq.Context, n: int) -> None:
        if n % 5 == 0:
            raise RuntimeError(f"item {n} fails")

    chain = app.pipeline("chain")

    @chain.step()
    def one(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"n": n}

    @chain.step()
    def two(ctx: flowq.Context, n: int) -> None: ...

    @app.task()
    def done(ctx: flowq.Context, batch_id: int, succeeded: int, dead: int, cancelled: int,
             tag: str) -> None:
        calls.append({"batch_id": batch_id, "succeeded": succeeded, "dead": dead,
                      "cancelled": cancelled, "tag": tag})

    return app, calls


def reap(engine: sa.Engine) -> int:
    return Reaper(engine, "flowq", stale_after=30).run_once()


def callbacks(engine: sa.Engine) -> list[Any]:
    return job_rows(engine, where="task = 'done'")


def test_the_callback_runs_once_with_the_counts_when_every_run_has_finished(
        Session: sessionmaker[flowq.Session]) -> None:
    app, calls = make_app()
    engine = Session.kw["bind"]
    with Session.begin() as s:
        with s.batch(on_complete=app.get("done"), tag="t") as batch:
            runs = [s.enqueue(app.get("work"), n=n).id for n in range(1, 8)]  # 5 dies
            runs += s.enqueue_many(app.get("work"), [{"n": 8}, {"n": 10}])  # 10 dies
            runs.append(app.get("chain").enqueue(s, n=1).id)  # typed enqueue joins too
            cancelled = s.enqueue(app.get("work"), n=11).id
            again = s.enqueue(app.get("work"), idempotency_key="k", n=12)
            assert s.enqueue(app.get("work"), idempotency_key="k", n=12).id == again.id
        assert batch.runs == 12  # the duplicate key's run joined once
    cancel_run(engine, cancelled)
    drain(engine, app, raise_on_dead=False, runs=runs[:3], batches=False)
    assert reap(engine) == 0 and callbacks(engine) == []  # not finished yet
    drain(engine, app, raise_on_dead=False, batches=False)
    assert callbacks(engine) == []  # left to the reaper's pass
    assert reap(engine) == 1
    assert reap(engine) == 0  # once
    drain(engine, app)
    assert calls == [{"batch_id": batch.id, "succeeded": 9, "dead": 2, "cancelled": 1,
                      "tag": "t"}]
    assert len(callbacks(engine)) == 1
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT * FROM flowq.batches")).one()
        left = conn.execute(sa.text("SELECT count(*) FROM flowq.batch_runs")).scalar()
    assert (row.runs, row.succeeded, row.dead, row.cancelled, left) == (12, 9, 2, 1, 0)
    assert get_run(engine, row.callback_run_id).status == "succeeded"


def test_a_run_that_ended_within_the_block_is_in_the_batch(
        Session: sessionmaker[flowq.Session]) -> None:
    """A run cancelled in the transaction that enqueued it has left `flowq.jobs` for
    history by the time the block ends: it is one of the batch's runs all the same."""
    app, calls = make_app()
    engine = Session.kw["bind"]
    with Session.begin() as s:
        with s.batch(on_complete=app.get("done"), tag="ended") as batch:
            run_id = s.enqueue(app.get("work"), n=1).id
            cancel_run(s.connection(), run_id)
        assert batch.runs == 1
    assert reap(engine) == 1
    drain(engine, app)
    assert calls == [{"batch_id": batch.id, "succeeded": 0, "dead": 0, "cancelled": 1,
                      "tag": "ended"}]


def test_a_rolled_back_transaction_or_an_exception_leaves_no_batch(
        Session: sessionmaker[flowq.Session]) -> None:
    app, _ = make_app()
    engine = Session.kw["bind"]
    with Session() as s:
        with s.batch(app.get("done"), tag="r"):
            s.enqueue(app.get("work"), n=1)
        s.rollback()
    with Session() as s, pytest.raises(KeyError), s.batch(app.get("done"), tag="e"):
        s.enqueue(app.get("work"), n=1)
        raise KeyError("boom")
    with Session.begin() as s:  # the session is usable again; a savepoint's run is not waited for
        with s.batch(app.get("done"), tag="s") as batch:
            with s.begin_nested() as sp:
                s.enqueue(app.get("work"), n=2)
                sp.rollback()
            s.enqueue(app.get("work"), n=3)
        assert batch.runs == 1
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM flowq.batches")).scalar() == 1


def test_an_empty_batch_enqueues_its_callback_at_exit_with_zero_counts(
        Session: sessionmaker[flowq.Session]) -> None:
    app, calls = make_app()
    engine = Session.kw["bind"]
    with Session() as s:
        with s.batch(app.get("done"), tag="empty") as batch:
            pass
        assert len(job_rows(engine, where="task = 'done'")) == 0  # not committed yet
        s.commit()
    assert batch.runs == 0
    drain(engine, app)
    assert calls == [{"batch_id": batch.id, "succeeded": 0, "dead": 0, "cancelled": 0,
                      "tag": "empty"}]
    assert reap(engine) == 0


def test_the_pruner_deletes_fired_batches_after_the_retention_and_no_open_one(
        Session: sessionmaker[flowq.Session]) -> None:
    app, _ = make_app()
    engine = Session.kw["bind"]
    with Session.begin() as s:
        with s.batch(app.get("done"), tag="old") as old:
            pass
        with s.batch(app.get("done"), tag="open") as still_open:
            s.enqueue(app.get("work"), n=1)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.batches SET fired_at = now() - interval '2 days' "
                             "WHERE id = :id"), {"id": old.id})
    Pruner(engine, "flowq", retention=86400.0).run_once()
    with engine.connect() as conn:
        left = conn.execute(sa.text("SELECT id FROM flowq.batches ORDER BY id")).scalars().all()
    assert left == [still_open.id]


def test_concurrent_passes_enqueue_the_callback_exactly_once(
        Session: sessionmaker[flowq.Session]) -> None:
    app, _ = make_app()
    engine = Session.kw["bind"]
    with Session.begin() as s, s.batch(app.get("done"), tag="c") as batch:
        s.enqueue_many(app.get("work"), [{"n": n} for n in range(1, 61)])
    drain(engine, app, raise_on_dead=False, batches=False)
    fired: list[int] = []
    barrier = threading.Barrier(6)

    def pass_() -> None:
        # The pass's two statements without the reaper's advisory lock: only the rows'
        # locks keep them apart.
        barrier.wait()
        while True:
            with engine.begin() as conn:
                store = Store(runner(conn, direct=False), "flowq")
                store.advance_batches(7)
                fired.extend(f.id for f in store.start_batch_callbacks(10))
            with engine.connect() as conn:
                if conn.execute(sa.text("SELECT fired_at IS NOT NULL FROM flowq.batches"
                                        )).scalar():
                    return

    threads = [threading.Thread(target=pass_) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert fired == [batch.id]
    [callback] = callbacks(engine)
    assert callback.args == {"batch_id": batch.id, "succeeded": 48, "dead": 12,
                             "cancelled": 0, "tag": "c"}


def test_hostile_callbacks_are_refused_before_anything_is_written(
        Session: sessionmaker[flowq.Session]) -> None:
    app, _ = make_app()
    engine = Session.kw["bind"]
    cases: list[tuple[Any, dict[str, Any], str]] = [
        (app.get("done"), {"tag": float("nan")}, "JSON cannot represent"),
        (app.get("done"), {}, "tag"),
        (app.get("done"), {"tag": "x", "extra": 1}, "extra"),
        (app.get("done"), {"tag": "x", "batch_id": 3}, "the batch gives its callback"),
        (app.get("done"), {"tag": "x", "idempotency_key": "k"}, "only queue= and priority="),
        (app.get("done"), {"tag": "x", "priority": "high"}, "priority"),
        ("nowhere", {"tag": "x"}, "not a task or pipeline defined in this process"),
        (42, {}, "needs a task or pipeline"),
    ]
    with Session.begin() as s:
        for callback, args, message in cases:
            with pytest.raises(flowq.FlowqError, match=message), s.batch(callback, **args):
                raise AssertionError("the block ran")
        with s.batch(app.get("done"), tag="outer"), pytest.raises(
                flowq.InvalidArgumentsError, match="do not nest"), s.batch(
                app.get("done"), tag="inner"):
            pass
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM flowq.batches")).scalar() == 1


def test_an_async_session_batch(engine: sa.Engine, db_url: str) -> None:
    import asyncio

    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from flowq.enqueueing.aio import AsyncSession

    app, calls = make_app()

    async def main() -> int:
        aengine = create_async_engine(db_url)
        try:
            async with async_sessionmaker(aengine, class_=AsyncSession)() as s, s.begin(), \
                    s.batch(app.get("done"), tag="a") as batch:
                await s.enqueue(app.get("work"), n=1)
                await s.enqueue_many(app.get("work"), [{"n": 2}, {"n": 5}])
            return batch.id
        finally:
            await aengine.dispose()

    batch_id = asyncio.run(main())
    drain(engine, app, raise_on_dead=False, batches=False)
    assert reap(engine) == 1
    drain(engine, app)
    assert calls == [{"batch_id": batch_id, "succeeded": 2, "dead": 1, "cancelled": 0,
                      "tag": "a"}]


@pytest.mark.slow
def test_a_batch_of_200_runs_survives_a_sigkilled_worker(
        ledger: sa.Engine, db_url: str, spawn_worker: Any) -> None:
    """Real workers: one is SIGKILLed mid-way; its jobs are reaped and run again; the callback
    is enqueued exactly once, with counts that match the ledger."""
    with ledger.begin() as conn:
        conn.exec_driver_sql(batch_app.LEDGER_DDL)
    Session = sessionmaker(ledger, class_=flowq.Session)
    with Session.begin() as s, s.batch(batch_app.finished, tag="kill") as batch:
        s.enqueue_many(batch_app.item, [{"n": n} for n in range(200)])
    fast = ("--stale-after", "2", "--heartbeat-interval", "0.5", "--reap-interval", "0.5",
            "--poll-interval", "0.2")
    victim = spawn_worker("batch_app:app", db_url, "-c", "8", *fast)

    def ledger_count() -> int:
        with ledger.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM ledger")).scalar_one())

    wait_until(lambda: ledger_count() >= 40, timeout=60, message="40 runs done")
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    spawn_worker("batch_app:app", db_url, "-c", "8", *fast)

    def callback_rows() -> list[Any]:
        with ledger.connect() as conn:
            return list(conn.execute(sa.text("SELECT * FROM batch_ledger")))

    wait_until(callback_rows, timeout=120, message="the batch's callback")
    with ledger.connect() as conn:
        succeeded = conn.execute(sa.text("SELECT count(DISTINCT run_id) FROM ledger")).scalar()
        written = conn.execute(sa.text("SELECT count(*) FROM ledger")).scalar()
        dead = conn.execute(sa.text(
            "SELECT count(DISTINCT run_id) FROM flowq.steps WHERE task = 'item' "
            "AND status = 'dead'")).scalar()
        unfinished = conn.execute(sa.text(
            "SELECT count(*) FROM flowq.steps WHERE status IN ('pending', 'running', "
            "'waiting') AND task = 'item'")).scalar()
        fired = conn.execute(sa.text("SELECT count(*) FROM flowq.steps WHERE task = 'finished'"
                                     )).scalar()
    assert unfinished == 0
    assert succeeded == written == 180 and dead == 20  # each success written once
    [row] = callback_rows()
    assert (row.batch_id, row.succeeded, row.dead, row.cancelled) == (batch.id, 180, 20, 0)
    assert fired == 1
