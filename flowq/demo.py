"""`flowq demo`: transactional enqueue and the worker, end to end, on a real PostgreSQL.

Starts an embedded PostgreSQL (unless a URL is given), migrates it, and:
1. commits one business transaction with a job and rolls back another, showing what each
   left in `flowq.jobs`;
2. enqueues a few thousand jobs beside order rows, rolling some transactions back on purpose;
3. runs a worker (with a progress bar) whose handler writes a shipment row through
   `ctx.session`, fails now and then (retried durably), and meets one poisoned order that
   ends `dead`;
4. checks the ledger (one shipment per committed order, none for rolled-back ones) and
   prints a summary.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import click
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker
from tenacity import stop_after_attempt, wait_fixed

import flowq
import flowq.db
from flowq.context import Context
from flowq.worker import Worker, WorkerConfig
from flowq.worker.logs import configure_logging

__all__ = ["run_demo"]

BATCH = 50
POISON_ORDER = 13


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "demo_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str]


class Shipment(Base):
    __tablename__ = "demo_shipments"
    order_id: Mapped[int] = mapped_column(primary_key=True)  # a second shipment would fail


app = flowq.FlowQ()
_flaky = random.Random(7)


@app.task(queue="orders", retry=flowq.Retry(stop=stop_after_attempt(4), wait=wait_fixed(0.2)))
def ship_order(ctx: Context, order_id: int) -> dict[str, Any]:
    """Ship an order: one row through ctx.session, committed with the job's success."""
    if order_id == POISON_ORDER:
        raise ValueError(f"order {order_id} is poisoned: the carrier rejects it every time")
    if ctx.attempt == 1 and _flaky.random() < 0.03:
        raise ConnectionError("carrier API timed out (simulated)")
    ctx.session.add(Shipment(order_id=order_id))
    return {"order_id": order_id, "carrier_key": ctx.idempotency_key}


def _show_jobs(engine: sa.Engine, title: str) -> None:
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT id, run_id, task, status, args::text FROM flowq.jobs "
                                 "ORDER BY id")).all()
        orders = c.execute(sa.text("SELECT count(*) FROM demo_orders")).scalar()
    click.echo(f"  {title}: {len(rows)} job row(s), {orders} order row(s)")
    for r in rows:
        click.echo(f"    job {r.id}: run {r.run_id} {r.task} {r.status} args={r[4]}")


def _part_one(engine: sa.Engine, session_factory: sessionmaker[flowq.Session]) -> None:
    click.secho("\n1. Transactional enqueue", bold=True)
    with session_factory.begin() as s:
        s.add(Order(id=1, item="committed"))
        s.flush()
        s.enqueue(ship_order, order_id=1)
    _show_jobs(engine, "after a COMMITTED transaction (order 1 + its job)")
    s = session_factory()
    with s.begin():
        s.add(Order(id=2, item="rolled back"))
        s.flush()
        s.enqueue(ship_order, order_id=2)
        s.rollback()
    _show_jobs(engine, "after a ROLLED-BACK transaction (order 2 + its job)")
    click.echo("  -> the rolled-back order and its job never existed; no worker was woken.")


def _part_two(session_factory: sessionmaker[flowq.Session], n_jobs: int) -> tuple[int, int]:
    click.secho(f"\n2. Enqueue {n_jobs} jobs beside their orders, {BATCH} per transaction",
                bold=True)
    committed = rolled_back = 0
    rng = random.Random(1)
    next_id = 100
    while committed < n_jobs:
        n = min(BATCH, n_jobs - committed)
        s = session_factory()
        with s.begin():
            ids = list(range(next_id, next_id + n))
            next_id += n
            s.add_all(Order(id=i, item=f"item-{i}") for i in ids)
            s.flush()
            s.enqueue_many(ship_order, [{"order_id": i} for i in ids])
            if rng.random() < 0.1:
                s.rollback()
                rolled_back += n
                continue
        committed += n
    with session_factory.begin() as s:
        s.add(Order(id=POISON_ORDER, item="poison"))
        s.flush()
        s.enqueue(ship_order, order_id=POISON_ORDER)
    click.echo(f"  committed {committed + 1} jobs, rolled back {rolled_back} (with their orders)")
    return committed + 1, rolled_back


def _counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as c:
        return dict(c.execute(sa.text(  # type: ignore[arg-type]
            "SELECT status, count(*) FROM flowq.jobs GROUP BY status")).all())


def run_demo(url: str | None, *, n_jobs: int = 2000) -> None:
    """Run the demo against `url`, or an embedded PostgreSQL when it is None."""
    from flowq.embedded import LocalPostgres

    server = None
    if url is None:
        click.echo("Starting an embedded PostgreSQL ...")
        server = LocalPostgres().start()
        url = server.url
    try:
        _run(url, n_jobs)
    finally:
        if server is not None:
            server.stop()


def _run(url: str, n_jobs: int) -> None:
    engine = flowq.db.create_engine(url)
    with engine.begin() as c:
        c.execute(sa.text("DROP TABLE IF EXISTS demo_shipments, demo_orders"))
        c.execute(sa.text("DROP SCHEMA IF EXISTS flowq CASCADE"))
    flowq.migrate(engine)
    Base.metadata.create_all(engine)
    session_factory = sessionmaker(engine, class_=flowq.Session)
    click.echo(f"Database: {flowq.db.describe_url(url)} (schema migrated)")
    _part_one(engine, session_factory)
    committed, rolled_back = _part_two(session_factory, n_jobs)

    click.secho("\n3. A worker drains the queue (concurrency 16)", bold=True)
    configure_logging("text", "ERROR")
    worker = Worker(app, url, WorkerConfig(concurrency=16, job_log=False, poll_interval=0.2))
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False},
                              daemon=True)
    total = committed + 1  # plus order 1 from part one
    started = time.monotonic()
    thread.start()
    done = 0
    with click.progressbar(length=total, label="  jobs finished") as bar:
        while done < total:
            counts = _counts(engine)
            now_done = counts.get("succeeded", 0) + counts.get("dead", 0)
            bar.update(now_done - done)
            done = now_done
            time.sleep(0.1)
    elapsed = time.monotonic() - started
    worker.stop()
    thread.join(timeout=30)

    with engine.connect() as c:
        retried = c.execute(sa.text(
            "SELECT count(*) FROM flowq.jobs WHERE attempts > 1")).scalar() or 0
        dead = c.execute(sa.text(
            "SELECT task, args::text, last_error FROM flowq.jobs WHERE status = 'dead'")).all()
        shipments = c.execute(sa.text("SELECT count(*) FROM demo_shipments")).scalar()
        orphan = c.execute(sa.text(
            "SELECT count(*) FROM demo_shipments s LEFT JOIN demo_orders o ON o.id = s.order_id "
            "WHERE o.id IS NULL")).scalar()
    counts = _counts(engine)
    click.secho("\n4. Summary", bold=True)
    click.echo(f"  processed:    {counts.get('succeeded', 0)} succeeded")
    click.echo(f"  retried:      {retried} job(s) needed more than one attempt")
    click.echo(f"  dead:         {len(dead)}")
    for task, args, err in dead:
        click.echo(f"                {task} {args}: {(err or '').splitlines()[-1]}")
    click.echo(f"  rolled back:  {rolled_back} jobs never existed (their transactions rolled "
               "back)")
    click.echo(f"  ledger:       {shipments} shipments for {counts.get('succeeded', 0)} "
               f"succeeded jobs, {orphan} for rolled-back orders")
    click.echo(f"  throughput:   {total / elapsed:,.0f} jobs/s over {elapsed:.1f}s")
    engine.dispose()
