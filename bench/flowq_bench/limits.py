"""The `limit` scenario (a queue's global concurrency limit), and what it shares with `rate`.

`limit`: the drain's N no-op jobs, P worker processes of C slots, on `bench_limited`
(declared with `concurrency=Options.queue_limit`, 50 by default) against the same drain on
the unlimited `bench` queue, in the same database and run. While each drain runs, a thread
counts the queue's `running` rows on a connection of its own, pausing `SAMPLE_EVERY`
seconds between counts: each count is one snapshot, which is exactly what the limit
promises (at most N `running` in any snapshot). A count above the limit raises
`LimitExceeded`: the bench fails. A drain still running `Options.limit_timeout` seconds
after its enqueue is cut there: its rate is the jobs done by then over that time, the
backlog is deleted and the running jobs waited for.

It runs the workers as deployed (`--poll-interval` 5 s), then again at `DIAGNOSTIC_POLL`
(the least `flowq worker` accepts) as a second reference: the claim loop claims again after
a claim that returned fewer jobs than it had free slots only on a NOTIFY or at its next poll,
so the difference between the two is what that wait costs a limited queue.

The limits reach the worker processes through the environment (`flowq_bench.app` reads it
at import), and the workers declare them in `flowq.queues` as any deployment does; the bench
checks the declared row before timing (`check_declared`). `rate` (the `rate` module) uses the
same `LimitExceeded`, `DIAGNOSTIC_POLL`, `check_declared`, `DROP_BACKLOG` and `no_running`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
import sqlalchemy as sa

from flowq_bench.app import LIMIT_ENV, LIMITED_QUEUE
from flowq_bench.drains import db_clock, engine_for, enqueue_runs, wait_drained
from flowq_bench.harness import BENCH_QUEUE, Server, WorkerGroup, conninfo, reset, wait_for
from flowq_bench.options import Options
from flowq_bench.progress import repeats
from flowq_bench.report import Figure, Row

__all__ = ["DIAGNOSTIC_POLL", "DROP_BACKLOG", "LimitExceeded", "RunningSampler", "check_declared",
           "limit", "no_running"]

SAMPLE_EVERY: Final = 0.005  # seconds between two counts of the running jobs
# The diagnostic runs' --poll-interval (the least `flowq worker` accepts): how fast the limits
# let jobs through when the claim loop does not wait for its next poll.
DIAGNOSTIC_POLL: Final = 0.01
_RUNNING: Final = "SELECT count(*) FROM flowq.jobs WHERE queue = %s AND status = 'running'"
_DECLARED = sa.text("SELECT concurrency, rate_limit, rate_period FROM flowq.queues "
                    "WHERE name = :name")


class LimitExceeded(RuntimeError):
    """flowq admitted more than a queue's limit allows: the bench stops with the figures."""


# -- limit ------------------------------------------------------------------------------------

@dataclass
class Sampled:
    """What a `RunningSampler` saw: the count of each sample."""

    counts: Counter[int] = field(default_factory=Counter)

    @property
    def samples(self) -> int:
        return sum(self.counts.values())

    @property
    def max(self) -> int:
        return max(self.counts, default=0)

    @property
    def mean(self) -> float:
        total = self.samples
        return sum(k * c for k, c in self.counts.items()) / total if total else 0.0

    def share_at_least(self, n: int) -> float:
        """The fraction of samples that saw at least `n` running."""
        total = self.samples
        return sum(c for k, c in self.counts.items() if k >= n) / total if total else 0.0


