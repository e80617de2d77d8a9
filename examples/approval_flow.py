"""A publishing pipeline that waits for a person's approval, sent from a web handler.

    .venv/bin/python examples/approval_flow.py [DATABASE_URL]

Without a URL argument it starts a throwaway embedded PostgreSQL (it never reads
FLOWQ_DATABASE_URL or DATABASE_URL: an example touches only the database it is given). It
migrates flowq's schema, creates the app's tables, submits three documents, runs a worker in
a thread of this process, plays the approvals through a web handler, and prints each run.

What it shows:
- a step that waits for a signal (`wait_for="approval"`): its run shows `waiting` until the
  signal arrives, and the signal's payload is the step's `approval` keyword argument;
- the web handler (a plain function standing in for a view) writes its `Approval` row and
  sends the signal with `session.signal(...)` in one transaction: the signal is delivered if
  and only if that transaction commits, so a handler that fails after signalling delivers
  nothing, and an approval is never recorded without its signal or the reverse;
- a signal sent before the step is reached is kept until it is; the same approval sent twice
  (a double click) is ignored, a different one is refused;
- a step whose signal does not come within `wait_timeout` fails with `SignalTimeout` and the
  run ends `dead`; `flowq.ops.runs.retry_run` makes it wait again, without re-running the step
  before it.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

import flowq
import flowq.local.postgres
from flowq.db import create_engine
from flowq.durable.context import Context
from flowq.ops.runs import get_run, retry_run, wait_run

# -- the application's own model -------------------------------------------------------------


class Base(DeclarativeBase):
    pass


class Document(Base):
    __tablename__ = "documents"
    id: Mapped[int] = mapped_column(primary_key=True)
    title: Mapped[str]
    status: Mapped[str]  # draft, in review, published
    run_id: Mapped[int | None]


class Approval(Base):
    __tablename__ = "approvals"
    id: Mapped[int] = mapped_column(primary_key=True)
    document_id: Mapped[int]
    approver: Mapped[str]


calls: Counter[str] = Counter()  # handler calls by step, across all runs

# -- the pipeline -----------------------------------------------------------------------------

# Short, so that the demo shows a timeout; a real approval would wait days (the default is 7).
WAIT_TIMEOUT = timedelta(seconds=4)

app = flowq.FlowQ()
# A queue of its own: the in-process worker serves only it, so run against a database you
# gave, it never claims that database's other jobs.
publishing = app.pipeline("publish_document", queue="approval_example")


@publishing.step()
def request_review(ctx: Context, document_id: int) -> dict[str, Any]:
    calls["request_review"] += 1
    document = ctx.session.get(Document, document_id)
    assert document is not None
    document.status = "in review"  # a real app would also notify the reviewers
    return {"document_id": document_id}


# Runnable only once signal "approval" arrived for this run (its payload is the `approval`
# argument), or once WAIT_TIMEOUT has passed since it was reached (it then fails with
# flowq.SignalTimeout, which the default retry policy does not retry).
@publishing.step(wait_for="approval", wait_timeout=WAIT_TIMEOUT)
def publish(ctx: Context, document_id: int, approval: dict[str, Any]) -> dict[str, Any]:
    calls["publish"] += 1
    document = ctx.session.get(Document, document_id)
    assert document is not None
    document.status = "published"
    return {"document_id": document_id, "approved_by": approval["by"]}


# -- the web handler --------------------------------------------------------------------------


class AuditLogDown(Exception):
    pass


def approve_view(Session: sessionmaker[flowq.Session], document_id: int, approver: str, *,
                 audit_log_up: bool = True) -> tuple[int, str]:
    """POST /documents/{id}/approve: record the approval and tell the run, in one transaction.
    Returns (HTTP status, body)."""
    try:
        with Session.begin() as session:
            document = session.get(Document, document_id)
            if document is None or document.run_id is None:
                return 404, "no such document"
            sent = session.signal(document.run_id, "approval", {"by": approver})
            if not sent.created:  # a double click: this very approval was already sent
                return 200, "already approved"
            session.add(Approval(document_id=document_id, approver=approver))
            session.flush()
            if not audit_log_up:  # something fails after the signal: all of it rolls back
                raise AuditLogDown("audit log unavailable")
            return 200, "approved" if sent.delivered else "approved (kept until review)"
    except AuditLogDown as exc:
        return 503, f"{exc}; nothing was recorded"
    except flowq.SignalError as exc:  # another approval was sent already
        return 409, str(exc)
    except flowq.RunStateError as exc:  # the run finished (or was cancelled)
        return 409, str(exc)


# -- running it -------------------------------------------------------------------------------


def worker(url: str) -> flowq.Worker:
    """A worker for this app's queue only, to run in a thread of this process as a web app
    would embed it: `with worker(url).running():` stops it, after its running handlers
    finish, on leaving the block. Its reaper pass, which ends expired waits, runs every half
    second instead of every 10 s, so the timeout below shows quickly."""
    w = flowq.Worker(app, url, flowq.WorkerConfig(poll_interval=0.5, reap_interval=0.5))
    w.check_database()
    return w


class Submitted(NamedTuple):
    document_id: int
    run_id: int


def poll(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def main(url: str | None) -> int:
    with flowq.local.postgres.database(url) as db_url:
        engine = create_engine(db_url)
        flowq.migrate(engine)
        Base.metadata.create_all(engine)
        Session = sessionmaker(engine, class_=flowq.Session)

        def status(run_id: int) -> str:
            return get_run(engine, run_id).status

        def view(label: str, document_id: int, approver: str, **kwargs: Any) -> str:
            code, body = approve_view(Session, document_id, approver, **kwargs)
            print(f"  {label}: {code} {body}")
            return f"{code}"

        submitted: list[Submitted] = []
        for title in ("price list", "handbook", "press release"):
            with Session.begin() as session:  # the document and its run commit together
                document = Document(title=title, status="draft")
                session.add(document)
                session.flush()
                run = session.enqueue(publishing, document_id=document.id)
                document.run_id = run.id
                submitted.append(Submitted(document.id, run.id))
        prices, handbook, press = submitted
        outcomes: list[str] = []

        print("before any worker runs (the price list's review was not even requested):")
        outcomes.append(view("ann approves the price list", prices.document_id, "ann"))
        outcomes.append(view("ann double-clicks", prices.document_id, "ann"))
        outcomes.append(view("bob approves it too", prices.document_id, "bob"))

        with worker(db_url).running():
            prices_run = wait_run(engine, prices.run_id, timeout=60)
            poll(lambda: status(handbook.run_id) == "waiting", "the handbook to wait")
            print(f"\nthe handbook's run is {status(handbook.run_id)}:")
            outcomes.append(view("cy approves, but the audit log is down", handbook.document_id, "cy",
                                 audit_log_up=False))
            print(f"  the run is still {status(handbook.run_id)}")
            outcomes.append(view("cy approves again", handbook.document_id, "cy"))
            handbook_run = wait_run(engine, handbook.run_id, timeout=60)
            outcomes.append(view("dee approves the published handbook", handbook.document_id, "dee"))

            print(f"\nnobody approves the press release within {WAIT_TIMEOUT.seconds}s:")
            timed_out = wait_run(engine, press.run_id, timeout=60)
            error = (timed_out.steps[-1].last_error or "").splitlines()[0]
            print(f"  the run is {timed_out.status}: {error}")
            retried = retry_run(engine, press.run_id)
            print(f"  after flowq runs retry: {retried.run.status}")
            outcomes.append(view("eve approves it", press.document_id, "eve"))
            press_run = wait_run(engine, press.run_id, timeout=60)

        runs = [prices_run, handbook_run, press_run]
        for info in runs:
            print(f"\nrun {info.run_id} ({info.task}): {info.status} -> {info.result}")
            for step in info.steps:
                error = (step.last_error or "").splitlines()[0] if step.last_error else ""
                print(f"  {step.index} {step.step:<15} {step.status:<10} "
                      f"attempts {step.attempts}/{step.max_attempts}  {error}")

        with engine.connect() as conn:
            approvals = conn.execute(sa.select(Approval.approver).order_by(Approval.id)
                                     ).scalars().all()
            published = conn.execute(sa.select(sa.func.count()).select_from(Document)
                                     .where(Document.status == "published")).scalar()
        engine.dispose()
        print(f"\nresponses: {' '.join(outcomes)}")
        print(f"summary: {published} documents published, approvals recorded: "
              f"{', '.join(approvals)}, request_review called {calls['request_review']} "
              f"times, publish called {calls['publish']} times, timed out and retried: "
              f"{timed_out.status == 'dead' and press_run.status == 'succeeded'}")
        ok = (all(info.status == "succeeded" for info in runs) and published == 3
              and approvals == ["ann", "cy", "eve"]
              and outcomes == ["200", "200", "409", "503", "200", "409", "200"]
              and calls == Counter(request_review=3, publish=3))
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
