"""The app `flowq bench` runs its workers on: `flowq worker flowq_bench.app:app`.

Every handler is as cheap as a handler can be, so what is measured is flowq itself:
- `noop`: does nothing (the batched-completion path);
- `ledger`: writes one row through `ctx.session` (the exactly-once path: one commit per job);
- `stamp`: records when the handler started, through `ctx.session` (pickup latency);
- `steps`: a pipeline of three no-op steps (successor inserts in the completer);
- `dag`: a diamond of no-op steps, start -> left, right -> join (a join counter in
  `flowq.joins`: the second parent to succeed creates `join`, with both results);
- `fan`: `split` returns `flowq.each` of `n` items, `work` runs once per item (no-op, or with
  `session=True` one row through `ctx.session`, as `ledger`), and `gather` receives the list
  of the `n` results (a map and its join) and returns its length, which the bench checks;
- `limited`: a no-op on queue `bench_limited`, declared with a global concurrency limit
  (`FLOWQ_BENCH_QUEUE_LIMIT`, default 50) for the `limit` scenario;
- `checkpointed`: ten checkpoints, each writing one `bench_ledger` row in its own session
  (ten commits per job, each fenced on the claim: the `checkpoint` scenario);
- `sleeper`: one durable `ctx.sleep(seconds)` (the job gives its slot back and runs again
  when due, its attempt given back: the `sleep` scenario);
- `rated`: a no-op on queue `bench_rate`, declared with a rate limit
  (`FLOWQ_BENCH_RATE` starts per second, default 200) for the `rate` scenario.

The limits are read from the environment when the module is imported, so that the bench can
give its worker processes other sizes (`--quick`) through `WorkerGroup(env=...)`; the workers
write them to `flowq.queues` when they start, as any deployment does. Every other scenario
runs its workers with `--queues bench`, so the two limited queues cost them nothing.

The tables the handlers write to are created in the bench's template database
(`flowq_bench.harness`).
"""

from __future__ import annotations

import os
import time
from typing import Any, Final

import sqlalchemy as sa

import flowq
from flowq.durable.context import Context

__all__ = ["CHECKPOINTS", "LIMITED_QUEUE", "LIMIT_ENV", "RATE_ENV", "RATE_QUEUE", "app",
           "checkpointed", "dag", "fan", "ledger", "limited", "noop", "rated", "sleeper", "stamp", "steps"]

LIMITED_QUEUE: Final = "bench_limited"
CHECKPOINTS: Final = 10  # per job of `checkpointed`
RATE_QUEUE: Final = "bench_rate"
LIMIT_ENV: Final = "FLOWQ_BENCH_QUEUE_LIMIT"
RATE_ENV: Final = "FLOWQ_BENCH_RATE"

app = flowq.FlowQ()
app.queue(LIMITED_QUEUE, concurrency=int(os.environ.get(LIMIT_ENV, "50")))
app.queue(RATE_QUEUE, rate_limit=flowq.Rate(int(os.environ.get(RATE_ENV, "200")), per=1.0))

_INSERT_LEDGER = sa.text("INSERT INTO bench_ledger (job_id) VALUES (:job_id)")
_INSERT_STAMP = sa.text("INSERT INTO bench_stamps (run_id, started) VALUES (:run_id, :started)")


@app.task(queue="bench")
def noop(ctx: Context, n: int = 0) -> None:
    """Nothing at all."""


@app.task(queue=LIMITED_QUEUE)
def limited(ctx: Context, n: int = 0) -> None:
    """Nothing, on the queue with a global concurrency limit."""


@app.task(queue=RATE_QUEUE)
def rated(ctx: Context, n: int = 0) -> None:
    """Nothing, on the rate-limited queue."""


@app.task(queue="bench")
def ledger(ctx: Context, n: int = 0) -> None:
    """One row through ctx.session, committed with the job's success."""
    ctx.session.execute(_INSERT_LEDGER, {"job_id": ctx.job_id})


def _ledger_row(job_id: int, *, session: sa.orm.Session) -> None:
    session.execute(_INSERT_LEDGER, {"job_id": job_id})


@app.task(queue="bench")
def checkpointed(ctx: Context, n: int = 0) -> None:
    """Ten checkpoints, each one `bench_ledger` row committed with its record."""
    for i in range(CHECKPOINTS):
        ctx.checkpoint(f"row-{i}", _ledger_row, ctx.job_id)


@app.task(queue="bench")
def sleeper(ctx: Context, n: int = 0, seconds: float = 1.0) -> None:
    """One durable sleep: the first call suspends the job, the second returns."""
    ctx.sleep(seconds)


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
def fan_split(ctx: Context, n: int = 0, session: bool = False) -> flowq.Each:
    return flowq.each([{"i": i, "session": True} if session else {"i": i} for i in range(n)])


@fan.step(name="work")
def fan_work(ctx: Context, i: int = 0, session: bool = False) -> None:
    if session:  # what `ledger` does: one row, committed with the instance's success
        ctx.session.execute(_INSERT_LEDGER, {"job_id": ctx.job_id})


@fan.step(name="gather")
def fan_gather(ctx: Context, work: list[Any]) -> int:
    """How many results it received: the bench checks it is `n`."""
    return len(work)
