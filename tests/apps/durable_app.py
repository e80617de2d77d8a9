"""A test app for durable execution (tests/acceptance/test_durable.py): a step of five
checkpoints whose session writes land in `durable_effects`, each call also logged, whatever
becomes of it, in `durable_calls` (on a connection of its own); and a step that sleeps."""

from __future__ import annotations

import os
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session
from tenacity import stop_after_attempt

import flowq

app = flowq.FlowQ()

LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS durable_effects (run_id bigint NOT NULL, name text NOT NULL,
    attempt int NOT NULL, pid int NOT NULL, PRIMARY KEY (run_id, name, attempt));
CREATE TABLE IF NOT EXISTS durable_calls (id bigserial PRIMARY KEY, run_id bigint NOT NULL,
    name text NOT NULL, attempt int NOT NULL, pid int NOT NULL);
CREATE TABLE IF NOT EXISTS durable_gates (run_id bigint PRIMARY KEY);
"""
HOLD_LIMIT = 120.0  # seconds a held attempt waits for its gate at most

_engine: sa.Engine | None = None


def engine() -> sa.Engine:
    """The call log's own engine (the test passes its URL): a call is logged even when the
    checkpoint's transaction rolls back."""
    global _engine
    if _engine is None:
        _engine = sa.create_engine(os.environ["DURABLE_LEDGER_URL"], pool_size=2)
    return _engine


def effect(run_id: int, name: str, attempt: int, *, session: Session) -> dict[str, Any]:
    """One checkpoint's work: logged as called, and its effect written in its session."""
    params = {"r": run_id, "n": name, "a": attempt, "p": os.getpid()}
    with engine().begin() as conn:
        conn.execute(sa.text("INSERT INTO durable_calls (run_id, name, attempt, pid) "
                             "VALUES (:r, :n, :a, :p)"), params)
    session.execute(sa.text("INSERT INTO durable_effects (run_id, name, attempt, pid) "
                            "VALUES (:r, :n, :a, :p)"), params)
    return {"name": name, "attempt": attempt}


def _hold(run_id: int) -> None:
    """Wait until the test opens this run's gate (bounded): the worker is killed or frozen
    here."""
    deadline = time.monotonic() + HOLD_LIMIT
    while time.monotonic() < deadline:
        with engine().connect() as conn:
            if conn.execute(sa.text("SELECT 1 FROM durable_gates WHERE run_id = :r"),
                            {"r": run_id}).first():
                return
        time.sleep(0.05)


@app.task(retry=flowq.Retry(stop=stop_after_attempt(5)))
def five(ctx: flowq.Context, hold_after: int = 3) -> dict[str, Any]:
    """Five checkpoints; the first attempt holds after checkpoint `hold_after`."""
    done = []
    for i in range(1, 6):
        done.append(ctx.checkpoint(f"c{i}", effect, ctx.run_id, f"c{i}", ctx.attempt))
        if i == hold_after and ctx.attempt == 1:
            _hold(ctx.run_id)
    return {"by": [d["attempt"] for d in done]}


@app.task()
def nap(ctx: flowq.Context, seconds: float = 2.0) -> dict[str, int]:
    """Sleep durably, then say on which attempt it finished."""
    ctx.sleep(seconds)
    return {"attempt": ctx.attempt}
