"""A test app whose handler appends one ledger row per job through ctx.session."""

from __future__ import annotations

import os
import time

import sqlalchemy as sa

import flowq
from flowq.durable.context import Context

app = flowq.FlowQ()

LEDGER_DDL = ("CREATE TABLE IF NOT EXISTS ledger (job_id bigint NOT NULL, run_id bigint NOT NULL,"
              " attempt int NOT NULL, pid int NOT NULL)")


@app.task()
def record(ctx: Context, n: int, sleep: float = 0.0) -> None:
    """Sleep (to hold the job) then write one ledger row, committed with the job's success."""
    if sleep:
        time.sleep(sleep)
    write_ledger_row(ctx)


def write_ledger_row(ctx: Context) -> None:
    """The one ledger row a job writes through ctx.session (shared by the test apps)."""
    ctx.session.execute(sa.text(
        "INSERT INTO ledger (job_id, run_id, attempt, pid) VALUES (:j, :r, :a, :p)"),
        {"j": ctx.job_id, "r": ctx.run_id, "a": ctx.attempt, "p": os.getpid()})
