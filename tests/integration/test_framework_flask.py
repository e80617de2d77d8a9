"""examples/flask_app: an order and its receipt job commit together through Flask-SQLAlchemy's
`db.session`, or neither does; `drain` sends the receipt in a rolled-back test transaction."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("flask")
pytest.importorskip("flask_sqlalchemy")

import sqlalchemy as sa
from flask import Flask
from sqlalchemy import orm

from examples.flask_app import jobs
from examples.flask_app.app import create_app
from examples.flask_app.models import Order, Product, db
from flowq.testing import (
    DrainResult,
    assert_enqueued,
    drain,
    job_rows,
    refute_enqueued,
)

ORDER = {"product_id": 1, "quantity": 2, "email": "ada@example.com"}


@pytest.fixture
def flask_app(db_url: str, engine: sa.Engine) -> Flask:
    app = create_app(db_url)
    with app.app_context():
        db.create_all()
    with engine.begin() as conn:
        conn.execute(sa.insert(Product).values(id=1, name="teapot", stock=3))
    return app


def test_an_order_commits_with_its_receipt_job(flask_app: Flask, engine: sa.Engine) -> None:
    response = flask_app.test_client().post("/orders", json=ORDER)
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json  # type: ignore[assignment]
    job = assert_enqueued(engine, jobs.send_receipt, order_id=body["id"])  # committed
    assert (job.run_id, job.queue) == (body["receipt_run_id"], "mail")
    with engine.connect() as conn:
        assert conn.execute(sa.select(Product.stock)).scalar() == 1


def test_out_of_stock_is_409_and_enqueues_nothing(flask_app: Flask, engine: sa.Engine) -> None:
    response = flask_app.test_client().post("/orders", json={**ORDER, "quantity": 5})
    assert response.status_code == 409
    # The job's INSERT ran before the stock UPDATE failed; the rollback took it back.
    refute_enqueued(engine, jobs.send_receipt)
    assert job_rows(engine) == []
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(Order)).scalar() == 0


@pytest.fixture
def test_transaction(flask_app: Flask, engine: sa.Engine,
                     monkeypatch: pytest.MonkeyPatch) -> Iterator[sa.Connection]:
    """A connection in a transaction the test rolls back, and `db.session` replaced, for this
    test, by sessions joined to it: their commits and rollbacks (the view's) only release or
    roll back SAVEPOINTs. (Flask-SQLAlchemy's own Session picks its engine per table and
    ignores a `bind=` connection, hence a plain scoped Session over the same models.)

    Assert and drain on this connection, not on `db.session`: Flask closes that session when
    the request ends, and closing it rolls back what ran in its SAVEPOINT since its last
    commit, a drain included."""
    with engine.connect() as conn, conn.begin() as transaction:
        session = orm.scoped_session(orm.sessionmaker(
            bind=conn, join_transaction_mode="create_savepoint"))
        monkeypatch.setattr(db, "session", session)
        try:
            yield conn
        finally:
            session.remove()
            transaction.rollback()


def test_drain_sends_the_receipt_in_a_rolled_back_transaction(
        flask_app: Flask, test_transaction: sa.Connection, engine: sa.Engine) -> None:
    client = flask_app.test_client()
    order_id = client.post("/orders", json=ORDER).json["id"]  # type: ignore[index]
    assert_enqueued(test_transaction, jobs.send_receipt, order_id=order_id)

    assert drain(test_transaction, jobs.app) == DrainResult(succeeded=1)

    shown: dict[str, Any] = client.get(f"/orders/{order_id}").json  # type: ignore[assignment]
    assert shown["receipt"].startswith("receipt-flowq:")
    refute_enqueued(test_transaction, jobs.send_receipt)  # it ran: no longer pending
    assert job_rows(engine) == []  # nothing is committed: the fixture rolls it all back
