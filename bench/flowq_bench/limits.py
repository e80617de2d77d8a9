"""The queue-limit scenarios: `limit` (a global concurrency limit) and `rate` (a rate limit).

- `limit`: the drain's N no-op jobs, P worker processes of C slots, on `bench_limited`
  (declared with `concurrency=Options.queue_limit`, 50 by default) against the same drain on
  the unlimited `bench` queue, in the same database and run. While each drain runs, a thread
  counts the queue's `running` rows on a connection of its own, pausing `SAMPLE_EVERY`
  seconds between counts: each count is one snapshot, which is exactly what the limit
  promises (at most N `running` in any snapshot). A count above the limit raises
  `LimitExceeded`: the bench fails. A drain still running `Options.limit_timeout` seconds
  after its enqueue is cut there: its rate is the jobs done by then over that time, the
  backlog is deleted and the running jobs waited for.
- `rate`: `bench_rate` (declared with `rate_limit=flowq.Rate(Options.rate_limit, per=1s)`)
  with a backlog bigger than the window can start, drained by P x C for `Options.rate_window`
  seconds from the enqueue's commit, each window with a full bucket; then the backlog is
  deleted. Each claim is logged by a trigger (created in this scenario's database only) with
  the job's `locked_at`, the claim transaction's `now()`, which is the clock the token bucket
  itself uses. Reported: the starts per second after the first period (the steady rate)
  against the configured rate, over the whole window against the documented bound
  `limit x (T + 1)`, and the burst at the start (starts within `BURST_WINDOW` of the first
  one) against the bucket's size. Any span of the claims holding more starts than
  `limit x (1 + length / period)` raises `LimitExceeded`.

Both run the workers as deployed (`--poll-interval` 5 s), then again at `DIAGNOSTIC_POLL`
(the least `flowq worker` accepts) as a second reference: the claim loop claims again after
a claim that returned fewer jobs than it had free slots only on a NOTIFY or at its next poll,
so the difference between the two is what that wait costs a limited queue.

The limits reach the worker processes through the environment (`flowq_bench.app` reads it
at import), and the workers declare them in `flowq.queues` as any deployment does; the bench
checks the declared row before timing.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
import sqlalchemy as sa

from flowq_bench.app import LIMIT_ENV, LIMITED_QUEUE, RATE_ENV, RATE_QUEUE
from flowq_bench.drains import db_clock, engine_for, enqueue_runs, wait_drained
from flowq_bench.harness import BENCH_QUEUE, Server, WorkerGroup, conninfo, reset, wait_for
from flowq_bench.options import Options
from flowq_bench.report import Figure, Row

__all__ = ["LimitExceeded", "RunningSampler", "limit", "rate"]

SAMPLE_EVERY: Final = 0.005  # seconds between two counts of the running jobs
BURST_WINDOW: Final = 0.1  # periods after the first start that count as the burst
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


def _check_declared(engine: sa.Engine, queue: str, **expected: Any) -> None:
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


_DONE = sa.text("SELECT count(*) FROM flowq.jobs WHERE status = 'succeeded'")
_IDLE = sa.text("SELECT NOT EXISTS (SELECT 1 FROM flowq.jobs WHERE queue = :queue "
                "AND status IN ('pending', 'running'))")
_DROP_BACKLOG = sa.text("DELETE FROM flowq.jobs WHERE queue = :queue AND status = 'pending'")
_RUNNING_ANY = sa.text("SELECT EXISTS (SELECT 1 FROM flowq.jobs WHERE queue = :queue "
                       "AND status = 'running')")


def _no_running(engine: sa.Engine, queue: str) -> bool:
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
        c.execute(_DROP_BACKLOG, {"queue": queue})
    wait_for(lambda: _no_running(engine, queue), 60, "the capped drain's last jobs", 0.05)
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
            _check_declared(engine, queue, concurrency=limit)
        for _ in range(o.repeat):
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


# -- rate -------------------------------------------------------------------------------------

# Every claim of the scenario's database, stamped with the claim's `locked_at` (its
# transaction's now(), the token bucket's clock). Created in this scenario's database only.
_CLAIM_LOG: Final = (
    "CREATE TABLE bench_claims (job_id bigint NOT NULL, claimed_at timestamptz NOT NULL)",
    """CREATE FUNCTION bench_log_claim() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN
           INSERT INTO bench_claims (job_id, claimed_at) VALUES (NEW.id, NEW.locked_at);
           RETURN NULL;
       END $$""",
    """CREATE TRIGGER bench_log_claim AFTER UPDATE OF status ON flowq.jobs FOR EACH ROW
       WHEN (NEW.status = 'running' AND OLD.status IS DISTINCT FROM 'running')
       EXECUTE FUNCTION bench_log_claim()""",
)
# Seconds from :t0 (epoch), computed in numeric: exact to the microsecond the stamps hold.
_CLAIMS = sa.text("SELECT (extract(epoch FROM claimed_at) - CAST(:t0 AS numeric))::float8 "
                  "FROM bench_claims ORDER BY claimed_at")


@dataclass
class Window:
    """The starts of one rate window and what they mean. Times are seconds from the enqueue's
    commit (small numbers: the exact bound check would lose precision on epoch seconds)."""

    seconds: float  # window length
    per: float  # the rate's period
    limit: int  # starts per period
    starts: list[float]  # claim times, sorted, at most `seconds` (a claim may start before 0)

    @property
    def overall(self) -> float:
        return len(self.starts) / self.seconds

    @property
    def burst(self) -> int:
        if not self.starts:
            return 0
        return bisect.bisect_right(self.starts, self.starts[0] + BURST_WINDOW * self.per)

    @property
    def steady(self) -> float:
        """Starts per second after the first period (so without the bucket's burst)."""
        if not self.starts:
            return 0.0
        begin = self.starts[0] + self.per
        span = self.seconds - begin
        n = len(self.starts) - bisect.bisect_right(self.starts, begin)
        return n / span if span > 0 else float("nan")

    def busiest(self, length: float) -> int:
        """The most starts in any window of `length` seconds."""
        s = self.starts
        return max((bisect.bisect_right(s, t + length) - i for i, t in enumerate(s)), default=0)

    def gaps(self) -> float:
        """The longest time without a start, after the first one (or to the window's end)."""
        s = [*self.starts, self.seconds]
        return max((b - a for a, b in itertools.pairwise(s)), default=0.0)

    def check(self) -> None:
        """No window of starts holds more than the bucket allows: `limit` plus its refill,
        `limit x (1 + length / period)`. Exact over every pair (i, j) of starts, in one pass:
        j - i + 1 - limit x (s[j] - s[i]) / per <= limit, with the best j for each i taken
        from a running maximum of j - limit x s[j] / per from the end."""
        s, k = self.starts, self.limit / self.per
        best, best_j = float("-inf"), -1
        for i in range(len(s) - 1, -1, -1):
            g = i - k * s[i]
            if g > best:
                best, best_j = g, i
            excess = best - i + 1 + k * s[i]
            if excess > self.limit + 1e-6:
                n, length = best_j - i + 1, s[best_j] - s[i]
                raise LimitExceeded(
                    f"queue {RATE_QUEUE!r} has Rate({self.limit}, per={self.per:g}s), but {n} "
                    f"jobs started within {length:.6f}s (at most "
                    f"{self.limit * (1 + length / self.per):.4f} allowed)")


def _rate_window(engine: sa.Engine, o: Options) -> Window:
    """A backlog bigger than the window can start, drained for `o.rate_window` seconds from
    the enqueue's commit; then the backlog is deleted and the running jobs waited for."""
    per, r, seconds = 1.0, o.rate_limit, o.rate_window
    backlog = int(r * (seconds / per + 1) * 1.5) + 2 * o.processes * o.concurrency
    t0 = enqueue_runs(engine, "rated", backlog)
    left = t0 + seconds - db_clock(engine)
    if left > 0:
        time.sleep(left)
    wait_for(lambda: db_clock(engine) >= t0 + seconds, 10, "the window's end")
    with engine.begin() as c:
        c.execute(_DROP_BACKLOG, {"queue": RATE_QUEUE})
    wait_for(lambda: _no_running(engine, RATE_QUEUE), 60, "the window's last jobs", 0.05)
    with engine.connect() as c:
        starts = [float(t) for (t,) in c.execute(_CLAIMS, {"t0": t0})]
    return Window(seconds, per, r, [t for t in starts if t <= seconds])


def _rate_windows(url: str, engine: sa.Engine, o: Options, poll: float | None = None
                  ) -> list[Window]:
    """`o.repeat` windows of P x C workers serving the rate-limited queue only (at
    `--poll-interval poll`, if given), each starting with a full bucket; raises
    `LimitExceeded` if a window's starts break the bucket's bound."""
    windows = []
    extra = ("--poll-interval", f"{poll:g}") if poll is not None else ()
    with WorkerGroup(url, processes=o.processes, concurrency=o.concurrency,
                     queues=(RATE_QUEUE,), extra=extra,
                     env={RATE_ENV: str(o.rate_limit)}) as workers:
        workers.wait_ready(engine)
        _check_declared(engine, RATE_QUEUE, rate_limit=o.rate_limit, rate_period=1.0)
        for _ in range(o.repeat):
            time.sleep(1.2)  # idle for more than a period: the bucket is full
            reset(engine)
            with engine.begin() as c:
                c.execute(sa.text("TRUNCATE bench_claims"))
            window = _rate_window(engine, o)
            window.check()
            windows.append(window)
    return windows


def rate(server: Server, o: Options) -> list[Row]:
    r, seconds = o.rate_limit, o.rate_window
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            with engine.begin() as c:
                for ddl in _CLAIM_LOG:
                    c.execute(sa.text(ddl))
            ours = _rate_windows(url, engine, o)
            fast = _rate_windows(url, engine, o, poll=DIAGNOSTIC_POLL)
        finally:
            engine.dispose()
    pc = f"P={o.processes} C={o.concurrency}"
    k = len(ours)
    bound = r * (seconds + 1) / seconds
    diag = f"same, --poll-interval {DIAGNOSTIC_POLL:g}"

    def each(values: list[Any], fmt: str = "{}") -> str:
        return ", ".join(fmt.format(v) for v in values)

    return [
        Row("rate", Figure(f"starts/s after the 1st second, Rate({r}, per=1s) ({pc}, "
                           f"{seconds:g}s)", "starts/s", [w.steady for w in ours]),
            [Figure("configured rate", "starts/s", [float(r)] * k),
             Figure(diag, "starts/s", [w.steady for w in fast])],
            note=f"claims stamped by a trigger (locked_at); longest time without a start "
                 f"{each([w.gaps() for w in ours], '{:.2f}')} s "
                 f"(at --poll-interval {DIAGNOSTIC_POLL:g}: "
                 f"{each([w.gaps() for w in fast], '{:.2f}')} s); most starts in any 1 s "
                 f"{each([w.busiest(1.0) for w in ours])} "
                 f"({each([w.busiest(1.0) for w in fast])}; the bucket allows {2 * r})",
            extra={"starts": [len(w.starts) for w in ours],
                   "starts_fast_poll": [len(w.starts) for w in fast],
                   "busiest_1s": [w.busiest(1.0) for w in ours],
                   "busiest_1s_fast_poll": [w.busiest(1.0) for w in fast],
                   "longest_gap_s": [w.gaps() for w in ours],
                   "longest_gap_s_fast_poll": [w.gaps() for w in fast]}),
        Row("rate", Figure(f"starts/s over the {seconds:g}s window, burst included",
                           "starts/s", [w.overall for w in ours]),
            [Figure(f"documented bound {r} x (T + 1) / T", "starts/s", [bound] * k),
             Figure(diag, "starts/s", [w.overall for w in fast])]),
        Row("rate", Figure(f"burst: starts within {BURST_WINDOW * 1000:g} ms of the first",
                           "starts", [float(w.burst) for w in ours]),
            [Figure("bucket size (limit)", "starts", [float(r)] * k),
             Figure(diag, "starts", [float(w.burst) for w in fast])]),
    ]
