"""The flowq app and its task, `send_invoice`: `flowq worker examples.sqlmodel_app.jobs:app`.

`ctx.session` is flowq's SQLAlchemy Session, not SQLModel's: SQLModel tables work in it as in
any Session, with `scalars(select(...))` where SQLModel's own would say `exec(select(...))`.
"""

from __future__ import annotations

import threading

from sqlmodel import select
from tenacity import stop_after_attempt

import flowq

from .models import Invoice

app = flowq.FlowQ()


class FakeMailer:
    """Stands in for a mail API that deduplicates by idempotency key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent: dict[str, str] = {}  # idempotency key -> recipient

    def send(self, to: str, *, idempotency_key: str) -> None:
        with self._lock:
            self.sent.setdefault(idempotency_key, to)


mailer = FakeMailer()


@app.task(queue="invoices", retry=flowq.Retry(stop=stop_after_attempt(5)))
def send_invoice(ctx: flowq.Context, number: str) -> None:
    invoice = ctx.session.scalars(select(Invoice).where(Invoice.number == number)).one()
    mailer.send(invoice.email, idempotency_key=ctx.idempotency_key)
    invoice.emailed = True  # committed by flowq with the step's success, exactly once
