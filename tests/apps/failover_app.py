"""A test app for tests/acceptance/test_failover.py: ledger tasks and a two-step pipeline whose
every step writes one ledger row through ctx.session (committed with the step's completion),
and plain tasks that write nothing (their effect is the job row alone)."""

from __future__ import annotations

import os
import time

import sqlalchemy as sa

import flowq
from flowq.durable.context import Context

app = flowq.FlowQ()

LEDGER_DDL = ("CREATE TABLE IF NOT EXISTS fo_ledger (job_id bigint NOT NULL, run_id bigint NOT "
              "NULL, step text NOT NULL, pid int NOT NULL, at timestamptz NOT NULL DEFAULT "
              "clock_timestamp())")
# The producer's business rows: one per enqueue, in the enqueue's own transaction.
ORDERS_DDL = "CREATE TABLE IF NOT EXISTS fo_orders (n bigint PRIMARY KEY, job_id bigint NOT NULL)"


def _ledger(ctx: Context, step: str) -> None:
    ctx.session.execute(sa.text(
        "INSERT INTO fo_ledger (job_id, run_id, step, pid) VALUES (:j, :r, :s, :p)"),
        {"j": ctx.job_id, "r": ctx.run_id, "s": step, "p": os.getpid()})


@app.task()
def fo_record(ctx: Context, n: int) -> None:
    """A few milliseconds of work, then one ledger row."""
    time.sleep(0.004)
    _ledger(ctx, "record")


@app.task()
def fo_plain(ctx: Context, n: int) -> int:
    time.sleep(0.002)
    return n


fo_pipe = app.pipeline("fo_pipe")


@fo_pipe.step()
def fo_first(ctx: Context, n: int) -> dict[str, int]:
    _ledger(ctx, "first")
    return {"n": n}


@fo_pipe.step()
def fo_second(ctx: Context, n: int) -> None:
    time.sleep(0.002)
    _ledger(ctx, "second")
