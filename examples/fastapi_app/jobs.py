"""The flowq app and the sign-up pipeline: create_account -> send_welcome -> notify_sales.

A worker imports this module: `flowq worker examples.fastapi_app.jobs:app`. The handlers are
plain `def`s: the worker runs them in its threads, and `ctx.session` is a synchronous Session
whose writes commit with the step's success, even though the web app itself is async.
"""

from __future__ import annotations

import threading
from typing import Any

import sqlalchemy as sa
from tenacity import stop_after_attempt, wait_exponential

import flowq

from .models import Account, User

app = flowq.FlowQ()
signup = app.pipeline("signup", queue="signups")


class FakeService:
    """Stands in for a mail API or a CRM webhook: it keeps one message per idempotency key,
    as real ones deduplicate, so a re-run step does not send twice."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.messages: dict[str, dict[str, Any]] = {}

    def send(self, *, idempotency_key: str, **message: Any) -> None:
        with self._lock:
            self.messages.setdefault(idempotency_key, message)

    def sent_to(self, **match: Any) -> list[dict[str, Any]]:
        with self._lock:
            return [m for m in self.messages.values()
                    if all(m.get(k) == v for k, v in match.items())]


mailer = FakeService()
sales_feed = FakeService()


@signup.step()
def create_account(ctx: flowq.Context, email: str) -> dict[str, Any]:
    # The request committed the user with this job, so it is there to be read.
    user = ctx.session.scalars(sa.select(User).where(User.email == email)).one()
    account = Account(user_id=user.id, plan="trial")
    ctx.session.add(account)
    ctx.session.flush()  # the id now; flowq commits with this step's success
    return {"user_id": user.id, "email": email, "account_id": account.id}


@signup.step(retry=flowq.Retry(stop=stop_after_attempt(8), wait=wait_exponential(max=60)))
def send_welcome(ctx: flowq.Context, user_id: int, email: str, account_id: int
                 ) -> dict[str, Any]:
    mailer.send(idempotency_key=ctx.idempotency_key, to=email, template="welcome")
    return {"user_id": user_id, "account_id": account_id}


@signup.step()
def notify_sales(ctx: flowq.Context, user_id: int, account_id: int) -> None:
    sales_feed.send(idempotency_key=ctx.idempotency_key, user_id=user_id,
                    text=f"new trial account {account_id}")
