"""The `rate` scenario: a rate-limited queue's achieved start rate, bound and burst.

`rate`: `bench_rate` (declared with `rate_limit=flowq.Rate(Options.rate_limit, per=1s)`)
with a backlog bigger than the window can start, drained by P x C for `Options.rate_window`
seconds from the enqueue's commit, each window with a full bucket; then the backlog is
deleted. Each claim is logged by a trigger (created in this scenario's database only) with
the job's `locked_at`, the claim transaction's `now()`, which is the clock the token bucket
itself uses. Reported: the starts per second after the first period (the steady rate)
against the configured rate, over the whole window against the documented bound
`limit x (T + 1)`, and the burst at the start (starts within `BURST_WINDOW` of the first
one) against the bucket's size. Any span of the claims holding more starts than
`limit x (1 + length / period)` raises `LimitExceeded`.

Like `limit`, it runs the workers as deployed (`--poll-interval` 5 s), then again at
`DIAGNOSTIC_POLL` (the least `flowq worker` accepts) as a second reference: the claim loop
claims again after a claim that returned fewer jobs than it had free slots only on a NOTIFY
or at its next poll, so the difference between the two is what that wait costs a
rate-limited queue.

The rate reaches the worker processes through the environment (`flowq_bench.app` reads it
at import), and the workers declare it in `flowq.queues` as any deployment does; the bench
checks the declared row before timing.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass
from typing import Any, Final

import sqlalchemy as sa

from flowq_bench.app import RATE_ENV, RATE_QUEUE
from flowq_bench.drains import db_clock, engine_for, enqueue_runs
from flowq_bench.harness import Server, WorkerGroup, reset, wait_for
from flowq_bench.limits import (
    DIAGNOSTIC_POLL,
    DROP_BACKLOG,
    LimitExceeded,
    check_declared,
    no_running,
)
from flowq_bench.options import Options
from flowq_bench.progress import repeats
from flowq_bench.report import Figure, Row

__all__ = ["Window", "rate"]

BURST_WINDOW: Final = 0.1  # periods after the first start that count as the burst


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
        c.execute(DROP_BACKLOG, {"queue": RATE_QUEUE})
    wait_for(lambda: no_running(engine, RATE_QUEUE), 60, "the window's last jobs", 0.05)
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
        check_declared(engine, RATE_QUEUE, rate_limit=o.rate_limit, rate_period=1.0)
        for _ in repeats(o.repeat, f"rate window of {o.rate_limit}/s"):
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
