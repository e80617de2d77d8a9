"""The sleep scenario: N runs that each `ctx.sleep(S)` once, beside N no-op jobs delayed by S.

One `flowq worker` process of a small concurrency (`Options.sleep_c`, 8) serves both halves
of each repeat, so what a durable sleep costs over a job that was simply enqueued with
`delay=S` is measured on the same worker, in the same database, in the same run:

- wall time: from the enqueue's commit (the database's clock) to the last `finished_at`,
  beside the same for the delayed jobs, and beside S itself (the ideal: every run asleep at
  once, each woken on time). A sleeping run holds no slot, so N runs of S on C slots should
  take about S plus two passes of N short attempts, not N/C times S;
- runs asleep at once: the most sampled (every `SAMPLE_EVERY` s) of rows `pending` with
  `run_at` in the future, the durable sleep's state (the delayed jobs are all in it from
  the enqueue on);
- wake-up lag p50 and p99: the second attempt's start (`started_at`, the claim's clock) minus
  the deadline the sleep recorded (checkpoint `flowq.sleep.0`'s `until`); for the delayed
  jobs, `started_at` minus `run_at`.

Every repeat checks that each of the N runs ended `succeeded` with `attempts` = 1 (a sleep
gives its attempt back) and, for the sleepers, recorded exactly one sleep; it raises
otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

import flowq
from flowq_bench.app import app as bench_app
from flowq_bench.drains import DRAIN_TIMEOUT, db_clock, engine_for
from flowq_bench.harness import Server, WorkerGroup, reset
from flowq_bench.options import Options
from flowq_bench.progress import repeats
from flowq_bench.report import Figure, Row, percentile

__all__ = ["SAMPLE_EVERY", "sleep"]

SAMPLE_EVERY: Final = 0.05  # seconds between samples of the jobs' states
SLEEP_NAME: Final = "flowq.sleep.0"  # the checkpoint a step's first ctx.sleep records

# Live rows (pending, running) are in flowq.jobs; outcomes and starts are read in flowq.steps,
# which adds the finished rows of flowq.job_history.
_STATE = sa.text("""
    SELECT count(*) FILTER (WHERE status IN ('pending', 'running')) AS busy,
           count(*) FILTER (WHERE status = 'pending' AND run_at > now()) AS asleep
      FROM flowq.jobs""")
_ENDS = sa.text("""
    SELECT count(*) FILTER (WHERE status = 'succeeded' AND attempts = 1) AS ok,
           count(*) AS total, extract(epoch FROM max(finished_at))::float8 AS last
      FROM flowq.steps""")
_SLEEP_LAGS = sa.text("""
    SELECT extract(epoch FROM j.started_at - (k.result->>'until')::timestamptz)::float8
      FROM flowq.steps j
      JOIN flowq.checkpoints k ON k.run_id = j.run_id AND k.step = j.step
     WHERE k.name = :name""")
_DELAY_LAGS = sa.text("SELECT extract(epoch FROM started_at - run_at)::float8 FROM flowq.steps")


@dataclass
class Pass:
    """One timed half of a repeat: N runs enqueued in one commit and waited for."""

    wall: float      # seconds from the enqueue's commit to the last finished_at
    asleep: int      # the most rows seen pending with run_at in the future
    lag_p50: float   # ms, start minus the time it was due
    lag_p99: float


def _enqueue(engine: sa.Engine, task: str, n: int, args: dict[str, Any],
             delay: float | None) -> float:
    """`n` runs of `task` in one commit (enqueue_many); the database clock after."""
    definition = bench_app.get(task)
    assert definition is not None, task
    make = sessionmaker(engine, class_=flowq.Session)
    with make.begin() as s:
        s.enqueue_many(definition, [{"n": i, **args} for i in range(n)], delay=delay)
    return db_clock(engine)


def _wait(engine: sa.Engine, n: int, t0: float, timeout: float) -> tuple[float, int]:
    """Sample until nothing is pending or running; (wall seconds from `t0`, most asleep).
    Raises unless all `n` rows succeeded with attempts = 1, or after `timeout` seconds."""
    most, deadline = 0, time.monotonic() + timeout
    while True:
        with engine.connect() as c:
            busy, asleep = c.execute(_STATE).one()
        most = max(most, int(asleep))
        if not busy:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {n} runs")
        time.sleep(SAMPLE_EVERY)
    with engine.connect() as c:
        ends = c.execute(_ENDS).one()
    if (ends.ok, ends.total) != (n, n):
        raise RuntimeError(f"{ends.ok} of {n} runs ended succeeded with attempts = 1 "
                           f"({ends.total} rows)")
    return max(1e-6, float(ends.last) - t0), most


def _lags(engine: sa.Engine, n: int, slept: bool) -> tuple[float, float]:
    """p50 and p99 of the wake-up lag in ms; for sleepers, checks one sleep per run."""
    with engine.connect() as c:
        if slept:
            lags = [float(x) for x in c.execute(_SLEEP_LAGS, {"name": SLEEP_NAME}).scalars()]
        else:
            lags = [float(x) for x in c.execute(_DELAY_LAGS).scalars()]
    if len(lags) != n:
        raise RuntimeError(f"{len(lags)} wake-ups recorded for {n} runs")
    ms = [1000.0 * x for x in lags]
    return percentile(ms, 50), percentile(ms, 99)


def _pass(engine: sa.Engine, n: int, seconds: float, slept: bool) -> Pass:
    reset(engine)
    if slept:
        t0 = _enqueue(engine, "sleeper", n, {"seconds": seconds}, None)
    else:
        t0 = _enqueue(engine, "noop", n, {}, seconds)
    wall, most = _wait(engine, n, t0, seconds + DRAIN_TIMEOUT)
    p50, p99 = _lags(engine, n, slept)
    return Pass(wall, most, p50, p99)


def sleep(server: Server, o: Options) -> list[Row]:
    """N runs of one durable sleep of S each, beside N no-op jobs delayed by S, through one
    worker process of a small concurrency (see the module)."""
    n, s, c = o.sleep_n, o.sleep_seconds, o.sleep_c
    slept: list[Pass] = []
    delayed: list[Pass] = []
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            with WorkerGroup(url, processes=1, concurrency=c) as workers:
                workers.wait_ready(engine)
                for _ in repeats(o.repeat, f"flowq sleep({s:g}) and delay={s:g} P=1 C={c}"):
                    slept.append(_pass(engine, n, s, True))
                    delayed.append(_pass(engine, n, s, False))
        finally:
            engine.dispose()

    def fig(name: str, unit: str, passes: list[Pass], attr: str,
            higher: bool = False) -> Figure:
        return Figure(name, unit, [float(getattr(p, attr)) for p in passes], higher)

    ref = f"{n:,} no-op jobs enqueued with delay={s:g}"
    return [
        Row("sleep", fig(f"{n:,} runs of ctx.sleep({s:g}), wall to all done (P=1 C={c})",
                         "s", slept, "wall"),
            [fig(ref, "s", delayed, "wall"),
             Figure(f"the sleep itself, {s:g} s (ideal)", "s", [s] * len(slept), False)],
            note="enqueue commit to last finished_at; every run succeeded, attempts = 1"),
        Row("sleep", fig("wake-up lag p50 (second start - recorded deadline)", "ms", slept,
                         "lag_p50"),
            [fig(f"{ref}: start - run_at p50", "ms", delayed, "lag_p50")]),
        Row("sleep", fig("wake-up lag p99", "ms", slept, "lag_p99"),
            [fig(f"{ref}: start - run_at p99", "ms", delayed, "lag_p99")]),
        Row("sleep", fig("most runs asleep at once (sampled)", "runs", slept, "asleep", True),
            [fig(f"{ref}: most waiting at once", "runs", delayed, "asleep", True)],
            note=f"pending with run_at in the future, sampled every {SAMPLE_EVERY:g} s; "
                 f"{c} slots"),
    ]
