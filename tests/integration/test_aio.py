"""The async twin: the same guarantees through AsyncSession and AsyncConnection (psycopg async)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from support import run_async as run

import flowq
from flowq.enqueueing.aio import AsyncSession, enqueue, enqueue_many


def _rows(engine: sa.Engine) -> list[sa.Row[Any]]:
    with engine.connect() as c:
        return list(c.execute(sa.text(
            "SELECT run_id, task, queue, args FROM flowq.steps ORDER BY id")))


def test_flowq_does_not_import_the_async_module() -> None:
    code = "import sys, flowq; assert 'flowq.enqueueing.aio' not in sys.modules, 'eager'; " \
           "assert 'sqlalchemy.ext.asyncio' not in sys.modules, 'asyncio ext'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_commit_and_rollback_through_async_session(db_url: str, engine: sa.Engine) -> None:
    async def go(aengine: AsyncEngine) -> tuple[flowq.Enqueued, flowq.Enqueued]:
        Session = async_sessionmaker(aengine, class_=AsyncSession)
        async with Session() as s:
            kept = await s.enqueue("async_kept", queue="aq", n=1)
            await s.commit()
        async with Session() as s:
            gone = await s.enqueue("async_gone", queue="default", n=2)
            await s.rollback()
        return kept, gone

    kept, _ = run(db_url, go)
    assert kept.created
    assert [(r.run_id, r.task, r.queue, r.args) for r in _rows(engine)] == [
        (kept.id, "async_kept", "aq", {"n": 1})]


def test_savepoint_and_async_connection(db_url: str, engine: sa.Engine) -> None:
    async def go(aengine: AsyncEngine) -> None:
        async with aengine.connect() as conn:
            await enqueue(conn, "outer", queue="default")
            sp = await conn.begin_nested()
            await enqueue(conn, "inner", queue="default")
            await sp.rollback()
            await conn.commit()

    run(db_url, go)
    assert [r.task for r in _rows(engine)] == ["outer"]


def test_idempotency_and_bulk(db_url: str, engine: sa.Engine) -> None:
    async def go(aengine: AsyncEngine) -> tuple[flowq.Enqueued, flowq.Enqueued, list[int]]:
        Session = async_sessionmaker(aengine, class_=AsyncSession)
        async with Session.begin() as s:
            a = await s.enqueue("pay", queue="default", idempotency_key="async-key", amount=1)
        async with Session.begin() as s:
            b = await enqueue(s, "pay", queue="default", idempotency_key="async-key", amount=2)
            ids = await s.enqueue_many("bulk", [{"i": i} for i in range(100)], queue="default")
        return a, b, ids

    a, b, ids = run(db_url, go)
    assert (a.created, b.created, a.id) == (True, False, b.id)
    rows = _rows(engine)
    assert rows[0].args == {"amount": 1}
    assert [r.run_id for r in rows[1:]] == ids
    assert [r.args["i"] for r in rows[1:]] == list(range(100))


def test_concurrent_idempotent_enqueues_agree(db_url: str, engine: sa.Engine) -> None:
    async def go(aengine: AsyncEngine) -> set[int]:
        Session = async_sessionmaker(aengine, class_=AsyncSession)

        async def one(i: int) -> int:
            async with Session.begin() as s:
                return (await s.enqueue("charge", queue="default", idempotency_key="k", who=i)).id

        return set(await asyncio.gather(*(one(i) for i in range(10))))

    ids = run(db_url, go)
    assert len(ids) == 1
    assert [r.run_id for r in _rows(engine)] == list(ids)


def test_bad_input_leaves_the_async_transaction_usable(db_url: str, engine: sa.Engine) -> None:
    async def go(aengine: AsyncEngine) -> None:
        async with async_sessionmaker(aengine, class_=AsyncSession)() as s:
            with pytest.raises(flowq.InvalidArgumentsError, match="when"):
                await s.enqueue("t", queue="default", when=object())
            with pytest.raises(flowq.InvalidQueueError):
                await enqueue_many(s, "t", [{}], queue="bad queue!")
            await s.enqueue("after", queue="default")
            await s.commit()

    run(db_url, go)
    assert [r.task for r in _rows(engine)] == ["after"]


@pytest.mark.parametrize("options", [
    {"delay": 8e13}, {"delay": timedelta.max}, {"delay": timedelta.min},
    {"run_at": datetime.max.replace(tzinfo=timezone.utc)},
    {"run_at": datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))},
])
def test_a_due_time_out_of_range_leaves_the_async_transaction_usable(
        db_url: str, engine: sa.Engine, options: dict[str, Any]) -> None:
    async def go(aengine: AsyncEngine) -> None:
        async with async_sessionmaker(aengine, class_=AsyncSession)() as s:
            await s.enqueue("before", queue="default")
            with pytest.raises(flowq.InvalidArgumentsError, match=r"run_at|delay"):
                await s.enqueue("t", queue="default", **options)
            with pytest.raises(flowq.InvalidArgumentsError, match=r"run_at|delay"):
                await enqueue_many(s, "t", [{}], queue="default", **options)
            await s.enqueue("after", queue="default")
            await s.commit()

    run(db_url, go)
    assert [r.task for r in _rows(engine)] == ["before", "after"]


def test_missing_schema_in_async(empty_db_url: str) -> None:
    async def go(aengine: AsyncEngine) -> int:
        async with aengine.connect() as conn:
            with pytest.raises(flowq.SchemaMissingError, match="flowq migrate"):
                await enqueue(conn, "t", queue="default")
            return int((await conn.execute(sa.text("SELECT 1"))).scalar_one())

    assert run(empty_db_url, go) == 1


def test_sync_session_is_refused_with_a_pointer(engine: sa.Engine) -> None:
    with engine.connect() as conn, pytest.raises(TypeError, match=r"flowq\.enqueue"):
        asyncio.run(enqueue(conn, "t", queue="default"))  # type: ignore[arg-type]


def test_an_asyncpg_session_enqueues_like_a_psycopg_one(db_url: str, engine: sa.Engine) -> None:
    """FastAPI apps usually run on asyncpg: every enqueue statement (keyless, keyed, bulk,
    delayed) works through it, in the caller's transaction."""
    asyncpg_url = sa.make_url(db_url).set(drivername="postgresql+asyncpg")

    async def main() -> tuple[flowq.Enqueued, flowq.Enqueued, list[int]]:
        aengine = create_async_engine(asyncpg_url)
        try:
            Session = async_sessionmaker(aengine, class_=AsyncSession)
            async with Session() as s:
                plain = await s.enqueue("via_asyncpg", queue="aq", n=1, delay=5)
                keyed = await s.enqueue("via_asyncpg", queue="default", idempotency_key="apg", n=2)
                again = await s.enqueue("via_asyncpg", queue="default", idempotency_key="apg", n=3)
                many = await s.enqueue_many("via_asyncpg", [{"n": 4}, {"n": 5}], queue="default")
                await s.commit()
            assert (again.id, again.created) == (keyed.id, False)
            async with Session() as s:
                await s.enqueue("via_asyncpg", queue="default", n=6)
                await s.rollback()
            return plain, keyed, many
        finally:
            await aengine.dispose()

    plain, keyed, many = asyncio.run(main())
    rows = _rows(engine)
    assert [r.run_id for r in rows] == [plain.id, keyed.id, *many]
    assert [r.args["n"] for r in rows] == [1, 2, 4, 5]
