"""The throughput scenarios: drain, drain-session, pipeline, dag, map, map-session and scale.

drain runs flowq at each of `Options.drain_cs` (C=16 and C=128 unless -c is given) beside
the same references, measured once: raw 1/tx and raw batched-100 on flowq.jobs, and raw
batched-100 on a minimal table of its own (`baselines.MINIMAL_DDL`). Each of those drains
also reports its WAL bytes per job (a row of its own) and its updates per job and HOT share
(the WAL row's note; every value in the first row's `extra.costs` in the JSON), and its CPU
per job, client and server (`cpu.cpu_rows`).

drain-session runs at `Options.session_c` (8 unless -c is given), not the drain's 128: each
running handler holds a ctx.session connection and commits its own transaction (see
`Options.session_concurrency`). It reports CPU per job too.

Each takes the `Server` and the `Options` and returns `Row`s; each runs in a database of its
own. flowq's figures come from real `flowq worker` processes (`WorkerGroup`), the references
from raw psycopg loops (`baselines`) with the same process count, in the same database.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Final

import sqlalchemy as sa

from flowq_bench import baselines
from flowq_bench.app import app as bench_app
from flowq_bench.cpu import cpu_rows
from flowq_bench.drains import (
    CALIBRATE_ROUNDS,
    DrainCost,
    db_clock,
    engine_for,
    enqueue_run,
    enqueue_runs,
    fastest_minimal,
    flowq_drain,
    flowq_drains,
    minimal_drains,
    raw_drain,
    raw_drains,
    wait_drained,
)
from flowq_bench.harness import BENCH_QUEUE, Server, WorkerGroup, conninfo, reset
from flowq_bench.options import Options
from flowq_bench.progress import repeats
from flowq_bench.report import Figure, Row, percentile

__all__ = ["checkpoint", "dag", "drain", "drain_session", "map_run", "map_session", "pipeline",
           "scale"]

PIPELINE_STEPS: Final = 3
# Rows of the one drain per minimal-table variant that picks the fastest.
CALIBRATE_JOBS: Final = 20_000
DAG_STEPS: Final = ("start", "left", "right", "join")


def _pc(o: Options) -> str:
    return f"P={o.processes} C={o.concurrency}"


def _cost_note(label: str, costs: list[DrainCost]) -> str:
    upd = statistics.median(c.updates_per_row for c in costs)
    hot = statistics.median(c.hot_pct for c in costs)
    return f"{label} {upd:.2f} upd/job, {hot:.0f}% HOT"


def drain(server: Server, o: Options) -> list[Row]:
    p = o.processes
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            ours = {c: flowq_drains(url, engine, "noop", o.jobs, 1, p, c, o.repeat)
                    for c in o.drain_cs}
            # The minimal-table reference is the fastest of its variants on this server.
            fastest, variants = fastest_minimal(url, engine, min(o.jobs, CALIBRATE_JOBS), p)
            refs = {f"raw 1/tx P={p}":
                    raw_drains(url, engine, "one_per_tx", "noop", o.jobs, 1, p, o.repeat),
                    f"raw batched-100 P={p}":
                    raw_drains(url, engine, "batched", "noop", o.jobs, 1, p, o.repeat),
                    f"raw batched-100, minimal table ({fastest}) P={p}":
                    minimal_drains(url, engine, o.jobs, p, o.repeat, fastest)}
        finally:
            engine.dispose()

    def figures(unit: str, value: Callable[[DrainCost], float]) -> list[Figure]:
        return [Figure(name, unit, [value(d) for d in costs], unit == "jobs/s")
                for name, costs in refs.items()]

    costs = {"flowq": {f"C={c}": [d.as_dict() for d in v] for c, v in ours.items()},
             **{name: [d.as_dict() for d in v] for name, v in refs.items()}}
    rows = [Row("drain", Figure(f"no-op jobs/s (P={p} C={c}, N={o.jobs})", "jobs/s",
                                [d.rate for d in v]), figures("jobs/s", lambda d: d.rate),
                note="targets: >= 10x raw 1/tx and >= 0.6x raw batched-100" if i == 0 else "",
                extra={"costs": costs} if i == 0 else {})
            for i, (c, v) in enumerate(ours.items())]
    for i, (c, v) in enumerate(ours.items()):
        notes = [_cost_note(f"flowq C={c}", v)]
        if i == 0:
            notes += [_cost_note(name, r) for name, r in refs.items()]
            notes.append(f"minimal-table variants, best of {CALIBRATE_ROUNDS} drains of "
                         f"{min(o.jobs, CALIBRATE_JOBS):,} each: " + ", ".join(
                             f"{k} {r:,.0f} jobs/s" for k, r in variants.items()))
        rows.append(Row("drain", Figure(f"WAL bytes/job (P={p} C={c})", "B/job",
                                        [d.wal_per_row for d in v], False),
                        figures("B/job", lambda d: d.wal_per_row),
                        note="; ".join(notes) + (
                            " (pg_stat_user_tables of the drained table, flowq.jobs or the "
                            "minimal one: a finished row is deleted there and inserted into "
                            "flowq.job_history, never updated; WAL of the whole server, both "
                            "job tables' included, from t0 to the drain's end, after a "
                            "CHECKPOINT)"
                            if i == 0 else "")))
    for i, (c, v) in enumerate(ours.items()):
        rows += cpu_rows("drain", f"P={p} C={c}", v, refs, note=i == 0)
    return rows


def drain_session(server: Server, o: Options) -> list[Row]:
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            ours = flowq_drains(url, engine, "ledger", o.jobs, 1, o.processes, o.session_c,
                                o.repeat)
            one = raw_drains(url, engine, "one_per_tx_ledger", "ledger", o.jobs, 1,
                             o.processes, o.repeat)
        finally:
            engine.dispose()
    pc = f"P={o.processes} C={o.session_c}"
    ref = f"raw 1/tx + row P={o.processes}"
    return [Row("drain-session", Figure(f"ctx.session jobs/s ({pc})", "jobs/s",
                                        [d.rate for d in ours]),
                [Figure(ref, "jobs/s", [d.rate for d in one])],
                note="target: >= 1x raw 1/tx + row (one commit per job either way)"),
            *cpu_rows("drain-session", pc, ours, {ref: one})]


def checkpoint(server: Server, o: Options) -> list[Row]:
    """Jobs of ten checkpoints (each one ledger row committed with its fenced record) against
    a raw loop writing ten rows in ten transactions per job; at the session concurrency, as
    each checkpoint holds a connection for its commit."""
    from flowq_bench.app import CHECKPOINTS

    jobs = max(1, o.jobs // CHECKPOINTS)

    def check(engine: sa.Engine) -> None:  # every job wrote its rows once, either way
        _check_ledger(engine, jobs * CHECKPOINTS, jobs)

    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            ours = flowq_drain(url, engine, "checkpointed", jobs, 1, o.processes, o.session_c,
                               o.repeat, check)
            raw = raw_drain(url, engine, "ten_tx", "checkpointed", jobs, 1, o.processes,
                            o.repeat, check)
        finally:
            engine.dispose()
    pc = f"P={o.processes} C={o.session_c}"
    return [Row("checkpoint", Figure(f"jobs of {CHECKPOINTS} checkpoints/s ({pc})", "jobs/s",
                                     ours),
                [Figure(f"raw {CHECKPOINTS} rows in {CHECKPOINTS} tx P={o.processes}",
                        "jobs/s", raw)],
                note=f"{CHECKPOINTS} commits per job either way")]


def pipeline(server: Server, o: Options) -> list[Row]:
    runs = max(1, o.jobs // PIPELINE_STEPS)
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            ours = flowq_drain(url, engine, "steps", runs, PIPELINE_STEPS, o.processes,
                               o.concurrency, o.repeat)
            raw = raw_drain(url, engine, "pipeline", "steps", runs, PIPELINE_STEPS,
                            o.processes, o.repeat)
        finally:
            engine.dispose()
    return [Row("pipeline", Figure(f"3-step pipelines, steps/s ({_pc(o)})", "steps/s", ours),
                [Figure(f"raw batched-100 + next-step INSERT P={o.processes}", "steps/s",
                        raw)])]


# -- dag and map ------------------------------------------------------------------------------

# flowq.steps: a finished row is in flowq.job_history, a live one in flowq.jobs.
_STEP_COUNTS = sa.text("SELECT step, count(*) FILTER (WHERE status = 'succeeded') "
                       "FROM flowq.steps GROUP BY step")


def _check_steps(expected: dict[str, int]) -> Callable[[sa.Engine], None]:
    """A drain's check: exactly `expected[step]` rows of each step, all succeeded (a join
    created twice, or never, is a bug whichever side made it)."""

    def check(engine: sa.Engine) -> None:
        with engine.connect() as c:
            got = {str(step): int(n) for step, n in c.execute(_STEP_COUNTS)}
        if got != expected:
            raise RuntimeError(f"expected succeeded rows per step {expected}, got {got}")

    return check


def dag(server: Server, o: Options) -> list[Row]:
    """Diamond runs (start -> left, right -> join), all enqueued in one commit and drained."""
    runs = max(1, o.jobs // len(DAG_STEPS))
    check = _check_steps(dict.fromkeys(DAG_STEPS, runs))
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            ours = flowq_drain(url, engine, "dag", runs, len(DAG_STEPS), o.processes,
                               o.concurrency, o.repeat, check)
            raw = raw_drain(url, engine, "dag", "dag", runs, len(DAG_STEPS), o.processes,
                            o.repeat, check)
        finally:
            engine.dispose()
    ref = f"raw batched-100 + fork + join counter P={o.processes}"
    per_run = len(DAG_STEPS)
    return [Row("dag", Figure(f"diamond runs, steps/s ({_pc(o)}, {runs:,} runs)", "steps/s",
                              ours), [Figure(ref, "steps/s", raw)],
                note="start -> left, right -> join; join counter in flowq.joins"),
            Row("dag", Figure("diamond runs, runs/s", "runs/s", [v / per_run for v in ours]),
                [Figure(ref, "runs/s", [v / per_run for v in raw])])]


# finished_at is the start of the statement that completes the row, on either side (see
# baselines._MAP_SPLIT): for `split` before its N item rows are inserted, for an item after.
_MAP_PHASES = sa.text("""
    SELECT extract(epoch FROM max(finished_at) FILTER (WHERE step = 'split'))::float8,
           extract(epoch FROM min(finished_at) FILTER (WHERE step = 'work'))::float8,
           extract(epoch FROM max(finished_at) FILTER (WHERE step = 'work'))::float8,
           extract(epoch FROM max(finished_at) FILTER (WHERE step = 'gather'))::float8,
           (array_agg(result) FILTER (WHERE step = 'gather'))[1]
      FROM flowq.steps""")
_PHASES: Final = ("split", "fan-out", "items", "join")


def _map_phases(engine: sa.Engine, n: int, t0: float) -> list[float]:
    """Seconds from the enqueue to the write completing `split` (claim it, run it, build the
    N items), from there to the first item done (insert the N rows, commit, claim and run
    it), from there to the last item done, and from there to `gather` done (read the N
    results, run it); checks `gather` received N results."""
    check = _check_steps({"split": 1, "work": n, "gather": 1})
    check(engine)
    with engine.connect() as c:
        split, first, last, gathered, result = c.execute(_MAP_PHASES).one()
    if result != n:
        raise RuntimeError(f"gather received {result!r} results, not {n}")
    return [split - t0, first - split, last - first, gathered - last]


def _flowq_map(url: str, engine: sa.Engine, n: int, o: Options
               ) -> tuple[list[float], list[list[float]]]:
    rates, phases = [], []
    with WorkerGroup(url, processes=o.processes, concurrency=o.concurrency) as workers:
        workers.wait_ready(engine)
        for _ in range(o.repeat):
            reset(engine)
            t0 = enqueue_run(engine, "fan", n=n)
            rates.append(n / wait_drained(engine, n + 2, t0))
            phases.append(_map_phases(engine, n, t0))
    return rates, phases


def _raw_map(url: str, engine: sa.Engine, n: int, o: Options
             ) -> tuple[list[float], list[list[float]]]:
    rates, phases = [], []
    for _ in range(o.repeat):
        reset(engine)
        enqueue_run(engine, "fan", n=n)
        with baselines.run_loops("map", conninfo(url), o.processes) as loops:
            t0 = db_clock(engine)
            loops.go()
            loops.join()
        rates.append(n / wait_drained(engine, n + 2, t0))
        phases.append(_map_phases(engine, n, t0))
    return rates, phases


def _medians(phases: list[list[float]]) -> dict[str, float]:
    return {name: round(statistics.median(p[i] for p in phases), 4)
            for i, name in enumerate(_PHASES)}


def map_run(server: Server, o: Options) -> list[Row]:
    """One run mapping N no-op items: enqueue to `gather`'s success, items/s."""
    n = o.map_n
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            ours, our_phases = _flowq_map(url, engine, n, o)
            raw, raw_phases = _raw_map(url, engine, n, o)
        finally:
            engine.dispose()
    mine, theirs = _medians(our_phases), _medians(raw_phases)

    def fmt(d: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.3g} s" for k, v in d.items())

    return [Row("map", Figure(f"map of {n:,} items, items/s ({_pc(o)})", "items/s", ours),
                [Figure(f"raw bulk INSERT + batched-100 + counter P={o.processes}", "items/s",
                        raw)],
                note=f"enqueue to join done; median phases flowq: {fmt(mine)}; raw: "
                     f"{fmt(theirs)}",
                extra={"items": n, "phases_s": {"flowq": our_phases, "raw": raw_phases}})]


