"""Tasks on limited and paused queues for tests/integration/test_queues.py; each writes its start and end
(wall clock, this host) to `queue_ledger` through ctx.session, committed with its success."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import sqlalchemy as sa

import flowq

LEDGER_DDL = """CREATE TABLE IF NOT EXISTS queue_ledger (
    job_id bigint PRIMARY KEY, task text NOT NULL, key text, started float8 NOT NULL,
    ended float8 NOT NULL)"""

app = flowq.FlowQ()
app.queue("capped", concurrency=3)
app.queue("metered", rate_limit=flowq.Rate(20, per=timedelta(seconds=1)))


def _ledger(ctx: flowq.Context, task: str, key: str | None, started: float) -> None:
    ctx.session.execute(sa.text(
        "INSERT INTO queue_ledger (job_id, task, key, started, ended) "
        "VALUES (:j, :t, :k, :s, :e)"), {"j": ctx.job_id, "t": task, "k": key, "s": started,
                                        "e": time.time()})


@app.task(queue="capped")
def capped(ctx: flowq.Context, sleep: float = 0.05) -> None:
    started = time.time()
    time.sleep(sleep)
    _ledger(ctx, "capped", None, started)


@app.task(queue="metered")
def metered(ctx: flowq.Context) -> None:
    _ledger(ctx, "metered", None, time.time())


@app.task(queue="keyed", concurrency_key="customer", key_concurrency=1)
def per_customer(ctx: flowq.Context, customer: str, sleep: float = 0.05) -> None:
    started = time.time()
    time.sleep(sleep)
    _ledger(ctx, "per_customer", customer, started)


@app.task(queue="free")
def free(ctx: flowq.Context) -> None:
    _ledger(ctx, "free", None, time.time())


@app.task(queue="slow")
def stubborn_sync(ctx: flowq.Context, seconds: float = 60.0) -> str:
    """Loops until cancelled (or `seconds` pass), checking ctx.cancelled."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ctx.raise_if_cancelled()
        time.sleep(0.05)
    return "finished"


@app.task(queue="slow")
async def stubborn_async(ctx: flowq.Context, seconds: float = 60.0) -> str:
    await asyncio.sleep(seconds)
    return "finished"