class RunningSampler:
    """Counts `queue`'s running jobs every `every` seconds, in a thread and on a connection of
    its own (autocommit: each count is a fresh snapshot), from `__enter__` to `__exit__`."""

    def __init__(self, dsn: str, queue: str, every: float = SAMPLE_EVERY) -> None:
        self.dsn, self.queue, self.every = dsn, queue, every
        self.seen = Sampled()
        self._stop = threading.Event()
        self._conn: psycopg.Connection[Any] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def __enter__(self) -> RunningSampler:
        self._conn = psycopg.connect(self.dsn, autocommit=True,
                                     application_name="flowq-bench running sampler")
        self._conn.execute(_RUNNING, (self.queue,))  # plan and warm up outside the window
        self._thread = threading.Thread(target=self._run, name="flowq-bench-sampler",
                                        daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        assert self._conn is not None
        try:
            while not self._stop.is_set():
                row = self._conn.execute(_RUNNING, (self.queue,)).fetchone()
                self.seen.counts[int(row[0]) if row else 0] += 1
                self._stop.wait(self.every)
        except BaseException as exc:  # reported by __exit__: a dead sampler proves nothing
            self._error = exc

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        if self._error is not None:
            raise RuntimeError(f"the running-jobs sampler failed: {self._error!r}")


def check_declared(engine: sa.Engine, queue: str, **expected: Any) -> None:
    """The workers declared `queue` with the limits the bench asked for."""
    with engine.connect() as c:
        row = c.execute(_DECLARED, {"name": queue}).one_or_none()
    got = dict(row._mapping) if row is not None else {}
    wrong = {k: got.get(k) for k, v in expected.items() if got.get(k) != v}
    if wrong:
        raise RuntimeError(f"flowq.queues row of {queue!r} is {got or 'missing'}, expected "
                           f"{expected}")


@dataclass
class Drained:
    """One drain of the limit scenario: its rate, and whether it hit `Options.limit_timeout`."""

    rate: float  # jobs/s: N / elapsed, or the jobs done by the cap / the cap
    done: int
    capped: bool
    seen: Sampled


# Successes are in job_history (flowq.steps reads both); pending and running rows in jobs.
_DONE = sa.text("SELECT count(*) FROM flowq.steps WHERE status = 'succeeded'")
_IDLE = sa.text("SELECT NOT EXISTS (SELECT 1 FROM flowq.jobs WHERE queue = :queue "
                "AND status IN ('pending', 'running'))")
DROP_BACKLOG = sa.text("DELETE FROM flowq.jobs WHERE queue = :queue AND status = 'pending'")
_RUNNING_ANY = sa.text("SELECT EXISTS (SELECT 1 FROM flowq.jobs WHERE queue = :queue "
                       "AND status = 'running')")


def no_running(engine: sa.Engine, queue: str) -> bool:
    with engine.connect() as c:
        return not c.execute(_RUNNING_ANY, {"queue": queue}).scalar()


def _drain_or_cap(engine: sa.Engine, queue: str, n: int, t0: float, cap: float) -> Drained:
    """Wait for the drain; past `cap` seconds from `t0`, the rate so far (jobs done / cap),
    then the backlog is deleted and the running jobs waited for."""
    deadline = time.monotonic() + max(0.0, t0 + cap - db_clock(engine))
    while time.monotonic() < deadline:
        with engine.connect() as c:
            if c.execute(_IDLE, {"queue": queue}).scalar():
                return Drained(n / wait_drained(engine, n, t0), n, False, Sampled())
        time.sleep(0.1)
    with engine.connect() as c:
        end, done = db_clock(engine), int(c.execute(_DONE).scalar_one())
    with engine.begin() as c:
        c.execute(DROP_BACKLOG, {"queue": queue})
    wait_for(lambda: no_running(engine, queue), 60, "the capped drain's last jobs", 0.05)
    return Drained(done / (end - t0), done, True, Sampled())


def _sampled_drain(url: str, engine: sa.Engine, task: str, queue: str, o: Options,
                   limit: int | None, poll: float | None = None) -> list[Drained]:
    """`o.jobs` jobs of `task` drained `o.repeat` times by P x C workers serving `queue` only
    (at `--poll-interval poll`, if given), its running jobs sampled throughout, each drain
    cut at `o.limit_timeout` seconds; raises `LimitExceeded` past `limit`."""
    out = []
    extra = ("--poll-interval", f"{poll:g}") if poll is not None else ()
    with WorkerGroup(url, processes=o.processes, concurrency=o.concurrency, queues=(queue,),
                     extra=extra, env={LIMIT_ENV: str(o.queue_limit)}) as workers:
        workers.wait_ready(engine)
        if limit is not None:
            check_declared(engine, queue, concurrency=limit)
        for _ in repeats(o.repeat, f"flowq {task} on {queue}"):
            reset(engine)
            with RunningSampler(conninfo(url), queue) as sampler:
                t0 = enqueue_runs(engine, task, o.jobs)
                drained = _drain_or_cap(engine, queue, o.jobs, t0, o.limit_timeout)
            drained.seen = sampler.seen
            out.append(drained)
            if limit is not None and sampler.seen.max > limit:
                raise LimitExceeded(
                    f"queue {queue!r} has concurrency={limit}, but {sampler.seen.max} of its "
                    f"jobs were running at once (histogram of {sampler.seen.samples} samples: "
                    f"{dict(sorted(sampler.seen.counts.items()))})")
    return out


def _capped(runs: list[Drained], o: Options) -> str:
    cut = [r for r in runs if r.capped]
    if not cut:
        return ""
    return (f"; cut at {o.limit_timeout:g} s in {len(cut)} of {len(runs)} runs "
            f"({', '.join(f'{r.done:,}' for r in cut)} of {o.jobs:,} jobs done)")


def limit(server: Server, o: Options) -> list[Row]:
    n = o.queue_limit
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            free = _sampled_drain(url, engine, "noop", BENCH_QUEUE, o, None)
            ours = _sampled_drain(url, engine, "limited", LIMITED_QUEUE, o, n)
            fast = _sampled_drain(url, engine, "limited", LIMITED_QUEUE, o, n,
                                  poll=DIAGNOSTIC_POLL)
        finally:
            engine.dispose()
    pc = f"P={o.processes} C={o.concurrency}"
    slots = o.processes * o.concurrency

    def use(runs: list[Drained]) -> str:
        return (f"mean running {', '.join(f'{r.seen.mean:.1f}' for r in runs)} (at the limit "
                f"in {', '.join(f'{r.seen.share_at_least(n):.0%}' for r in runs)} of "
                f"{', '.join(str(r.seen.samples) for r in runs)} samples)")

    note = (f"target: >= 0.7x unlimited. Running jobs counted with {SAMPLE_EVERY * 1000:g} ms "
            f"pauses: {use(ours)}{_capped(ours, o)}; at --poll-interval {DIAGNOSTIC_POLL:g}: "
            f"{use(fast)}{_capped(fast, o)}; unlimited: peak "
            f"{', '.join(str(r.seen.max) for r in free)} running{_capped(free, o)}")
    if slots <= n:
        note += f" (P x C = {slots} slots: the limit of {n} cannot bind)"
    peaks = [float(max(a.seen.max, b.seen.max)) for a, b in zip(ours, fast, strict=True)]
    return [Row("limit", Figure(f"no-op jobs/s, concurrency={n} ({pc}, N={o.jobs})", "jobs/s",
                                [r.rate for r in ours]),
                [Figure("same drain, queue unlimited", "jobs/s", [r.rate for r in free]),
                 Figure(f"same limited drain, --poll-interval {DIAGNOSTIC_POLL:g}", "jobs/s",
                        [r.rate for r in fast])],
                note=note,
                extra={"limit": n, "histograms": [dict(sorted(r.seen.counts.items()))
                                                  for r in ours],
                       "histograms_fast_poll": [dict(sorted(r.seen.counts.items()))
                                                for r in fast],
                       "done": [r.done for r in ours], "capped": [r.capped for r in ours],
                       "unlimited_max_running": [r.seen.max for r in free]}),
            Row("limit", Figure("max running at once, limited queue (both drains)", "jobs",
                                peaks, False),
                [Figure(f"limit (concurrency={n})", "jobs", [float(n)] * len(peaks), False)],
                note="sampled from a separate connection; above the limit fails the bench")]