def map_session(server: Server, o: Options) -> list[Row]:
    """A map of N instances that each write one row through ctx.session (one commit per
    instance, each counting towards the join), beside the same N rows written by N plain
    `ledger` tasks, through the same worker processes: what the join's counting costs when
    instances complete one transaction each (issue 21: 0.29x, counted on one row)."""
    n = o.map_n
    check = _check_steps({"split": 1, "work": n, "gather": 1})
    pc = f"P={o.processes} C={o.session_c}"
    maps, tasks = [], []
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            with WorkerGroup(url, processes=o.processes, concurrency=o.session_c) as workers:
                workers.wait_ready(engine)
                for _ in repeats(o.repeat, f"map-session {pc}"):
                    reset(engine)
                    t0 = enqueue_run(engine, "fan", n=n, session=True)
                    maps.append(n / wait_drained(engine, n + 2, t0))
                    check(engine)
                    _check_ledger(engine, n)
                    reset(engine)
                    t0 = enqueue_runs(engine, "ledger", n)
                    tasks.append(n / wait_drained(engine, n, t0))
                    _check_ledger(engine, n)
        finally:
            engine.dispose()
    return [Row("map-session",
                Figure(f"map of {n:,} ctx.session instances, items/s ({pc})", "items/s", maps),
                [Figure(f"the same {n:,} rows as ledger tasks ({pc})", "jobs/s", tasks)],
                note="target: >= 0.8x the same jobs as plain tasks; a map of 64 items or more "
                     "counts its instances on shards of the join (flowq.join_shards)")]


