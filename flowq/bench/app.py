"""The app `flowq bench` runs its workers on: `flowq worker flowq.bench.app:app`.

Every handler is as cheap as a handler can be, so what is measured is flowq itself:
- `noop`: does nothing (the batched-completion path);
- `ledger`: writes one row through `ctx.session` (the exactly-once path: one commit per job);
- `stamp`: records when the handler started, through `ctx.session` (pickup latency);
- `steps`: a pipeline of three no-op steps (successor inserts in the completer).

The tables the handlers write to are created by `flowq.bench.harness.prepare_database`.
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa

import flowq
from flowq.context import Context

__all__ = ["app", "ledger", "noop", "stamp", "steps"]

app = flowq.FlowQ()

_INSERT_LEDGER = sa.text("INSERT INTO bench_ledger (job_id) VALUES (:job_id)")
_INSERT_STAMP = sa.text("INSERT INTO bench_stamps (run_id, started) VALUES (:run_id, :started)")


@app.task(queue="bench")
def noop(ctx: Context, n: int = 0) -> None:
    """Nothing at all."""


@app.task(queue="bench")
def ledger(ctx: Context, n: int = 0) -> None:
    """One row through ctx.session, committed with the job's success."""
    ctx.session.execute(_INSERT_LEDGER, {"job_id": ctx.job_id})


@app.task(queue="bench")
def stamp(ctx: Context, n: int = 0) -> None:
    """Record the handler's start (wall clock, same machine as the producer)."""
    started = time.time()
    ctx.session.execute(_INSERT_STAMP, {"run_id": ctx.run_id, "started": started})


steps = app.pipeline("steps", queue="bench")


@steps.step()
def first(ctx: Context, n: int = 0) -> dict[str, Any]:
    return {"n": n}


@steps.step()
def second(ctx: Context, n: int = 0) -> dict[str, Any]:
    return {"n": n}


@steps.step()
def third(ctx: Context, n: int = 0) -> None:
    return None
