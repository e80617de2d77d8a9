"""`flowq demo`: transactional enqueue and the worker, end to end, on a real PostgreSQL.

Starts an embedded PostgreSQL (unless a URL is given: FLOWQ_DATABASE_URL and DATABASE_URL
are never read), creates a schema of its own, `flowq_demo_<8 hex>`, holding both flowq's
tables and the demo's (`orders`, `shipments`), and:
1. commits one business transaction with a job and rolls back another, showing what each
   left in the jobs table;
2. enqueues a few thousand jobs beside order rows, rolling some transactions back on purpose;
3. runs a worker (with a progress bar) whose handler writes a shipment row through
   `ctx.session`, fails now and then (retried durably), and meets one poisoned order that
   ends `dead`;
4. checks the ledger (one shipment per committed order, none for rolled-back ones) and
   prints a summary.
At the end it drops that schema, and only that: it never drops or truncates anything it did
not create, so `--database-url` may point at a database holding real data.
"""

from __future__ import annotations

import io
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Final

import click
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker
from tenacity import stop_after_attempt, wait_fixed

import flowq
import flowq.db
from flowq.define.pipeline import Task
from flowq.durable.context import Context
from flowq.errors import DemoError
from flowq.local.postgres import LocalPostgres
from flowq.storable import first_line
from flowq.worker import Worker, WorkerConfig
from flowq.worker.logs import configure_logging

__all__ = ["run_demo"]

BATCH: Final = 50
POISON_ORDER: Final = 13
SCHEMA_PREFIX: Final = "flowq_demo_"
WORKER_STOP_TIMEOUT: Final = 30.0
DROP_LOCK_TIMEOUT: Final = "10s"


@dataclass(frozen=True)
class Demo:
    """One run's world: its schema, the app whose tables live there, the models and task."""

    schema: str
    app: flowq.FlowQ
    metadata: sa.MetaData
    order: type[Any]
    shipment: type[Any]
    ship_order: Task[..., dict[str, Any]]

    def table(self, name: str) -> str:
        return f'"{self.schema}".{name}'  # the schema name is a validated identifier


def build_demo(schema: str) -> Demo:
    """The app, models and task of a run in `schema` (built per run: nothing global)."""
    app = flowq.FlowQ(schema=schema)
    flaky = random.Random(7)

    class Base(DeclarativeBase):
        metadata = sa.MetaData(schema=schema)

    class Order(Base):
        __tablename__ = "orders"
        id: Mapped[int] = mapped_column(primary_key=True)
        item: Mapped[str]

    class Shipment(Base):
        __tablename__ = "shipments"
        order_id: Mapped[int] = mapped_column(primary_key=True)  # a second one would fail

    @app.task(queue="orders", retry=flowq.Retry(stop=stop_after_attempt(4), wait=wait_fixed(0.2)))
    def ship_order(ctx: Context, order_id: int) -> dict[str, Any]:
        """Ship an order: one row through ctx.session, committed with the job's success."""
        if order_id == POISON_ORDER:
            raise ValueError(f"order {order_id} is poisoned: the carrier rejects it every time")
        if ctx.attempt == 1 and flaky.random() < 0.03:
            raise ConnectionError("carrier API timed out (simulated)")
        ctx.session.add(Shipment(order_id=order_id))
        return {"order_id": order_id, "carrier_key": ctx.idempotency_key}

    return Demo(schema, app, Base.metadata, Order, Shipment, ship_order)


def run_demo(url: str | None, *, n_jobs: int = 2000) -> None:
    """Run the demo against `url`, or an embedded PostgreSQL when it is None."""
    server = None
    if url is None:
        click.echo("Starting a temporary embedded PostgreSQL (the demo never reads "
                   "FLOWQ_DATABASE_URL or DATABASE_URL; --database-url picks a server) ...")
        server = LocalPostgres().start()
        url = server.url
    else:
        click.echo("Using the server given by --database-url.")
    try:
        _run_in_own_schema(url, n_jobs)
    finally:
        if server is not None:
            server.stop()


