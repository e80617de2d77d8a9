"""examples/fastapi_app: the sign-up commits its user and pipeline together, or neither; the
pipeline runs under `adrain` in a rolled-back test transaction and under a real worker
embedded in the app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

import httpx
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

import flowq
from examples.fastapi_app import jobs
from examples.fastapi_app.main import Settings, create_app, get_session
from examples.fastapi_app.models import Account, Base, User
from flowq.enqueueing.aio import AsyncSession
from flowq.ops.runs import get_run
from flowq.testing import (
    DrainResult,
    aassert_enqueued,
    adrain,
    all_enqueued,
    assert_enqueued,
    job_rows,
    wait_until,
)

T = TypeVar("T")
ADA = {"email": "ada@example.com", "name": "Ada"}


@pytest.fixture
def tables(engine: sa.Engine) -> sa.Engine:
    Base.metadata.create_all(engine)
    return engine


@contextlib.asynccontextmanager
async def client(api: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client on the app, inside its lifespan (ASGITransport does not run it)."""
    async with api.router.lifespan_context(api), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api), base_url="http://test") as c:
        yield c


def run(coro: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await coro()
    return asyncio.run(main())


def test_signup_commits_the_user_and_its_pipeline(db_url: str, tables: sa.Engine) -> None:
    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with client(create_app(Settings(db_url))) as c:
            created = await c.post("/signup", json=ADA)
            return created, await c.get(f"/users/{created.json()['id']}")

    created, shown = run(go)
    assert created.status_code == 201, created.text
    body = created.json()
    job = assert_enqueued(tables, jobs.signup, email="ada@example.com")  # committed
    assert (job.run_id, job.queue, job.step) == (body["signup_run_id"], "signups", "create_account")
    assert shown.json() == {**body, "account_id": None}  # no worker ran yet


def test_a_taken_email_is_409_and_enqueues_nothing(db_url: str, tables: sa.Engine) -> None:
    async def go() -> list[int]:
        async with client(create_app(Settings(db_url))) as c:
            first = await c.post("/signup", json=ADA)
            again = await c.post("/signup", json={**ADA, "name": "Ada again"})
            return [first.status_code, again.status_code]

    assert run(go) == [201, 409]
    # The second request's job INSERT ran before its user INSERT failed; the rollback took it.
    assert len(all_enqueued(tables, jobs.signup)) == 1
    assert len(job_rows(tables)) == 1
    with tables.connect() as conn:
        assert conn.execute(sa.select(User.name)).scalars().all() == ["Ada"]


def test_drain_runs_the_pipeline_in_a_rolled_back_transaction(db_url: str,
                                                              tables: sa.Engine) -> None:
    """The app's session joins the test's transaction (SAVEPOINTs); `adrain` runs the three
    steps in it; the test's rollback then leaves no user, job or account behind."""
    api = create_app(Settings(db_url))

    async def go() -> None:
        aengine = create_async_engine(db_url)
        try:
            async with aengine.connect() as conn:
                await conn.begin()
                api.dependency_overrides[get_session] = joined(conn)
                async with client(api) as c:
                    created = await c.post("/signup", json={"email": "eve@example.com",
                                                             "name": "Eve"})
                    assert created.status_code == 201, created.text
                    user_id = created.json()["id"]
                    await aassert_enqueued(conn, jobs.signup, email="eve@example.com")

                    assert await adrain(conn, jobs.app) == DrainResult(succeeded=3)

                    shown = (await c.get(f"/users/{user_id}")).json()
                    account = (await conn.execute(
                        sa.select(Account.id, Account.user_id))).one()
                    assert (shown["account_id"], account.user_id) == (account.id, user_id)
                    steps = (await conn.execute(sa.text(
                        "SELECT step, status FROM flowq.steps ORDER BY id"))).all()
                    assert [tuple(s) for s in steps] == [
                        ("create_account", "succeeded"), ("send_welcome", "succeeded"),
                        ("notify_sales", "succeeded")]
                await conn.rollback()
        finally:
            await aengine.dispose()

    run(go)
    # Outside the database nothing rolls back: the fake mail API got its (one) message.
    assert jobs.mailer.sent_to(to="eve@example.com", template="welcome")
    assert job_rows(tables) == []
    with tables.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(User)).scalar() == 0


def joined(conn: AsyncConnection) -> Callable[[], AsyncIterator[AsyncSession]]:
    """A `get_session` override: a session in `conn`'s transaction, whose commit and rollback
    only release or roll back a SAVEPOINT."""
    async def session() -> AsyncIterator[AsyncSession]:
        async with AsyncSession(bind=conn, join_transaction_mode="create_savepoint",
                                expire_on_commit=False) as s:
            yield s
    return session


def test_a_worker_in_the_lifespan_runs_the_pipeline(db_url: str, tables: sa.Engine) -> None:
    config = flowq.WorkerConfig(concurrency=2, poll_interval=0.2, shutdown_grace=5.0)
    api = create_app(Settings(db_url, worker=config))

    async def go() -> dict[str, Any]:
        async with client(api) as c:
            created = (await c.post("/signup", json={"email": "grace@example.com",
                                                      "name": "Grace"})).json()
            # The worker is another thread with its own connections: wait for the commit.
            await asyncio.to_thread(wait_until, lambda: get_run(
                tables, created["signup_run_id"]).status == "succeeded", 30.0, 0.05,
                "the sign-up run to succeed")
            shown: dict[str, Any] = (await c.get(f"/users/{created['id']}")).json()
            return shown
        # leaving the lifespan stopped the worker and joined its thread

    shown = run(go)
    assert shown["account_id"] is not None
    assert jobs.sales_feed.sent_to(user_id=shown["id"])
    assert [(r.step, r.status) for r in job_rows(tables)] == [
        ("create_account", "succeeded"), ("send_welcome", "succeeded"),
        ("notify_sales", "succeeded")]
    assert not [t for t in threading.enumerate() if t.name == "flowq-worker"]
