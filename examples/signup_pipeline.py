"""A sign-up pipeline beside an ORM model: create the account, charge the card, send the mail.

    .venv/bin/python examples/signup_pipeline.py [DATABASE_URL]

Without a URL argument it starts a throwaway embedded PostgreSQL (it never reads
FLOWQ_DATABASE_URL or DATABASE_URL: an example touches only the database it is given). It
migrates flowq's schema, creates the app's tables, enqueues three sign-ups in
the same transactions that write their `SignupRequest` rows, runs a worker in this process
until nothing is left to do, and prints each run.

What it shows:
- business rows (`Account`, `WelcomeMail`) written through `ctx.session`: they commit with the
  step's success, exactly once per run, even if the step is re-run;
- an external call (a fake payment gateway) made with `ctx.idempotency_key`: the gateway's
  response is "lost" twice, the step is retried, and the card is still charged once;
- each step's result feeding the next step's keyword arguments.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker
from tenacity import stop_after_attempt, wait_fixed

import flowq
import flowq.local.postgres
from flowq.db import create_engine
from flowq.durable.context import Context
from flowq.ops.runs import get_run
from flowq.testing import run_until_idle

# -- the application's own model -------------------------------------------------------------


class Base(DeclarativeBase):
    pass


class SignupRequest(Base):
    __tablename__ = "signup_requests"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(unique=True)
    run_id: Mapped[int | None]


class Account(Base):
    __tablename__ = "accounts"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(unique=True)
    plan: Mapped[str]


class WelcomeMail(Base):
    __tablename__ = "welcome_mails"
    id: Mapped[int] = mapped_column(primary_key=True)
    account_id: Mapped[int]
    message_id: Mapped[str]


# -- an external service, simulated ----------------------------------------------------------


class FakeGateway:
    """A payment API that, like real ones, deduplicates requests by idempotency key."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.charges: dict[str, str] = {}  # idempotency key -> charge id
        self.requests = 0

    def charge(self, *, amount_cents: int, idempotency_key: str) -> str:
        with self.lock:
            self.requests += 1
            return self.charges.setdefault(idempotency_key, f"ch_{len(self.charges) + 1}")


gateway = FakeGateway()

# -- the pipeline -----------------------------------------------------------------------------

app = flowq.FlowQ()
# A queue of its own: the in-process worker serves only it, so run against a database you
# gave, it never claims that database's other jobs.
signup = app.pipeline("signup", queue="signup_example")


@signup.step()
def create_account(ctx: Context, email: str, plan: str) -> dict[str, Any]:
    account = Account(email=email, plan=plan)
    ctx.session.add(account)
    ctx.session.flush()  # the id, now; the commit is flowq's, with this step's success
    return {"account_id": account.id, "plan": plan}


# Zero wait keeps this demo short (and due at once for run_until_idle); real code would use
# e.g. wait_exponential(multiplier=1, max=60).
@signup.step(retry=flowq.Retry(stop=stop_after_attempt(5), wait=wait_fixed(0)), timeout=30)
def charge_card(ctx: Context, account_id: int, plan: str) -> dict[str, Any]:
    charge_id = gateway.charge(amount_cents=1200 if plan == "pro" else 0,
                               idempotency_key=ctx.idempotency_key)
    if ctx.attempt <= 2:
        # The charge went through but the response was lost: the step fails and is retried.
        # The same idempotency key on the retry means the card is not charged again.
        raise TimeoutError(f"payment gateway timed out (attempt {ctx.attempt})")
    return {"account_id": account_id, "charge_id": charge_id}


@signup.step()
def send_welcome(ctx: Context, account_id: int, charge_id: str) -> dict[str, Any]:
    message_id = f"msg-{ctx.idempotency_key}"  # a mail API would dedupe on it too
    ctx.session.add(WelcomeMail(account_id=account_id, message_id=message_id))
    return {"account_id": account_id, "charge_id": charge_id, "message_id": message_id}


# -- running it -------------------------------------------------------------------------------


def main(url: str | None) -> int:
    with flowq.local.postgres.database(url) as db_url:
        engine = create_engine(db_url)
        flowq.migrate(engine)
        Base.metadata.create_all(engine)
        Session = sessionmaker(engine, class_=flowq.Session)

        run_ids = []
        for email, plan in [("ada@example.com", "pro"), ("bob@example.com", "free"),
                            ("cy@example.com", "pro")]:
            with Session.begin() as session:  # the request row and its run commit together
                request = SignupRequest(email=email)
                session.add(request)
                run = session.enqueue(signup, email=email, plan=plan,
                                      idempotency_key=f"signup-example:{email}")
                request.run_id = run.id
                run_ids.append(run.id)

        run_until_idle(app, db_url)

        runs = [get_run(engine, run_id) for run_id in run_ids]
        for info in runs:
            print(f"\nrun {info.run_id} ({info.task}): {info.status} -> {info.result}")
            for step in info.steps:
                error = (step.last_error or "").splitlines()[0] if step.last_error else ""
                print(f"  {step.index} {step.step:<15} {step.status:<10} "
                      f"attempts {step.attempts}/{step.max_attempts}  {error}")

        with engine.connect() as conn:
            accounts = conn.execute(sa.select(sa.func.count()).select_from(Account)).scalar()
            mails = conn.execute(sa.select(sa.func.count()).select_from(WelcomeMail)).scalar()
        print(f"\naccounts: {accounts}, welcome mails: {mails}, gateway requests: "
              f"{gateway.requests}, cards charged: {len(gateway.charges)}")
        engine.dispose()
        ok = (all(info.status == "succeeded" for info in runs)
              and accounts == mails == len(gateway.charges) == len(run_ids))
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
