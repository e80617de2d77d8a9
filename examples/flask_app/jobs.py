"""The flowq app and its one task, `send_receipt`: `flowq worker examples.flask_app.jobs:app`.

The worker needs no Flask app context: the handler uses `ctx.session`, flowq's own Session,
and the models' tables (Flask-SQLAlchemy models are ordinary mapped classes).
"""

from __future__ import annotations

import flowq

from .models import Order, Receipt

app = flowq.FlowQ()


@app.task(queue="mail")
def send_receipt(ctx: flowq.Context, order_id: int) -> str:
    order = ctx.session.get(Order, order_id)
    if order is None:  # cannot happen: the order committed with this job
        raise flowq.CancelRun(f"order {order_id} is gone")
    # A mail API would take ctx.idempotency_key and send once however often this step runs;
    # the Receipt row commits with the step's success, exactly once.
    message_id = f"receipt-{ctx.idempotency_key}"
    ctx.session.add(Receipt(order_id=order.id, message_id=message_id))
    return message_id
