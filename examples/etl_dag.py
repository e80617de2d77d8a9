"""A daily ETL as a graph of steps: fan out over the day's files, fan in, then a diamond.

    .venv/bin/python examples/etl_dag.py [DATABASE_URL]

Without a URL argument it starts a throwaway embedded PostgreSQL (it never reads
FLOWQ_DATABASE_URL or DATABASE_URL: an example touches only the database it is given). It
migrates flowq's schema, creates the app's tables, starts a worker in a thread of this
process, enqueues one run per day, waits for each with `flowq.ops.runs.wait_run`, and prints
each run and its graph.

The pipeline:

    open_batch ──► list_files ══► load_file (one instance per file) ──► summarize
        └───────────────────────────────────────────────────────────────────┘  (join)
    summarize ──► check_totals ──┐
              └─► render_report ─┴─► publish                                     (diamond)

What it shows:
- `flowq.each(...)`: `list_files` returns one item per file, and `load_file` runs once per
  item, in parallel, each instance with its own retries; a day without files maps `[]` and
  the run goes straight on;
- joins: `summarize` waits for `open_batch` and for every `load_file` instance, and receives
  each parent's result as a keyword named after it (the instances' results as a list, in
  item order); `publish` waits for the two branches of the diamond;
- a failing instance is retried alone: its siblings and the steps before it do not run
  again, and the rows it wrote before failing roll back with it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker
from tenacity import stop_after_attempt, wait_fixed

import flowq
import flowq.local.postgres
from flowq.db import create_engine
from flowq.durable.context import Context
from flowq.ops.runs import wait_run

# -- the application's own model -------------------------------------------------------------


class Base(DeclarativeBase):
    pass


class Batch(Base):
    __tablename__ = "etl_batches"
    id: Mapped[int] = mapped_column(primary_key=True)
    day: Mapped[str] = mapped_column(unique=True)
    status: Mapped[str]  # open, published, held


class LoadedFile(Base):
    __tablename__ = "etl_loaded_files"
    id: Mapped[int] = mapped_column(primary_key=True)
    batch_id: Mapped[int]
    name: Mapped[str]
    rows: Mapped[int]
    cents: Mapped[int]


# -- the outside world, simulated -------------------------------------------------------------

# Each day's files in the object store, and the amounts (in cents) in each file's rows.
FILES: dict[str, dict[str, list[int]]] = {
    "2024-05-01": {"orders-eu.csv": [1250, 800, 4300], "orders-us.csv": [990, 15000],
                   "orders-apac.csv": [300]},
    "2024-05-02": {"orders-eu.csv": [700], "orders-us.csv": [2500, 2500, 100, 40]},
    "2024-05-03": {},  # a holiday: no files
}
# The totals the bank reports, to check the load against.
CONTROL_TOTALS = {"2024-05-01": 22640, "2024-05-02": 5840, "2024-05-03": 0}

calls: Counter[str] = Counter()  # handler calls by step, across all runs
in_flight = 0
peak_in_flight = 0
lock = threading.Lock()


def record_call(step: str) -> None:
    with lock:
        calls[step] += 1


# -- the pipeline -----------------------------------------------------------------------------

app = flowq.FlowQ()
# A queue of its own: the in-process worker serves only it, so run against a database you
# gave, it never claims that database's other jobs.
etl = app.pipeline("daily_etl", queue="etl_example")


@etl.step()
def open_batch(ctx: Context, day: str) -> dict[str, Any]:
    record_call("open_batch")
    batch = Batch(day=day, status="open")
    ctx.session.add(batch)
    ctx.session.flush()
    return {"batch_id": batch.id, "day": day}


@etl.step()  # follows open_batch
def list_files(ctx: Context, batch_id: int, day: str) -> flowq.Each:
    record_call("list_files")
    # One item per file: each item is the keyword arguments of one `load_file` instance.
    return flowq.each([{"batch_id": batch_id, "day": day, "name": name}
                       for name in sorted(FILES[day])])


# Zero wait keeps this demo short; real code would use e.g. wait_exponential(max=60).
@etl.step(retry=flowq.Retry(stop=stop_after_attempt(3), wait=wait_fixed(0)))
def load_file(ctx: Context, batch_id: int, day: str, name: str) -> dict[str, Any]:
    global in_flight, peak_in_flight
    record_call("load_file")
    with lock:
        in_flight += 1
        peak_in_flight = max(peak_in_flight, in_flight)
    try:
        amounts = FILES[day][name]
        ctx.session.add(LoadedFile(batch_id=batch_id, name=name, rows=len(amounts),
                                   cents=sum(amounts)))
        time.sleep(0.2)  # reading the file takes a while: the instances overlap
        if (day, name) == ("2024-05-02", "orders-us.csv") and ctx.attempt == 1:
            # The row above rolls back with this attempt; the retry writes it once.
            raise ConnectionError("object store reset the connection")
        return {"name": name, "rows": len(amounts), "cents": sum(amounts)}
    finally:
        with lock:
            in_flight -= 1


# A join: it runs once `open_batch` and every `load_file` instance have succeeded, and gets
# each parent's result as a keyword named after the parent (a mapped one's as a list).
@etl.step(parents=[open_batch, load_file])
def summarize(ctx: Context, open_batch: dict[str, Any],
              load_file: list[dict[str, Any]]) -> dict[str, Any]:
    record_call("summarize")
    return {"batch_id": open_batch["batch_id"], "day": open_batch["day"],
            "files": [f["name"] for f in load_file],
            "rows": sum(f["rows"] for f in load_file),
            "cents": sum(f["cents"] for f in load_file)}


# The diamond: two steps that both follow `summarize` run in parallel ...
@etl.step(parents=[summarize])
def check_totals(ctx: Context, batch_id: int, day: str, files: list[str], rows: int,
                 cents: int) -> dict[str, Any]:
    record_call("check_totals")
    return {"ok": cents == CONTROL_TOTALS[day], "expected": CONTROL_TOTALS[day], "got": cents}


@etl.step(parents=[summarize])
def render_report(ctx: Context, batch_id: int, day: str, files: list[str], rows: int,
                  cents: int) -> dict[str, Any]:
    record_call("render_report")
    return {"batch_id": batch_id,
            "text": f"{day}: {len(files)} files, {rows} rows, {cents / 100:.2f} EUR"}


# ... and this join waits for both.
@etl.step(parents=[check_totals, render_report])
def publish(ctx: Context, check_totals: dict[str, Any],
            render_report: dict[str, Any]) -> dict[str, Any]:
    record_call("publish")
    batch = ctx.session.get(Batch, render_report["batch_id"])
    assert batch is not None
    batch.status = "published" if check_totals["ok"] else "held"
    return {"status": batch.status, "report": render_report["text"]}


# -- running it -------------------------------------------------------------------------------


def worker(url: str) -> flowq.Worker:
    """A worker for this app's queue only, to run in a thread of this process as a web app
    would embed it: `with worker(url).running():` stops it, after its running handlers
    finish, on leaving the block."""
    w = flowq.Worker(app, url, flowq.WorkerConfig(concurrency=4, poll_interval=0.5))
    w.check_database()
    return w


def main(url: str | None) -> int:
    with flowq.local.postgres.database(url) as db_url:
        engine = create_engine(db_url)
        flowq.migrate(engine)
        Base.metadata.create_all(engine)
        Session = sessionmaker(engine, class_=flowq.Session)

        with worker(db_url).running():
            run_ids = []
            for day in FILES:
                with Session.begin() as session:
                    run_ids.append(session.enqueue(etl, day=day).id)
            runs = [wait_run(engine, run_id, timeout=120) for run_id in run_ids]

        for info in runs:
            print(f"\nrun {info.run_id} ({info.task}): {info.status} -> {info.result}")
            for group in info.graph:
                parents = ", ".join(group.parents or ()) or "(root)"
                mapped = (f", {group.instances} instances" if group.instances is not None
                          else "")
                print(f"  {group.step:<14} {group.status:<10} attempts {group.attempts}"
                      f"{mapped}  <- {parents}")

        with engine.connect() as conn:
            files = conn.execute(sa.select(sa.func.count()).select_from(LoadedFile)).scalar()
            published = conn.execute(sa.select(sa.func.count()).select_from(Batch)
                                     .where(Batch.status == "published")).scalar()
        engine.dispose()
        print(f"\nload_file instances overlapped: up to {peak_in_flight} at once")
        print("handler calls: " + ", ".join(f"{step} {calls[step]}" for step in
                                            [s.name for s in etl.steps]))
        succeeded = sum(info.status == "succeeded" for info in runs)
        print(f"summary: {succeeded}/{len(runs)} runs succeeded, {published} batches "
              f"published, {files} files loaded by {calls['load_file']} load_file calls "
              f"({calls['load_file'] - files} retry), open_batch called {calls['open_batch']} "
              "times")
        expected_files = sum(len(f) for f in FILES.values())
        ok = (succeeded == len(runs) == published and files == expected_files
              and calls["load_file"] == expected_files + 1
              and all(calls[s.name] == len(runs) for s in etl.steps if s.name != "load_file"))
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