def _run_in_own_schema(url: str, n_jobs: int) -> None:
    engine = flowq.db.create_engine(url)
    schema = f"{SCHEMA_PREFIX}{uuid.uuid4().hex[:8]}"
    try:
        try:
            with engine.begin() as c:
                # No IF NOT EXISTS: a schema of that name that is not ours must not become ours.
                c.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        except sa.exc.ProgrammingError as exc:  # e.g. no CREATE privilege on the database
            raise DemoError(f"the demo cannot create its schema {schema!r}: "
                             f"{first_line(exc.orig)}") from None
        try:
            _run(engine, url, build_demo(schema), n_jobs)
        finally:
            _drop_own_schema(engine, schema)
    finally:
        engine.dispose()


def _drop_own_schema(engine: sa.Engine, schema: str) -> None:
    """Drop the schema this run created; if that fails, say so rather than hide an error."""
    try:
        with engine.begin() as c:
            # A worker that did not stop in time could hold a lock: wait a bounded while.
            c.execute(sa.text(f"SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT}'"))
            c.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
    except sa.exc.DBAPIError as exc:
        click.echo(f'\nCould not drop schema "{schema}" ({flowq.db.mask_secrets(str(exc.orig))}'
                   f'): drop it with DROP SCHEMA "{schema}" CASCADE.', err=True)
        return
    click.echo(f'\nDropped schema "{schema}" (created by this demo).')


def _show_jobs(engine: sa.Engine, demo: Demo, title: str) -> None:
    with engine.connect() as c:
        rows = c.execute(sa.text(f"SELECT id, run_id, task, status, args::text "
                                 f"FROM {demo.table('steps')} ORDER BY id")).all()
        orders = c.execute(sa.text(f"SELECT count(*) FROM {demo.table('orders')}")).scalar()
    click.echo(f"  {title}: {len(rows)} job row(s), {orders} order row(s)")
    for r in rows:
        click.echo(f"    job {r.id}: run {r.run_id} {r.task} {r.status} args={r[4]}")


def _part_one(engine: sa.Engine, demo: Demo,
              session_factory: sessionmaker[flowq.Session]) -> None:
    click.secho("\n1. Transactional enqueue", bold=True)
    with session_factory.begin() as s:
        s.add(demo.order(id=1, item="committed"))
        s.flush()
        s.enqueue(demo.ship_order, order_id=1)
    _show_jobs(engine, demo, "after a COMMITTED transaction (order 1 + its job)")
    s = session_factory()
    with s.begin():
        s.add(demo.order(id=2, item="rolled back"))
        s.flush()
        s.enqueue(demo.ship_order, order_id=2)
        s.rollback()
    _show_jobs(engine, demo, "after a ROLLED-BACK transaction (order 2 + its job)")
    click.echo("  -> the rolled-back order and its job never existed; no worker was woken.")


def _part_two(demo: Demo, session_factory: sessionmaker[flowq.Session],
              n_jobs: int) -> tuple[int, int]:
    click.secho(f"\n2. Enqueue {n_jobs} jobs beside their orders, {BATCH} per transaction "
                f"(about 1 transaction in 10 rolls back), and one poisoned order", bold=True)
    committed = rolled_back = 0
    rng = random.Random(1)
    next_id = 100
    while committed < n_jobs:
        n = min(BATCH, n_jobs - committed)
        s = session_factory()
        with s.begin():
            ids = list(range(next_id, next_id + n))
            next_id += n
            s.add_all(demo.order(id=i, item=f"item-{i}") for i in ids)
            s.flush()
            s.enqueue_many(demo.ship_order, [{"order_id": i} for i in ids])
            if rng.random() < 0.1:
                s.rollback()
                rolled_back += n
                continue
        committed += n
    with session_factory.begin() as s:
        s.add(demo.order(id=POISON_ORDER, item="poison"))
        s.flush()
        s.enqueue(demo.ship_order, order_id=POISON_ORDER)
    click.echo(f"  committed {committed} jobs + 1 poisoned (order {POISON_ORDER}); "
               f"rolled back {rolled_back} more with their orders")
    return committed + 1, rolled_back


