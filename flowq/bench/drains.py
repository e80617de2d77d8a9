"""Timing a drain: N jobs enqueued in one commit, consumed by flowq workers or by a raw loop.

The clock is the database's: t0 is `clock_timestamp()` read right after the enqueue commits
(flowq workers are already running and listening, so they wake at that commit) or right
before the raw loops are released; the end is `max(finished_at)`, which both flowq and the
raw loops set with `now()`. Process start-up is outside the window either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

import flowq
from flowq.bench import baselines
from flowq.bench.app import app as bench_app
from flowq.bench.harness import WorkerGroup, conninfo, reset, wait_for

__all__ = ["Check", "db_clock", "enqueue_run", "enqueue_runs", "flowq_drain", "raw_drain",
           "wait_drained"]

Check = Callable[[sa.Engine], None]
"""Called after each timed drain (outside the window): raises if the rows are not as expected."""

DRAIN_TIMEOUT: Final = 1800.0

_BUSY = sa.text("SELECT EXISTS (SELECT 1 FROM flowq.jobs WHERE status = 'pending') "
                "OR EXISTS (SELECT 1 FROM flowq.jobs WHERE status = 'running')")
_TALLY = sa.text("SELECT count(*) FILTER (WHERE status = 'succeeded') AS ok, count(*) AS total, "
                 "extract(epoch FROM max(finished_at))::float8 AS last FROM flowq.jobs")


def db_clock(engine: sa.Engine) -> float:
    with engine.connect() as c:
        return float(c.execute(sa.text(
            "SELECT extract(epoch FROM clock_timestamp())::float8")).scalar_one())


def enqueue_runs(engine: sa.Engine, task: str, n: int) -> float:
    """Enqueue `n` runs of `task` in one transaction with enqueue_many; the DB clock after."""
    definition = bench_app.get(task)  # the object, not the name: its queue and first step
    assert definition is not None, task
    make = sessionmaker(engine, class_=flowq.Session)
    with make.begin() as s:
        s.enqueue_many(definition, [{"n": i} for i in range(n)])
    return db_clock(engine)


def enqueue_run(engine: sa.Engine, task: str, **args: Any) -> float:
    """Enqueue one run of `task` with `args` in a transaction of its own; the DB clock after."""
    definition = bench_app.get(task)
    assert definition is not None, task
    make = sessionmaker(engine, class_=flowq.Session)
    with make.begin() as s:
        s.enqueue(definition, **args)
    return db_clock(engine)


def wait_drained(engine: sa.Engine, expected: int, t0: float) -> float:
    """Wait until nothing is pending or running; the elapsed seconds from `t0` to the last
    completion. Raises if fewer than `expected` rows succeeded."""

    def idle() -> bool:
        with engine.connect() as c:
            return not c.execute(_BUSY).scalar()

    wait_for(idle, DRAIN_TIMEOUT, "the drain", interval=0.1)
    with engine.connect() as c:
        tally = c.execute(_TALLY).one()
    if tally.ok < expected:
        raise RuntimeError(f"drain ended with {tally.ok} of {expected} jobs succeeded "
                           f"({tally.total} rows)")
    return max(1e-6, float(tally.last) - t0)


def flowq_drain(url: str, engine: sa.Engine, task: str, runs: int, rows_per_run: int,
                processes: int, concurrency: int, repeat: int, check: Check | None = None
                ) -> list[float]:
    """Rows per second through real `flowq worker` processes, once per repeat."""
    rates = []
    with WorkerGroup(url, processes=processes, concurrency=concurrency) as workers:
        workers.wait_ready(engine)
        for _ in range(repeat):
            reset(engine)
            t0 = enqueue_runs(engine, task, runs)
            rates.append(runs * rows_per_run / wait_drained(engine, runs * rows_per_run, t0))
            if check is not None:
                check(engine)
    return rates


def raw_drain(url: str, engine: sa.Engine, kind: str, task: str, runs: int, rows_per_run: int,
              processes: int, repeat: int, check: Check | None = None) -> list[float]:
    """Rows per second through P raw psycopg loops of `kind`, once per repeat."""
    rates = []
    for _ in range(repeat):
        reset(engine)
        enqueue_runs(engine, task, runs)
        with baselines.run_loops(kind, conninfo(url), processes) as loops:
            t0 = db_clock(engine)
            loops.go()
            loops.join()
        rates.append(runs * rows_per_run / wait_drained(engine, runs * rows_per_run, t0))
        if check is not None:
            check(engine)
    return rates


def engine_for(url: str, **kw: Any) -> sa.Engine:
    return sa.create_engine(url, pool_size=4, **kw)
