"""A test app for batches (tests/integration/test_batches.py): 200 items, every tenth of which
fails until it is dead, and the batch's callback, each writing its ledger through ctx.session
(so a killed attempt's row never commits)."""

from __future__ import annotations

import time

import sqlalchemy as sa
from ledger_app import write_ledger_row
from tenacity import stop_after_attempt, wait_none

import flowq
from flowq.durable.context import Context

app = flowq.FlowQ()

LEDGER_DDL = ("CREATE TABLE IF NOT EXISTS batch_ledger (batch_id bigint NOT NULL, "
              "succeeded int NOT NULL, dead int NOT NULL, cancelled int NOT NULL, "
              "tag text NOT NULL, job_id bigint NOT NULL)")


@app.task(retry=flowq.Retry(stop=stop_after_attempt(3), wait=wait_none()))
def item(ctx: Context, n: int) -> None:
    """Hold the slot a little (so a kill catches some running), then fail or write a row."""
    time.sleep(0.05)
    if n % 10 == 0:
        raise RuntimeError(f"item {n} always fails")
    write_ledger_row(ctx)


@app.task()
def finished(ctx: Context, batch_id: int, succeeded: int, dead: int, cancelled: int,
             tag: str) -> None:
    """The batch's callback: one row per call."""
    ctx.session.execute(sa.text(
        "INSERT INTO batch_ledger VALUES (:b, :s, :d, :c, :t, :j)"),
        {"b": batch_id, "s": succeeded, "d": dead, "c": cancelled, "t": tag, "j": ctx.job_id})