def _check_ledger(engine: sa.Engine, n: int, jobs: int | None = None) -> None:
    """`n` rows in bench_ledger, of `jobs` distinct jobs (default: one row each)."""
    jobs = n if jobs is None else jobs
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT count(*), count(DISTINCT job_id) FROM bench_ledger")
                         ).one()
    if tuple(rows) != (n, jobs):
        raise RuntimeError(f"bench_ledger holds {tuple(rows)} rows (total, distinct), not "
                           f"{(n, jobs)}")


# -- scale ------------------------------------------------------------------------------------

# Finished rows are written where they live since revision 0018, flowq.job_history (retired
# when they finished), as the completions leave them; ids and run ids from flowq.jobs'
# sequences, as an enqueue draws them. job_history has no column defaults (LIKE jobs): every
# NOT NULL column is given.
_FILL_RETAINED = sa.text("""
    INSERT INTO flowq.job_history (id, run_id, task, step, step_index, queue, status, priority,
                                   attempts, max_attempts, args, result, cancel_requested,
                                   joined, run_at, created_at, finished_at, retired_at)
    SELECT nextval(pg_get_serial_sequence('flowq.jobs', 'id')), nextval('flowq.run_id_seq'),
           'noop', 'noop', 0, 'bench', 'succeeded', 0, 1, 10, jsonb_build_object('n', g),
           'null'::jsonb, false, false, now() - interval '2 hours', now() - interval '2 hours',
           now() - interval '1 hour', now() - interval '1 hour'
    FROM generate_series(1, :n) g""")
