"""The Flask app: `POST /orders` takes stock, records the order and enqueues its receipt, all
in the request's `db.session` transaction; `GET /orders/<id>` shows it.

    DATABASE_URL=postgresql://... flask --app examples.flask_app.app init-db   # tables
    DATABASE_URL=postgresql://... flask --app examples.flask_app.app run

`create_app(database_url=None)` reads DATABASE_URL when no URL is given (the tests pass theirs).
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from flask import Blueprint, Flask, abort, request
from sqlalchemy.exc import IntegrityError

import flowq
from flowq.db import normalize_url

from . import jobs
from .models import Order, Product, Receipt, db

bp = Blueprint("orders", __name__)


@bp.post("/orders")
def place_order() -> tuple[dict[str, Any], int]:
    data = request.get_json()
    order = Order(product_id=data["product_id"], quantity=data["quantity"],
                  email=data["email"])
    db.session.add(order)
    db.session.flush()  # order.id, for the job's arguments
    # db.session is a scoped_session (no .enqueue): the function form joins its transaction.
    run = flowq.enqueue(db.session, jobs.send_receipt, order_id=order.id)
    try:
        # Taking stock last: when there is not enough, the CHECK constraint fails and the
        # rollback removes the order and its job with it.
        db.session.execute(sa.update(Product).where(Product.id == order.product_id)
                           .values(stock=Product.stock - order.quantity))
        db.session.commit()  # the order and its job, together; workers are woken now
    except IntegrityError:
        db.session.rollback()
        return {"error": "not enough stock"}, 409
    return {"id": order.id, "receipt_run_id": run.id}, 201


@bp.get("/orders/<int:order_id>")
def show_order(order_id: int) -> dict[str, Any]:
    order = db.session.get(Order, order_id) or abort(404)
    receipt = db.session.scalar(sa.select(Receipt.message_id)
                                .where(Receipt.order_id == order_id))
    return {"id": order.id, "email": order.email, "quantity": order.quantity,
            "receipt": receipt}


def create_app(database_url: str | None = None) -> Flask:
    url = database_url or os.environ["DATABASE_URL"]
    app = Flask(__name__)
    # Flask-SQLAlchemy's engine uses psycopg 3 (postgresql+psycopg://), like flowq.
    app.config["SQLALCHEMY_DATABASE_URI"] = normalize_url(url).render_as_string(
        hide_password=False)
    db.init_app(app)
    app.register_blueprint(bp)

    @app.cli.command("init-db")
    def init_db() -> None:
        """Create the app's tables (a real app runs its migrations instead)."""
        db.create_all()

    return app
