"""Durable execution inside one step: an order charged once, slept on, shipped once.

    .venv/bin/python examples/durable.py [DATABASE_URL]

Without a URL argument it starts a throwaway embedded PostgreSQL (it never reads
FLOWQ_DATABASE_URL or DATABASE_URL: an example touches only the database it is given). It
migrates flowq's schema, creates the app's tables, places three orders, runs a worker in a
thread of this process, and prints each run with its checkpoints.

What it shows (docs/durable.md):
- `ctx.checkpoint("charge", charge, ...)`: the charge row is written in the checkpoint's
  session and commits with the checkpoint's record; the first attempt of every order then
  crashes, and its retry gets the recorded charge back without charging again;
- `ctx.sleep(...)`: a durable cooling-off period. The job gives its slot back and is due
  again at the deadline without spending an attempt; the handler runs again from the top,
  its checkpoints replay from storage, and the sleep returns;
- `raise flowq.Snooze(...)`: a step polling for a shipping label looks again later without
  spending an attempt, until the label is there.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from tenacity import stop_after_attempt, wait_fixed

import flowq
import flowq.local.postgres
from flowq.db import create_engine
from flowq.durable.context import Context
from flowq.ops.runs import get_run, wait_run

# -- the application's own model -------------------------------------------------------------


class Base(DeclarativeBase):
    pass


class Charge(Base):
    __tablename__ = "charges"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int]
    cents: Mapped[int]


class Shipment(Base):
    __tablename__ = "shipments"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int]
    label: Mapped[str]


class Label(Base):
    __tablename__ = "labels"
    order_id: Mapped[int] = mapped_column(primary_key=True)
    code: Mapped[str]


calls: Counter[str] = Counter()  # checkpoint function calls, across all runs
crashed: set[int] = set()  # orders whose first attempt crashed after charging
lock = threading.Lock()
COOLING_OFF = 1.0  # seconds; a real one would be hours

app = flowq.FlowQ()

# -- the tasks --------------------------------------------------------------------------------


def charge(order_id: int, cents: int, *, session: Session) -> dict[str, int]:
    """Charge the order: the row commits with the checkpoint's record, exactly once."""
    with lock:
        calls["charge"] += 1
    row = Charge(order_id=order_id, cents=cents)
    session.add(row)
    session.flush()
    return {"charge_id": row.id}


def ship(order_id: int, label: str, *, session: Session) -> dict[str, int]:
    with lock:
        calls["ship"] += 1
    row = Shipment(order_id=order_id, label=label)
    session.add(row)
    session.flush()
    return {"shipment_id": row.id}


@app.task(retry=flowq.Retry(stop=stop_after_attempt(3), wait=wait_fixed(0)))
def fulfil(ctx: Context, order_id: int, cents: int) -> dict[str, Any]:
    """Charge, cool off, ship: deterministic up to its checkpoints, so it can run again."""
    charged = ctx.checkpoint("charge", charge, order_id, cents)
    with lock:
        first_time = order_id not in crashed
        crashed.add(order_id)
    if first_time:
        raise RuntimeError("the worker crashed right after charging")  # once per order
    ctx.sleep(COOLING_OFF)
    label = ctx.checkpoint("label", wait_for_label_code, order_id)
    shipped = ctx.checkpoint("ship", ship, order_id, label)
    return {**charged, **shipped, "attempt": ctx.attempt}


def wait_for_label_code(order_id: int, *, session: Session) -> str:
    """The label, if the carrier made it; else the step snoozes (no attempt spent)."""
    label = session.get(Label, order_id)
    if label is None:
        raise flowq.Snooze(0.2, reason="no shipping label yet")
    return label.code


# -- running it -------------------------------------------------------------------------------


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
        make_session = sessionmaker(engine, class_=flowq.Session)
        orders = {101: 1999, 102: 500, 103: 12000}
        with make_session.begin() as session:
            runs = {order: session.enqueue(fulfil, order_id=order, cents=cents).id
                    for order, cents in orders.items()}

        worker = flowq.Worker(app, db_url, flowq.WorkerConfig(poll_interval=0.2))
        with worker.running():
            # Every order is charged, crashes once, sleeps, then polls for its label.
            poll(lambda: all(get_run(engine, r).status == "pending" and any(
                c.name == "flowq.snoozes" for c in get_run(engine, r).checkpoints)
                for r in runs.values()), "every order to poll for its label")
            with make_session.begin() as session:  # the carrier makes the labels
                session.add_all([Label(order_id=o, code=f"LBL-{o}") for o in orders])
            done = [wait_run(engine, r, timeout=60) for r in runs.values()]

        for info in done:
            step = info.steps[-1]
            print(f"run {info.run_id} ({info.task}): {info.status}, attempts {step.attempts}, "
                  f"result {info.result}")
            for c in info.checkpoints:
                print(f"  checkpoint {c.name}: {c.result}")
        with engine.connect() as conn:
            charges = conn.execute(sa.select(sa.func.count()).select_from(Charge)).scalar()
            shipments = conn.execute(sa.select(sa.func.count()).select_from(Shipment)).scalar()
        engine.dispose()
        print(f"summary: {len(done)} orders, {charges} charges, {shipments} shipments, charge "
              f"called {calls['charge']} times, ship called {calls['ship']} times, every run "
              f"on attempt 2 (one crash each): "
              f"{all(i.steps[-1].attempts == 2 for i in done)}")
        ok = (all(i.status == "succeeded" for i in done) and charges == shipments == 3
              and calls == Counter(charge=3, ship=3))
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
