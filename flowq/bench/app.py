"""The app `flowq bench` runs its workers on: `flowq worker flowq.bench.app:app`.

Every handler is as cheap as a handler can be, so what is measured is flowq itself:
- `noop`: does nothing (the batched-completion path);
- `ledger`: writes one row through `ctx.session` (the exactly-once path: one commit per job);
- `stamp`: records when the handler started, through `ctx.session` (pickup latency);
- `steps`: a pipeline of three no-op steps (successor inserts in the completer);
- `dag`: a diamond of no-op steps, start -> left, right -> join (a join counter in
  `flowq.joins`: the second parent to succeed creates `join`, with both results);
- `fan`: `split` returns `flowq.each` of `n` items, `work` runs once per item (no-op), and
  `gather` receives the list of the `n` results (a map and its join) and returns its length,
  which the bench checks.

The tables the handlers write to are created by `flowq.bench.harness.prepare_database`.
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa

import flowq
from flowq.context import Context

__all__ = ["app", "dag", "fan", "ledger", "noop", "stamp", "steps"]

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


dag = app.pipeline("dag", queue="bench")


@dag.step(name="start")
def dag_start(ctx: Context, n: int = 0) -> None:
    return None


@dag.step(name="left", parents=[dag_start])
def dag_left(ctx: Context) -> None:
    return None


@dag.step(name="right", parents=[dag_start])
def dag_right(ctx: Context) -> None:
    return None


@dag.step(name="join", parents=[dag_left, dag_right])
def dag_join(ctx: Context, left: Any, right: Any) -> None:
    return None


fan = app.pipeline("fan", queue="bench")


@fan.step(name="split")
def fan_split(ctx: Context, n: int = 0) -> flowq.Each:
    return flowq.each([{"i": i} for i in range(n)])


@fan.step(name="work")
def fan_work(ctx: Context, i: int = 0) -> None:
    return None


@fan.step(name="gather")
def fan_gather(ctx: Context, work: list[Any]) -> int:
    """How many results it received: the bench checks it is `n`."""
    return len(work)