_FILL_PENDING = sa.text("""
    INSERT INTO flowq.jobs (task, step, queue, args)
    SELECT 'noop', 'noop', 'bench', jsonb_build_object('n', g) FROM generate_series(1, :n) g""")
_UNCLAIM = sa.text("""
    UPDATE flowq.jobs SET status = 'pending', attempts = 0, locked_by = NULL, locked_at = NULL,
           heartbeat_at = NULL WHERE status = 'running'""")


def _vacuum(engine: sa.Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(sa.text("VACUUM ANALYZE flowq.jobs"))
        c.execute(sa.text("VACUUM ANALYZE flowq.job_history"))


def _claim_rates(url: str, engine: sa.Engine, o: Options) -> tuple[list[float], list[float]]:
    """Jobs/s and p50 ms of the worker's own claim (`Worker.claim`, C at a time), per repeat."""
    from flowq.worker import Worker, WorkerConfig

    rates, p50s = [], []
    for _ in range(o.repeat):
        # The bench queue only, as before the app declared the limited queues (a claim
        # rotates over every queue it serves).
        w = Worker(bench_app, url, WorkerConfig(concurrency=o.concurrency, listen=False,
                                                queues=[BENCH_QUEUE]))
        try:
            w.claim(1)  # connect outside the window
            lat: list[float] = []
            claimed, start = 0, time.perf_counter()
            while claimed < o.claims:
                t = time.perf_counter()
                got = len(w.claim(o.concurrency))
                lat.append((time.perf_counter() - t) * 1000)
                if not got:
                    break
                claimed += got
            rates.append(claimed / (time.perf_counter() - start))
            p50s.append(percentile(lat, 50))
        finally:
            for e in w.engines.values():
                e.dispose()
        with engine.begin() as c:
            c.execute(_UNCLAIM)
        _vacuum(engine)
    return rates, p50s


def _claims_in(server: Server, o: Options, retained: int) -> tuple[list[float], list[float]]:
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            with engine.begin() as c:
                if retained:
                    c.execute(_FILL_RETAINED, {"n": retained})
                c.execute(_FILL_PENDING, {"n": o.pending})
            _vacuum(engine)
            return _claim_rates(url, engine, o)
        finally:
            engine.dispose()


def scale(server: Server, o: Options) -> list[Row]:
    fresh_rate, fresh_p50 = _claims_in(server, o, 0)
    big_rate, big_p50 = _claims_in(server, o, o.retained)
    rows = [
        Row("scale", Figure(f"claims/s, {o.retained:,} finished + {o.pending:,} pending",
                            "jobs/s", big_rate),
            [Figure(f"fresh table, {o.pending:,} pending", "jobs/s", fresh_rate)],
            note=f"Worker.claim({o.concurrency}) in a loop; target >= 0.8x fresh"),
        Row("scale", Figure("claim p50 latency, retained rows", "ms", big_p50, False),
            [Figure("fresh table", "ms", fresh_p50, False)]),
    ]
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            for p in o.scale_processes:
                ours = flowq_drain(url, engine, "noop", o.jobs, 1, p, o.concurrency, o.repeat)
                raw = raw_drain(url, engine, "batched", "noop", o.jobs, 1, p, o.repeat)
                rows.append(Row("scale", Figure(f"drain P={p} C={o.concurrency}", "jobs/s",
                                                ours),
                                [Figure(f"raw batched-100 P={p}", "jobs/s", raw)]))
        finally:
            engine.dispose()
    return rows
