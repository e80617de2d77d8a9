"""Waiting and looking: the small helpers flowq's own tests have always used.

- `wait_until(predicate, timeout=30.0, interval=0.05)`: poll a condition with a deadline
  instead of sleeping.
- `run_until_idle(app, url, horizon=60.0, **config)`: run a real in-process worker (threads,
  its own connections, committed jobs only) until no due job is left. For a deterministic,
  thread-free run inside a test's transaction, use `flowq.testing.drain`.
- `running_worker(app, url, **config)`: a context manager running a real worker on a thread
  for the duration of the block (`Worker.running`: stopped and joined at its end; an
  exception in the worker fails the test), for tests that act while a worker runs.
- `job_rows(engine, schema="flowq", where="TRUE", **params)`: the committed rows of
  `flowq.jobs`, for assertions.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa

from flowq.define.app import FlowQ
from flowq.names import DEFAULT_SCHEMA, validate_schema_name

if TYPE_CHECKING:
    from flowq.worker import Worker

__all__ = ["job_rows", "run_until_idle", "running_worker", "wait_until"]

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.05,
               message: str = "condition") -> T:
    """Return the first truthy value of `predicate()`, or raise AssertionError at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


def run_until_idle(app: FlowQ, url: str, *, horizon: float = 60.0, **config: Any) -> None:
    """Run a real worker for `app` in this process until nothing is running and no job is due
    within `horizon` seconds (retries scheduled sooner are waited for), then stop.

    `config` is passed to `WorkerConfig` (e.g. `concurrency=4`, `queues=[...]`)."""
    from flowq.worker import Worker, WorkerConfig

    config.setdefault("poll_interval", 0.1)
    config.setdefault("shutdown_grace", 5.0)
    Worker(app, url, WorkerConfig(**config)).run(install_signals=False, until_idle=True,
                                                 idle_horizon=horizon)


@contextlib.contextmanager
def running_worker(app: FlowQ, url: str, **config: Any) -> Iterator[Worker]:
    """A real worker for `app` on a thread while the block runs (`Worker.running`); stopped
    and joined at its end, re-raising what it raised. `config` goes to `WorkerConfig`
    (defaults here: `poll_interval=0.1`, `shutdown_grace=5.0`)."""
    from flowq.worker import Worker, WorkerConfig

    config.setdefault("poll_interval", 0.1)
    config.setdefault("shutdown_grace", 5.0)
    with Worker(app, url, WorkerConfig(**config)).running() as worker:
        yield worker


def job_rows(engine: sa.Engine, schema: str = DEFAULT_SCHEMA,
             where: str = "TRUE", **params: Any) -> list[sa.Row[Any]]:
    """Every step's row, live (`jobs`) or finished (`job_history`), optionally filtered by an SQL
    condition, oldest first (`steps`: the two tables, and `retired_at`, NULL while live)."""
    validate_schema_name(schema)
    with engine.connect() as conn:
        return list(conn.execute(sa.text(
            f"SELECT * FROM {schema}.steps WHERE {where} ORDER BY id"), params))
