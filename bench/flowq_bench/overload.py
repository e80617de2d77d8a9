"""The `overload` scenario: one worker offered less, as much as and more than it can do.

Graceful overload means that a worker offered more than its peak keeps completing at its
peak while pickup latency grows with the backlog, never a collapse, and that a producer in
the same process is not starved by it. Measured in three steps, in one fresh database:

1. **The peak**: the drain rate of one `flowq worker` (P=1, C=`overload_c`: 16, or `-c`) on
   `overload_peak_jobs` no-op jobs enqueued in one commit (`drains.wait_drained`, the
   drain scenario's clock), the best of `--repeat` drains: what slows a drain on a shared
   machine (another process on the cores) only ever lowers it, and a peak set too low
   would offer "2x" loads the worker can in fact keep up with.
2. **Its own process**: the fixed-rate producer of `flowq_bench.load` offers
   `overload_multiples` (0.5x, 1x, 2x, 4x) of that peak, `overload_phase` seconds each, to
   the same `flowq worker` process. Between phases the producer pauses until the backlog is
   gone, so each phase starts from an empty queue (a collapse cannot hide in the next
   phase's figures).
3. **The producer's process**: the same phases, the same offered rates, to the same worker
   run on threads of the bench's process (`harness.WorkerThread`), beside the producer's
   thread; the peak drain of that placement is measured too, beside the first.

4. **The reference**: the same producer feeding a raw loop instead of a worker
   (`baselines`' `steady`: batched-100 on `flowq.jobs` in one process, each statement on
   its own), offered 1x and 2x of that loop's own peak (measured the same way). On a
   machine whose cores the producer, the server and the consumer share, offering more
   takes capacity from whatever drains: the raw loop's 2x against 1x says how much of a
   fall is the machine's rather than flowq's.

Per phase (`load.PhaseFigures`, read from the job rows, as `pressure` reads them): offered/s
beside the rate asked (a starved producer shows there), completed/s beside offered/s
(completions / offered) and beside the peak (completions / peak), pickup p50/p99 of the jobs
offered in it beside the 0.5x phase's, and the backlog at its end beside the jobs offered.
Above 1x, pickup p99 is also shown beside the time the worker needs at its peak (its
placement's) to clear the backlog left at the phase's end: a job enqueued last waits about that long, so a ratio
near or below 1 is latency that grows with the backlog, and far above 1 a collapse. Last,
the issue's figures: completed/s at 2x against 1x (target >= 0.95x), per placement.
Every offered rate is capped at `MAX_RATE`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import sqlalchemy as sa

from flowq_bench import baselines
from flowq_bench.drains import engine_for, enqueue_runs, wait_drained
from flowq_bench.harness import Server, WorkerGroup, WorkerThread, conninfo, reset
from flowq_bench.load import Phase, PhaseFigures, run_phases
from flowq_bench.options import BOUNDS, Options
from flowq_bench.progress import repeats
from flowq_bench.report import Figure, Row

__all__ = ["MAX_RATE", "PLACEMENTS", "RAW", "RAW_LOOP", "RAW_MULTIPLES", "clearing_ms",
           "overload", "overload_rows", "plan"]

# The most the producer is asked for: what --pressure-rate accepts (a peak mis-measured on a
# tiny drain must not ask one thread for millions of jobs a second).
MAX_RATE: Final = BOUNDS["--pressure-rate"].high
PLACEMENTS: Final = ("own process", "producer's process")
# The reference: the raw loop the producer feeds in step 4, and what it is offered.
RAW: Final = "raw loop"
RAW_LOOP: Final = "steady"
RAW_MULTIPLES: Final = (1.0, 2.0)


def plan(peak: float, multiples: Sequence[float]) -> list[Phase]:
    """The phases offering each of `multiples` of `peak` jobs/s (at most `MAX_RATE`)."""
    return [Phase(f"{m:g}x", min(MAX_RATE, m * peak)) for m in multiples]


def _peak(engine: sa.Engine, n: int, repeat: int, what: str) -> list[float]:
    rates = []
    for _ in repeats(repeat, what):
        reset(engine)
        t0 = enqueue_runs(engine, "noop", n)
        rates.append(n / wait_drained(engine, n, t0))
    return rates


def overload(server: Server, o: Options) -> list[Row]:
    c, n = o.overload_c, o.overload_peak_jobs
    results: dict[str, list[PhaseFigures]] = {}
    behind: dict[str, float] = {}
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            with WorkerGroup(url, processes=1, concurrency=c) as workers:
                workers.wait_ready(engine)
                peaks = _peak(engine, n, o.repeat, f"overload: peak drain P=1 C={c}")
                phases = plan(max(peaks), o.overload_multiples)
                reset(engine)
                results[PLACEMENTS[0]], behind[PLACEMENTS[0]] = run_phases(
                    engine, phases, o.overload_phase, settle=True,
                    what=f"overload phase, worker in its {PLACEMENTS[0]}")
            reset(engine)
            with WorkerThread(url, concurrency=c) as thread:
                thread.wait_ready(engine)
                thread_peaks = _peak(engine, n, o.repeat,
                                     f"overload: peak drain, worker in the {PLACEMENTS[1]}")
                reset(engine)
                results[PLACEMENTS[1]], behind[PLACEMENTS[1]] = run_phases(
                    engine, phases, o.overload_phase, settle=True,
                    what=f"overload phase, worker in the {PLACEMENTS[1]}")
            reset(engine)
            with baselines.run_loops(RAW_LOOP, conninfo(url), 1) as loops:
                loops.go()
                raw_peaks = _peak(engine, n, o.repeat, f"overload: peak drain, {RAW}")
                reset(engine)
                raw_phases, behind[RAW] = run_phases(
                    engine, plan(max(raw_peaks), RAW_MULTIPLES), o.overload_phase,
                    settle=True, what=f"overload phase, {RAW}")
        finally:
            engine.dispose()
    rows = overload_rows(peaks, thread_peaks, results, (raw_peaks, raw_phases))
    rows[0].note = (f"P=1 C={c}, peak: the best of {len(peaks)} drains of {n:,} no-op jobs "
                    f"({', '.join(f'{r:,.0f}' for r in peaks)} jobs/s; in the producer's "
                    f"process {', '.join(f'{r:,.0f}' for r in thread_peaks)}); each offered load for "
                    f"{o.overload_phase:g} s from an empty queue; the producer fell behind "
                    "its schedule by at most "
                    + ", ".join(f"{behind[p]:.2f} s ({p})" for p in (*PLACEMENTS, RAW))
                    + f"; {RAW}: {', '.join(f'{r:,.0f}' for r in raw_peaks)} jobs/s, "
                    f"offered {', '.join(f'{m:g}x' for m in RAW_MULTIPLES)} of its best")
    rows[0].extra = {"peaks": {PLACEMENTS[0]: peaks, PLACEMENTS[1]: thread_peaks,
                               RAW: raw_peaks},
                     "phases": {p: [f.as_dict() for f in fs] for p, fs in
                                [*results.items(), (RAW, raw_phases)]},
                     "producer_behind_s": behind}
    return rows


def overload_rows(peaks: list[float], thread_peaks: list[float],
                  results: dict[str, list[PhaseFigures]],
                  raw: tuple[list[float], list[PhaseFigures]] | None = None) -> list[Row]:
    """The table's rows from the peak drains (jobs/s, the best of each placement's is its
    peak) and each placement's phases; with `raw` (the raw loop's peak drains and phases),
    the same figures of the reference, last."""
    peak = Figure(f"peak drain, worker in its {PLACEMENTS[0]}", "jobs/s", [max(peaks)])
    thread_peak = Figure(f"peak drain, worker in the {PLACEMENTS[1]}", "jobs/s",
                         [max(thread_peaks)])
    rows = [Row("overload", thread_peak, [peak])]
    for place, phases in results.items():
        own = place == PLACEMENTS[0]
        where = "own" if own else "in-process"
        # Offered loads are multiples of the first peak; this placement's own peak is the
        # rate it can clear a backlog at, and beside the first one where it differs.
        its_peak = peak if own else thread_peak
        peak_refs = [peak] if own else [peak, thread_peak]
        calm = phases[0]
        for p in phases:
            label = f"{p.name}, {where}"
            rows += [
                Row("overload", Figure(f"offered/s, {label}", "jobs/s", [p.offered_per_s]),
                    [Figure(f"asked, {p.name}", "jobs/s", [p.rate])]),
                Row("overload", Figure(f"completed/s, {label}", "jobs/s",
                                       [p.completed_per_s]),
                    [Figure(f"offered/s, {label}", "jobs/s", [p.offered_per_s]),
                     *peak_refs]),
            ]
            if p is not calm:
                rows.append(Row("overload", Figure(f"pickup p50, {label}", "ms", [p.p50],
                                                   False),
                                [Figure(f"pickup p50, {calm.name}, {where}", "ms",
                                        [calm.p50], False)]))
                refs = [Figure(f"pickup p99, {calm.name}, {where}", "ms", [calm.p99], False)]
                if p.rate > peak.median:
                    refs.append(Figure(f"backlog at the end / peak, {where}", "ms",
                                       [clearing_ms(p.backlog, its_peak.median)], False))
                rows.append(Row("overload", Figure(f"pickup p99, {label}", "ms", [p.p99],
                                                   False), refs))
            rows.append(Row("overload", Figure(f"backlog at the end, {label}", "jobs",
                                               [float(p.backlog)], False),
                            [Figure(f"jobs offered, {label}", "jobs",
                                    [float(max(1, p.offered))])]))
        by_name = {p.name: p for p in phases}
        if "1x" in by_name and "2x" in by_name:
            at1, at2 = by_name["1x"], by_name["2x"]
            rows.append(Row("overload", Figure(f"completed/s at 2x vs at 1x, {where}",
                                               "jobs/s", [at2.completed_per_s]),
                            [Figure(f"completed/s at 1x, {where}", "jobs/s",
                                    [at1.completed_per_s])],
                            note="target: >= 0.95x (no collapse past the peak)"))
    if raw is not None:
        rows += _raw_rows(peak, *raw)
    return rows


def _raw_rows(peak: Figure, raw_peaks: list[float], phases: list[PhaseFigures]) -> list[Row]:
    """The reference's rows: flowq's peak beside the raw loop's, and the raw loop's phases
    (completions beside what was offered and its peak; above 1x, pickup p99 beside 1x's
    and beside the time its peak needs to clear the backlog left), then its 2x against 1x."""
    raw_peak = Figure(f"peak drain, {RAW}", "jobs/s", [max(raw_peaks)])
    rows = [Row("overload", Figure(peak.name, peak.unit, peak.values), [raw_peak])]
    by_name = {p.name: p for p in phases}
    for p in phases:
        label = f"{p.name}, {RAW}"
        rows.append(Row("overload", Figure(f"completed/s, {label}", "jobs/s",
                                           [p.completed_per_s]),
                        [Figure(f"offered/s, {label}", "jobs/s", [p.offered_per_s]),
                         raw_peak]))
        if p.name != "1x" and "1x" in by_name:
            rows.append(Row("overload", Figure(f"pickup p99, {label}", "ms", [p.p99], False),
                            [Figure(f"pickup p99, 1x, {RAW}", "ms", [by_name["1x"].p99],
                                    False),
                             Figure(f"backlog at the end / peak, {RAW}", "ms",
                                    [clearing_ms(p.backlog, raw_peak.median)], False)]))
    if "1x" in by_name and "2x" in by_name:
        rows.append(Row("overload", Figure(f"completed/s at 2x vs at 1x, {RAW}", "jobs/s",
                                           [by_name["2x"].completed_per_s]),
                        [Figure(f"completed/s at 1x, {RAW}", "jobs/s",
                                [by_name["1x"].completed_per_s])],
                        note="the same producer feeding a raw loop: what offering twice "
                             "its peak costs on these cores, without flowq"))
    return rows


def clearing_ms(backlog: int, peak: float) -> float:
    """How long a worker draining at `peak` jobs/s takes to clear `backlog` jobs (ms); at
    least one job's worth, so that the figure it is the reference of has a finite ratio."""
    if not peak > 0 or not math.isfinite(peak):
        return math.nan
    return max(1, backlog) / peak * 1000.0
