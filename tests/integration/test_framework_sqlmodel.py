"""examples/sqlmodel_app: SQLModel's Session with flowq's SessionMixin enqueues in the request's
transaction; the kit sees the job, a failed request leaves none, and drain and run_step run
the handler against the test's rolled-back transaction."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest

pytest.importorskip("sqlmodel")
pytest.importorskip("fastapi")
pytest.importorskip("httpx")

import httpx
import sqlalchemy as sa
from fastapi import FastAPI
from sqlmodel import SQLModel, select

from examples.sqlmodel_app import jobs
from examples.sqlmodel_app.main import create_app, get_session
from examples.sqlmodel_app.models import Invoice, Session
from flowq.testing import (
    DrainResult,
    all_enqueued,
    assert_enqueued,
    drain,
    job_rows,
    refute_enqueued,
    run_step,
)

T = TypeVar("T")
INVOICE = {"number": "INV-1", "email": "ada@example.com", "amount_cents": 1200}


@pytest.fixture
def api(db_url: str) -> FastAPI:
    return create_app(db_url)


def with_client(api: FastAPI, fn: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    """`fn(client)` with an httpx client on the app, inside its lifespan (engine, tables)."""
    async def main() -> T:
        async with api.router.lifespan_context(api), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=api), base_url="http://test") as client:
            return await fn(client)
    return asyncio.run(main())


def test_an_invoice_commits_with_its_job(api: FastAPI, engine: sa.Engine) -> None:
    async def go(client: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
        created = await client.post("/invoices", json=INVOICE)
        return created, await client.get(f"/invoices/{created.json()['id']}")

    created, shown = with_client(api, go)
    assert created.status_code == 201, created.text
    assert shown.json()["emailed"] is False
    job = assert_enqueued(engine, jobs.send_invoice, number="INV-1")  # committed
    assert job.queue == "invoices"


def test_a_taken_number_is_409_and_enqueues_nothing(api: FastAPI, engine: sa.Engine) -> None:
    async def go(client: httpx.AsyncClient) -> list[int]:
        return [(await client.post("/invoices", json=body)).status_code for body in [
            INVOICE,
            {**INVOICE, "email": "eve@example.com"},  # the number is taken
            {**INVOICE, "number": "INV-2", "amount_cents": 0},  # refused before any SQL
        ]]

    assert with_client(api, go) == [201, 409, 422]
    # The second job's INSERT ran before the invoice's failed at commit; the rollback took it.
    assert len(all_enqueued(engine, jobs.send_invoice, queue="invoices")) == 1
    refute_enqueued(engine, jobs.send_invoice, number="INV-2")
    assert len(job_rows(engine)) == 1


@pytest.fixture
def test_transaction(api: FastAPI, engine: sa.Engine) -> Iterator[sa.Connection]:
    """A connection in a transaction rolled back after the test, and the app's sessions
    joined to it (their commit and rollback only release or roll back a SAVEPOINT)."""
    with engine.connect() as conn, conn.begin() as transaction:
        def joined() -> Iterator[Session]:
            with Session(bind=conn, join_transaction_mode="create_savepoint") as session:
                yield session

        api.dependency_overrides[get_session] = joined
        try:
            yield conn
        finally:
            api.dependency_overrides.clear()
            transaction.rollback()


def test_drain_sends_the_invoice_in_a_rolled_back_transaction(
        api: FastAPI, test_transaction: sa.Connection, engine: sa.Engine) -> None:
    async def go(client: httpx.AsyncClient) -> bool:
        invoice_id = (await client.post("/invoices", json=INVOICE)).json()["id"]
        assert_enqueued(test_transaction, jobs.send_invoice, number="INV-1")

        assert drain(test_transaction, jobs.app) == DrainResult(succeeded=1)

        emailed: bool = (await client.get(f"/invoices/{invoice_id}")).json()["emailed"]
        return emailed

    assert with_client(api, go) is True
    assert "ada@example.com" in jobs.mailer.sent.values()
    assert job_rows(engine) == []  # nothing committed: the fixture rolls it all back


def test_the_handler_alone_with_run_step(engine: sa.Engine) -> None:
    SQLModel.metadata.create_all(engine)
    with Session(engine) as session:  # never committed: closing it rolls everything back
        session.add(Invoice(number="INV-9", email="bob@example.com", amount_cents=500))
        session.flush()
        run_step(jobs.send_invoice, session=session, number="INV-9")
        invoice = session.exec(select(Invoice).where(Invoice.number == "INV-9")).one()
        assert invoice.emailed
    assert jobs.mailer.sent["flowq:0:send_invoice"] == "bob@example.com"  # synthetic run id
