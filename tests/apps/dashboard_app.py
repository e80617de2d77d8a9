"""The dashboard tests' app: a task that dies while `BROKEN` is set (with hostile text in its
arguments and its error), a two-step pipeline, a task that fails twice then succeeds, a graph
with a join and a signal wait, a map, a nightly schedule and a batch callback, all on queue
"dash" (one step on "dash-limited")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from tenacity import stop_after_attempt

import flowq
from flowq.ops.runs import get_run
from flowq.testing import drain

app = flowq.FlowQ()
app.queue("dash-limited", concurrency=3)

BROKEN = {"on": True}
HOSTILE = "<script>document.title='pwned'</script><img src=x onerror=alert(1)>"


@app.task(name="dash_fragile", queue="dash", retry=flowq.Retry(stop=stop_after_attempt(1)))
def fragile(ctx: flowq.Context, note: str) -> dict[str, str]:
    if BROKEN["on"]:
        raise RuntimeError(f"{HOSTILE} failed on {note}")
    return {"echo": note}


two = app.pipeline("dash_two")


@two.step(queue="dash")
def first(ctx: flowq.Context, n: int) -> dict[str, int]:
    return {"n": n + 1}


@two.step(queue="dash-limited")
def second(ctx: flowq.Context, n: int) -> int:
    return n * 2


@app.task(name="dash_flaky", queue="dash", retry=flowq.Retry(stop=stop_after_attempt(4)))
def flaky(ctx: flowq.Context, n: int) -> int:
    if ctx.attempt < 3:
        raise ValueError(f"flaky attempt {ctx.attempt} of {n}")
    return n


graph = app.pipeline("dash_graph", queue="dash")


@graph.step()
def fetch(ctx: flowq.Context, order: int) -> dict[str, int]:
    return {"order": order}


@graph.step(parents=["fetch"])
def price(ctx: flowq.Context, order: int) -> dict[str, int]:
    return {"cents": order * 100}


@graph.step(parents=["fetch"])
def stock(ctx: flowq.Context, order: int) -> dict[str, bool]:
    return {"ok": True}


@graph.step(parents=["price", "stock"])
def combine(ctx: flowq.Context, price: dict[str, int], stock: dict[str, bool]) -> dict[str, int]:
    return {"cents": price["cents"]}


@graph.step(wait_for="approval", wait_timeout=3600)
def approve(ctx: flowq.Context, cents: int, approval: Any) -> dict[str, int]:
    return {"cents": cents}


@graph.step()
def ship(ctx: flowq.Context, cents: int) -> None:
    return None


fan = app.pipeline("dash_map", queue="dash")


@fan.step()
def split(ctx: flowq.Context, n: int) -> flowq.Each:
    return flowq.each([{"i": i} for i in range(n)])


@fan.step()
def item(ctx: flowq.Context, i: int) -> int:
    return i * i


@fan.step()
def gather(ctx: flowq.Context, item: list[int]) -> dict[str, int]:
    return {"sum": sum(item)}


def dead_run(engine: sa.Engine, note: str = HOSTILE, key: str | None = None) -> int:
    """A run of `fragile` enqueued, drained in-process and dead (while BROKEN is set)."""
    with engine.begin() as conn:
        run_id = flowq.enqueue(conn, fragile, note=note, idempotency_key=key).id
    drain(engine, app, raise_on_dead=False)
    assert get_run(engine, run_id).status == "dead"
    return run_id


@pytest.fixture(autouse=True)
def reset_broken() -> Iterator[None]:
    """Every dashboard test starts (and leaves) `fragile` broken."""
    BROKEN["on"] = True
    yield
    BROKEN["on"] = True


@app.periodic(cron="0 3 * * *", name="dash_nightly", args={"n": 5})
@app.task(name="dash_report", queue="dash")
def report(ctx: flowq.Context, n: int) -> int:
    return n


@app.task(name="dash_batch_done", queue="dash")
def batch_done(ctx: flowq.Context, batch_id: int, succeeded: int, dead: int,
               cancelled: int) -> None:
    return None
