"""The throughput scenarios: drain, drain-session, pipeline and scale.

drain-session runs at `Options.session_c` (8 unless -c is given), not the drain's 128: each
running handler holds a ctx.session connection and commits its own transaction (see
`Options.session_concurrency`).

Each takes the `Server` and the `Options` and returns `Row`s; each runs in a database of its
own. flowq's figures come from real `flowq worker` processes (`WorkerGroup`), the references
from raw psycopg loops (`baselines`) with the same process count, in the same database.
"""

from __future__ import annotations

import time
from typing import Final

import sqlalchemy as sa

from flowq.bench.app import app as bench_app
from flowq.bench.drains import engine_for, flowq_drain, raw_drain
from flowq.bench.harness import Server
from flowq.bench.options import Options
from flowq.bench.report import Figure, Row, percentile

__all__ = ["drain", "drain_session", "pipeline", "scale"]

PIPELINE_STEPS: Final = 3


def _pc(o: Options) -> str:
    return f"P={o.processes} C={o.concurrency}"


def drain(server: Server, o: Options) -> list[Row]:
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            ours = flowq_drain(url, engine, "noop", o.jobs, 1, o.processes, o.concurrency,
                               o.repeat)
            one = raw_drain(url, engine, "one_per_tx", "noop", o.jobs, 1, o.processes, o.repeat)
            batched = raw_drain(url, engine, "batched", "noop", o.jobs, 1, o.processes,
                                o.repeat)
        finally:
            engine.dispose()
    return [Row("drain", Figure(f"no-op jobs/s ({_pc(o)}, N={o.jobs})", "jobs/s", ours),
                [Figure(f"raw 1/tx P={o.processes}", "jobs/s", one),
                 Figure(f"raw batched-100 P={o.processes}", "jobs/s", batched)],
                note="targets: >= 10x raw 1/tx and >= 0.6x raw batched-100")]


def drain_session(server: Server, o: Options) -> list[Row]:
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            ours = flowq_drain(url, engine, "ledger", o.jobs, 1, o.processes, o.session_c,
                               o.repeat)
            one = raw_drain(url, engine, "one_per_tx_ledger", "ledger", o.jobs, 1,
                            o.processes, o.repeat)
        finally:
            engine.dispose()
    pc = f"P={o.processes} C={o.session_c}"
    return [Row("drain-session", Figure(f"ctx.session jobs/s ({pc})", "jobs/s", ours),
                [Figure(f"raw 1/tx + row P={o.processes}", "jobs/s", one)],
                note="target: >= 1x raw 1/tx + row (one commit per job either way)")]


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


# -- scale ------------------------------------------------------------------------------------

_FILL_RETAINED = sa.text("""
    INSERT INTO flowq.jobs (task, step, queue, status, attempts, args, result, run_at,
                            created_at, finished_at)
    SELECT 'noop', 'noop', 'bench', 'succeeded', 1, jsonb_build_object('n', g), 'null'::jsonb,
           now() - interval '2 hours', now() - interval '2 hours', now() - interval '1 hour'
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


def _claim_rates(url: str, engine: sa.Engine, o: Options) -> tuple[list[float], list[float]]:
    """Jobs/s and p50 ms of the worker's own claim (`Worker.claim`, C at a time), per repeat."""
    from flowq.worker import Worker, WorkerConfig

    rates, p50s = [], []
    for _ in range(o.repeat):
        w = Worker(bench_app, url, WorkerConfig(concurrency=o.concurrency, listen=False))
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
