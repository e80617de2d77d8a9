"""A test app whose handlers produce every outcome a hostile user can: texts PostgreSQL refuses,
delays that name no time, a retry policy that raises, exceptions that cannot be printed,
`SystemExit`, results that cannot be stored, coroutines that ignore cancellation or block the
event loop. Beside them, `record` and `async_record` behave, and must keep running.

Handlers that must run a known number of times log each start in `attempt_log` through their
own autocommit connection (it survives the attempt's rollback)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from faulty_app import _log_attempt
from ledger_app import write_ledger_row
from tenacity import retry_if_exception, stop_after_attempt, wait_fixed

import flowq
from flowq.durable.context import Context

app = flowq.FlowQ()

TWO = flowq.Retry(stop=stop_after_attempt(2), wait=wait_fixed(0.1))
THREE = flowq.Retry(stop=stop_after_attempt(3), wait=wait_fixed(0.1))


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken too")


@app.task(retry=TWO)
def unprintable(ctx: Context) -> None:
    raise Unprintable()


@app.task(retry=TWO)
async def async_unprintable(ctx: Context) -> None:
    raise Unprintable()


@app.task(retry=TWO)
def nul_error(ctx: Context) -> None:
    raise ValueError("before\x00after")


@app.task(retry=TWO)
def surrogate_error(ctx: Context) -> None:
    raise ValueError("bad byte: " + b"\xff".decode(errors="surrogateescape"))


@app.task(retry=TWO)
def huge_error(ctx: Context) -> None:
    raise ValueError("x" * 5_000_000)


@app.task(retry=TWO)
def cancel_nul(ctx: Context) -> None:
    raise flowq.CancelRun("reason with a \x00 inside")


@app.task(retry=TWO)
def retry_inf(ctx: Context) -> None:
    raise flowq.RetryStep(after=float("inf"))


@app.task(retry=TWO)
def retry_nan(ctx: Context) -> None:
    raise flowq.RetryStep(after=float("nan"))


@app.task(retry=TWO)
def retry_huge(ctx: Context) -> None:
    raise flowq.RetryStep(after=1e300)


@app.task(retry=flowq.Retry(stop=stop_after_attempt(3),
                            retry=retry_if_exception(lambda e: e.code >= 500)))  # type: ignore[attr-defined]
def policy_raises(ctx: Context) -> None:
    raise ValueError("has no .code")


@app.task(retry=TWO)
def exits(ctx: Context) -> None:
    raise SystemExit(3)


@app.task(retry=TWO)
def interrupts(ctx: Context) -> None:
    raise KeyboardInterrupt


@app.task(retry=THREE)
def not_json(ctx: Context) -> Any:
    """Runs once: a result that cannot be stored is not retried."""
    _log_attempt(ctx)
    return {"nested": [{"bad": {1, 2}}]}


@app.task(retry=TWO, timeout=1.0)
async def ignores_cancel(ctx: Context) -> None:
    for _ in range(60):
        with contextlib.suppress(asyncio.CancelledError):  # swallows the timeout's cancel
            await asyncio.sleep(0.5)


@app.task(retry=TWO, timeout=1.0)
async def blocks_loop(ctx: Context, seconds: float = 4.0) -> None:
    time.sleep(seconds)  # blocks the whole event loop


@app.task(retry=THREE)
async def async_record(ctx: Context, n: int, sleep: float = 0.0) -> None:
    await asyncio.sleep(sleep)
    write_ledger_row(ctx)


@app.task()
def record(ctx: Context, n: int, sleep: float = 0.0) -> None:
    if sleep:
        time.sleep(sleep)
    write_ledger_row(ctx)


@app.task(retry=THREE)
def slow_record(ctx: Context, sleep: float) -> None:
    """Every attempt writes its ledger row through ctx.session, then holds the job."""
    _log_attempt(ctx)
    write_ledger_row(ctx)
    time.sleep(sleep)


@app.task(retry=THREE)
def retry_soon(ctx: Context, after: float) -> None:
    _log_attempt(ctx)
    if ctx.attempt == 1:
        raise flowq.RetryStep(after=after)
