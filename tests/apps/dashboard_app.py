"""The dashboard tests' app: a task that dies while `BROKEN` is set (with hostile text in its
arguments and its error) and a two-step pipeline, all on queue "dash"."""

from __future__ import annotations

from collections.abc import Iterator

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
