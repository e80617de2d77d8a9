"""A test app whose handlers misbehave on purpose, beside two well-behaved ones.

`always_fail` fails every attempt, logging the attempt's start on the database clock through
a separate autocommit connection (so the log survives the attempt's rollback); `returns_set`
and `returns_nul` return what flowq cannot store. `record` writes a ledger row like
ledger_app's; `noop` never touches ctx.session, so its success goes through the batched
completer. `kill_worker` SIGKILLs the worker process running it."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import sqlalchemy as sa
from ledger_app import write_ledger_row
from tenacity import stop_after_attempt, wait_fixed

import flowq
from flowq.durable.context import Context

app = flowq.FlowQ()

ATTEMPT_LOG_DDL = ("CREATE TABLE IF NOT EXISTS attempt_log (job_id bigint NOT NULL, "
                   "attempt int NOT NULL, started_at timestamptz NOT NULL)")
RETRY_WAIT = 1.0
RETRY_ATTEMPTS = 3

_log_engines: dict[str, sa.Engine] = {}


def _log_attempt(ctx: Context) -> None:
    url = ctx.session.get_bind().url
    key = url.render_as_string(hide_password=False)
    engine = _log_engines.get(key)
    if engine is None:
        engine = _log_engines[key] = sa.create_engine(
            url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        conn.execute(sa.text("INSERT INTO attempt_log (job_id, attempt, started_at) "
                             "VALUES (:j, :a, clock_timestamp())"),
                     {"j": ctx.job_id, "a": ctx.attempt})


@app.task(retry=flowq.Retry(stop=stop_after_attempt(RETRY_ATTEMPTS),
                            wait=wait_fixed(RETRY_WAIT)))
def always_fail(ctx: Context, n: int) -> None:
    """Log the attempt's start, then fail."""
    _log_attempt(ctx)
    raise ValueError(f"always fails (n={n})")


@app.task(retry=flowq.Retry(stop=stop_after_attempt(2), wait=wait_fixed(0.1)))
def returns_set(ctx: Context) -> Any:
    """A set is not JSON."""
    return {1, 2, 3}


@app.task(retry=flowq.Retry(stop=stop_after_attempt(2), wait=wait_fixed(0.1)))
def returns_nul(ctx: Context) -> str:
    """jsonb cannot hold a NUL character."""
    return "before\x00after"


@app.task()
def record(ctx: Context, n: int, sleep: float = 0.0) -> None:
    """Like ledger_app.record: one ledger row, committed with the job's success."""
    if sleep:
        time.sleep(sleep)
    write_ledger_row(ctx)


@app.task()
def noop(ctx: Context, n: int) -> dict[str, int]:
    """Never touches ctx.session, so its success goes through the batched completer."""
    return {"n": n}


@app.task(retry=flowq.Retry(stop=stop_after_attempt(2), wait=wait_fixed(0.1)))
def kill_worker(ctx: Context) -> None:
    """A poison job: kills the worker process running it, every time."""
    os.kill(os.getpid(), signal.SIGKILL)