def _counts(engine: sa.Engine, demo: Demo) -> dict[str, int]:
    with engine.connect() as c:
        return dict(c.execute(sa.text(  # type: ignore[arg-type]
            f"SELECT status, count(*) FROM {demo.table('steps')} GROUP BY status")).all())


def _run(engine: sa.Engine, url: str, demo: Demo, n_jobs: int) -> None:
    flowq.migrate(engine, schema=demo.schema)
    demo.metadata.create_all(engine)
    session_factory = sessionmaker(engine, class_=flowq.Session)
    with engine.connect() as c:
        version = c.execute(sa.text("SHOW server_version")).scalar()
    click.echo(f"Database: PostgreSQL {version} at {flowq.db.describe_url(url)}, schema "
               f"\"{demo.schema}\" (created for this run, migrated)")
    _part_one(engine, demo, session_factory)
    committed, rolled_back = _part_two(demo, session_factory, n_jobs)

    total = committed + 1  # plus order 1 from part one
    click.secho(f"\n3. A worker drains the queue (concurrency 16): {total} jobs = 1 from part "
                f"1 + {committed - 1} + 1 poisoned from part 2", bold=True)
    # The worker's errors are held back while the progress bar draws, then shown under it.
    held = io.StringIO()
    configure_logging("text", "ERROR", stream=held)
    worker = Worker(demo.app, url, WorkerConfig(concurrency=16, job_log=False,
                                                poll_interval=0.2))
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False},
                              daemon=True)
    started = time.monotonic()
    thread.start()
    try:
        done = 0
        with click.progressbar(length=total, label="  jobs finished") as bar:
            while done < total:
                counts = _counts(engine, demo)
                now_done = counts.get("succeeded", 0) + counts.get("dead", 0)
                bar.update(now_done - done)
                done = now_done
                time.sleep(0.1)
        elapsed = time.monotonic() - started
    finally:
        # Stopped (and its connections closed) before the schema is dropped, even on Ctrl-C.
        worker.stop()
        thread.join(timeout=WORKER_STOP_TIMEOUT)
        configure_logging("text", "ERROR")
        if held.getvalue():
            click.echo("  worker log (errors):")
            for line in held.getvalue().splitlines():
                click.echo(f"    {line}")

    jobs, orders, shipments = demo.table("steps"), demo.table("orders"), demo.table("shipments")
    with engine.connect() as c:
        retried = c.execute(sa.text(
            f"SELECT count(*) FROM {jobs} WHERE attempts > 1")).scalar() or 0
        dead = c.execute(sa.text(
            f"SELECT task, args::text, last_error FROM {jobs} WHERE status = 'dead'")).all()
        shipped = c.execute(sa.text(f"SELECT count(*) FROM {shipments}")).scalar()
        orphan = c.execute(sa.text(
            f"SELECT count(*) FROM {shipments} s LEFT JOIN {orders} o ON o.id = s.order_id "
            "WHERE o.id IS NULL")).scalar()
    counts = _counts(engine, demo)
    click.secho("\n4. Summary", bold=True)
    succeeded = counts.get("succeeded", 0)
    click.echo(f"  processed:    {succeeded} succeeded + {len(dead)} dead = "
               f"{succeeded + len(dead)} of the {total} committed jobs")
    click.echo(f"  retried:      {retried} job(s) needed more than one attempt")
    click.echo(f"  dead:         {len(dead)}")
    for task, args, err in dead:
        click.echo(f"                {task} {args}: {(err or '').splitlines()[-1]}")
    click.echo(f"  rolled back:  {rolled_back} jobs never existed (their transactions rolled "
               "back)")
    click.echo(f"  ledger:       {shipped} shipments for {counts.get('succeeded', 0)} "
               f"succeeded jobs, {orphan} for rolled-back orders")
    click.echo(f"  throughput:   {total / elapsed:,.0f} jobs/s over {elapsed:.1f}s")
