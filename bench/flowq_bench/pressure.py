"""The `pressure` scenario: a steady load beside the things a busy application database does.

flowq lives in the application's database, which also runs reports, backups and forgotten
sessions: transactions that hold a snapshot open and keep vacuum from removing the row
versions flowq's claims and completions leave behind. One worker (P=1, C=`pressure_c`) is
offered `pressure_rate` no-op jobs per second by the fixed-rate producer of
`flowq_bench.load`, through four phases of `pressure_phase` seconds each, back to back:

- `clean`: nothing else runs;
- `snapshot`: a REPEATABLE READ transaction is opened beside it (its snapshot taken by one
  read) and held to the end of the phase, as a report or `pg_dump` would;
- `recovery`: the snapshot is gone; the worker catches up with what piled up;
- `reader`: a loop scans a business table of `pressure_rows` rows, statement after statement.

Per phase (`load.PhaseFigures`, read from the job rows): completions against what was
offered, pickup p50/p99 of the jobs enqueued in it, the backlog at its end, the WAL written
per completed job (the server's: both job tables and the rest), and at its end the dead
tuples and the size of each job table, named apart: `flowq.jobs` (the live rows) and
`flowq.job_history` (the finished ones, summed over its partitions). Each phase is reported
beside the clean phase, the reference; the backlog beside the jobs offered in the phase, the
dead tuples beside those completed, the sizes beside the clean phase's.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Final

import sqlalchemy as sa

from flowq_bench.drains import engine_for
from flowq_bench.harness import Server, WorkerGroup
from flowq_bench.load import Phase, PhaseFigures, nothing_beside, run_phases
from flowq_bench.options import Options
from flowq_bench.report import Figure, Row

__all__ = ["pressure"]

PHASES: Final = ("clean", "snapshot", "recovery", "reader")

_BUSINESS_DDL: Final = (
    "CREATE TABLE bench_business (id bigserial PRIMARY KEY, amount numeric NOT NULL, "
    "note text NOT NULL)",
    "INSERT INTO bench_business (amount, note) SELECT g % 1000, repeat('x', 80) "
    "FROM generate_series(1, :n) g",
    "ANALYZE bench_business",
)


@contextmanager
def _snapshot(url: str) -> Any:
    """A REPEATABLE READ transaction holding its snapshot until the block ends."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    conn = engine.connect().execution_options(isolation_level="REPEATABLE READ")
    try:
        conn.execute(sa.text("SELECT count(*) FROM bench_business"))  # takes the snapshot
        yield
    finally:
        conn.rollback()
        conn.close()
        engine.dispose()


@contextmanager
def _reader(url: str) -> Any:
    """A loop of full scans of the business table, until the block ends."""
    stop = threading.Event()
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)

    def scan() -> None:
        with engine.connect() as c:
            while not stop.is_set():
                c.execute(sa.text("SELECT sum(amount), count(DISTINCT note) FROM bench_business"))
                c.commit()

    thread = threading.Thread(target=scan, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)
        engine.dispose()


def _phases(url: str, o: Options) -> list[Phase]:
    beside = {"snapshot": lambda: _snapshot(url), "reader": lambda: _reader(url)}
    return [Phase(name, o.pressure_rate, beside.get(name, nothing_beside)) for name in PHASES]


def pressure(server: Server, o: Options) -> list[Row]:
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            with engine.begin() as c:
                for ddl in _BUSINESS_DDL:
                    c.execute(sa.text(ddl), {"n": o.pressure_rows})
            with WorkerGroup(url, processes=1, concurrency=o.pressure_c) as workers:
                workers.wait_ready(engine)
                phases, behind = run_phases(engine, _phases(url, o), o.pressure_phase,
                                            what="pressure phase")
        finally:
            engine.dispose()
    clean = phases[0]

    def row(p: PhaseFigures, label: str, unit: str, value: float, higher: bool,
            ref: Figure) -> Row:
        return Row("pressure", Figure(f"{label}, {p.name}", unit, [value], higher), [ref])

    def beside_clean(p: PhaseFigures, label: str, unit: str, value: float, ref: float,
                     higher: bool = False) -> Row:
        return row(p, label, unit, value, higher, Figure(f"{label}, clean", unit, [ref], higher))

    rows: list[Row] = []
    for p in phases[1:]:
        rows += [
            beside_clean(p, "completions / offered", "x", p.completed / max(1, p.offered),
                         clean.completed / max(1, clean.offered), higher=True),
            beside_clean(p, "pickup p50", "ms", p.p50, clean.p50),
            beside_clean(p, "pickup p99", "ms", p.p99, clean.p99),
            beside_clean(p, "WAL per completed job", "B/job", p.wal_per_job,
                         clean.wal_per_job),
            beside_clean(p, "size of flowq.jobs at the end", "MB", p.jobs_mb, clean.jobs_mb),
            beside_clean(p, "size of flowq.job_history at the end", "MB", p.history_mb,
                         clean.history_mb),
            # The clean phase may end with none left: these are read beside the phase's load.
            row(p, "backlog at the end", "jobs", float(p.backlog), False,
                Figure(f"jobs offered, {p.name}", "jobs", [float(max(1, p.offered))])),
            row(p, "dead tuples of flowq.jobs at the end", "tuples", float(p.dead), False,
                Figure(f"jobs completed, {p.name}", "jobs", [float(max(1, p.completed))])),
            row(p, "dead tuples of flowq.job_history at the end", "tuples",
                float(p.history_dead), False,
                Figure(f"jobs completed, {p.name}", "jobs", [float(max(1, p.completed))])),
        ]
    rows[0].note = (f"{o.pressure_rate:g} jobs/s offered to P=1 C={o.pressure_c}, "
                    f"{o.pressure_phase:g} s per phase ({', '.join(PHASES)}), a business "
                    f"table of {o.pressure_rows:,} rows; the producer fell behind its "
                    f"schedule by at most {behind:.2f} s")
    return rows
