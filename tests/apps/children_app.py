"""A test app for child runs (tests/acceptance/test_child_runs.py): a parent starting `count`
children, slowly on its first attempt (so that its worker can be killed mid-way), then
waiting on all of them; each start and each child call is logged on a connection of its own
(`children_calls`, whatever becomes of it), and each child's and the parent's effects are
written in `ctx.session` (`children_effects`: committed once, with the step's success)."""

from __future__ import annotations

import os
import time
from typing import Any

import sqlalchemy as sa
from tenacity import stop_after_attempt

import flowq

app = flowq.FlowQ()

LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS children_calls (id bigserial PRIMARY KEY, run_id bigint NOT NULL,
    what text NOT NULL, child bigint, attempt int NOT NULL, pid int NOT NULL);
CREATE TABLE IF NOT EXISTS children_effects (run_id bigint PRIMARY KEY, what text NOT NULL,
    value jsonb NOT NULL);
"""
START_PAUSE = 0.02  # seconds between two starts of the parent's first attempt

_engine: sa.Engine | None = None


def log(run_id: int, what: str, attempt: int, child: int | None = None) -> None:
    """Log a call on the ledger's own engine (the test passes its URL): kept even when the
    step's transaction rolls back or its worker dies."""
    global _engine
    if _engine is None:
        _engine = sa.create_engine(os.environ["CHILDREN_LEDGER_URL"], pool_size=2)
    with _engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO children_calls (run_id, what, child, attempt, pid) "
                             "VALUES (:r, :w, :c, :a, :p)"),
                     {"r": run_id, "w": what, "c": child, "a": attempt, "p": os.getpid()})


def effect(ctx: flowq.Context, what: str, value: str) -> None:
    ctx.session.execute(sa.text("INSERT INTO children_effects VALUES (:r, :w, CAST(:v AS jsonb))"),
                        {"r": ctx.run_id, "w": what, "v": value})


@app.task(retry=flowq.Retry(stop=stop_after_attempt(5)))
def square(ctx: flowq.Context, n: int) -> dict[str, int]:
    log(ctx.run_id, "square", ctx.attempt)
    effect(ctx, "square", str(n))
    return {"n": n * n}


@app.task(retry=flowq.Retry(stop=stop_after_attempt(5)))
def fan_out(ctx: flowq.Context, count: int) -> dict[str, Any]:
    """Start `count` children (slowly on the first attempt), then wait on them all."""
    children = []
    for i in range(count):
        child = ctx.start_child(square, n=i)
        log(ctx.run_id, "start", ctx.attempt, child)
        children.append(child)
        if ctx.attempt == 1:
            time.sleep(START_PAUSE)
    results = ctx.wait_all(children)
    log(ctx.run_id, "results", ctx.attempt)
    effect(ctx, "fan_out", str(len(results)))
    return {"squares": [r["n"] for r in results], "children": children}

