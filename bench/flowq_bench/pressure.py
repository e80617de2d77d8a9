"""The `pressure` scenario: a steady load beside the things a busy application database does.

flowq lives in the application's database, which also runs reports, backups and forgotten
sessions: transactions that hold a snapshot open and keep vacuum from removing the row
versions flowq's claims and completions leave behind. One worker (P=1, C=`pressure_c`) is
offered `pressure_rate` no-op jobs per second by a fixed-rate producer (a batch every
`TICK` seconds in one transaction, so the producer itself keeps up at any rate), through
four phases of `pressure_phase` seconds each:

- `clean`: nothing else runs;
- `snapshot`: a REPEATABLE READ transaction is opened beside it (its snapshot taken by one
  read) and held to the end of the phase, as a report or `pg_dump` would;
- `recovery`: the snapshot is gone; the worker catches up with what piled up;
- `reader`: a loop scans a business table of `pressure_rows` rows, statement after statement.

Per phase: completions against what was offered (jobs finished in the phase's window, jobs
enqueued in it), pickup p50/p99 of the jobs enqueued in it (from the row's `created_at` to
its claim, `started_at`, both the database's clock: read from the job rows themselves, so the
handler does nothing and one worker's peak is not what is measured), the backlog at its end, the WAL written per completed job
(`pg_current_wal_insert_lsn()` at the phase's edges; the server's, so the producer's inserts
count too), and the dead tuples of `flowq.jobs` at its end (`pg_stat_user_tables`, updated
asynchronously: indicative). Each phase is reported beside the clean phase, the reference;
the backlog beside the jobs offered in the phase, the dead tuples beside those completed.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

import flowq
from flowq_bench.app import noop
from flowq_bench.drains import engine_for
from flowq_bench.harness import Server, WorkerGroup, wait_for
from flowq_bench.options import Options
from flowq_bench.progress import repeats
from flowq_bench.report import Figure, Row

__all__ = ["pressure"]

TICK: Final = 0.02  # seconds between the producer's batches
PHASES: Final = ("clean", "snapshot", "recovery", "reader")
DRAIN_TIMEOUT: Final = 600.0

_BUSINESS_DDL: Final = (
    "CREATE TABLE bench_business (id bigserial PRIMARY KEY, amount numeric NOT NULL, "
    "note text NOT NULL)",
    "INSERT INTO bench_business (amount, note) SELECT g % 1000, repeat('x', 80) "
    "FROM generate_series(1, :n) g",
    "ANALYZE bench_business",
)
_EDGE = sa.text("""SELECT pg_current_wal_insert_lsn()::text AS lsn,
    extract(epoch FROM clock_timestamp())::float8 AS at,
    (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'flowq.jobs'::regclass) AS dead,
    (SELECT count(*) FROM flowq.jobs WHERE status = 'pending') AS backlog""")
_WAL = sa.text("SELECT pg_wal_lsn_diff(CAST(:b AS pg_lsn), CAST(:a AS pg_lsn))::float8")
_FINISHED = sa.text("SELECT count(*) FROM flowq.jobs WHERE task = 'noop' AND "
                    "finished_at >= to_timestamp(:a) AND finished_at < to_timestamp(:b)")
# The jobs enqueued in a phase, and their pickups (created_at to the claim, in ms).
_ENQUEUED = sa.text("""SELECT count(*) AS n, percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (
        ORDER BY extract(epoch FROM started_at - created_at) * 1000) AS pickups
    FROM flowq.jobs WHERE task = 'noop'
     AND created_at >= to_timestamp(:a) AND created_at < to_timestamp(:b)""")
_LEFT = sa.text("SELECT count(*) FROM flowq.jobs WHERE status IN ('pending', 'running')")


@dataclass
class _Producer:
    """Offers `rate` no-op jobs per second until stopped."""

    engine: sa.Engine
    rate: float
    stop: threading.Event = field(default_factory=threading.Event)
    behind: float = 0.0  # the most the producer fell behind its schedule (s)

    def run(self) -> None:
        make = sessionmaker(self.engine, class_=flowq.Session)
        start, due = time.perf_counter(), 0.0
        while not self.stop.is_set():
            owed = int((time.perf_counter() - start) * self.rate - due)
            if owed > 0:
                with make.begin() as s:
                    s.enqueue_many(noop, [{"n": 0}] * owed)
                due += owed
            self.behind = max(self.behind, time.perf_counter() - start - due / self.rate)
            self.stop.wait(TICK)


@dataclass
class _Edge:
    lsn: str
    at: float
    dead: int
    backlog: int


def _edge(engine: sa.Engine) -> _Edge:
    with engine.connect() as c:
        r = c.execute(_EDGE).one()
    return _Edge(r.lsn, float(r.at), int(r.dead or 0), int(r.backlog))


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


@contextmanager
def _nothing(url: str) -> Any:
    yield


_BESIDE: Final = {"clean": _nothing, "snapshot": _snapshot, "recovery": _nothing,
                  "reader": _reader}


@dataclass
class _Phase:
    name: str
    offered: int = 0
    completed: int = 0
    p50: float = math.nan  # pickup of the jobs enqueued in the phase (ms)
    p99: float = math.nan
    backlog: int = 0
    wal_per_job: float = 0.0
    dead: int = 0


def _run_phases(url: str, engine: sa.Engine, o: Options) -> tuple[list[_Phase], float]:
    producer = _Producer(engine, o.pressure_rate)
    thread = threading.Thread(target=producer.run, daemon=True)
    edges = [_edge(engine)]
    thread.start()
    try:
        for i in repeats(len(PHASES), "pressure phase"):
            with _BESIDE[PHASES[i]](url):
                time.sleep(o.pressure_phase)
            edges.append(_edge(engine))
    finally:
        producer.stop.set()
        thread.join(timeout=30)
    wait_for(lambda: _left(engine) == 0, DRAIN_TIMEOUT, "the pressure backlog", 0.2)
    phases = []
    for i, name in enumerate(PHASES):
        a, b = edges[i], edges[i + 1]
        window = {"a": a.at, "b": b.at}
        with engine.connect() as c:
            completed = int(c.execute(_FINISHED, window).scalar_one())
            enqueued = c.execute(_ENQUEUED, window).one()
            wal = float(c.execute(_WAL, {"a": a.lsn, "b": b.lsn}).scalar_one())
        p50, p99 = enqueued.pickups or (math.nan, math.nan)
        phases.append(_Phase(name, offered=int(enqueued.n), completed=completed,
                             p50=float(p50), p99=float(p99), backlog=b.backlog,
                             wal_per_job=wal / max(1, completed), dead=b.dead))
    return phases, producer.behind


def _left(engine: sa.Engine) -> int:
    with engine.connect() as c:
        return int(c.execute(_LEFT).scalar_one())


def pressure(server: Server, o: Options) -> list[Row]:
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            with engine.begin() as c:
                for ddl in _BUSINESS_DDL:
                    c.execute(sa.text(ddl), {"n": o.pressure_rows})
            with WorkerGroup(url, processes=1, concurrency=o.pressure_c) as workers:
                workers.wait_ready(engine)
                phases, behind = _run_phases(url, engine, o)
        finally:
            engine.dispose()
    clean = phases[0]

    def row(p: _Phase, label: str, unit: str, value: float, higher: bool,
            ref: Figure) -> Row:
        return Row("pressure", Figure(f"{label}, {p.name}", unit, [value], higher), [ref])

    def beside_clean(p: _Phase, label: str, unit: str, value: float, ref: float,
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
            # The clean phase may end with none left: these are read beside the phase's load.
            row(p, "backlog at the end", "jobs", float(p.backlog), False,
                Figure(f"jobs offered, {p.name}", "jobs", [float(max(1, p.offered))])),
            row(p, "dead tuples of flowq.jobs at the end", "tuples", float(p.dead), False,
                Figure(f"jobs completed, {p.name}", "jobs", [float(max(1, p.completed))])),
        ]
    rows[0].note = (f"{o.pressure_rate:g} jobs/s offered to P=1 C={o.pressure_c}, "
                    f"{o.pressure_phase:g} s per phase ({', '.join(PHASES)}), a business "
                    f"table of {o.pressure_rows:,} rows; the producer fell behind its "
                    f"schedule by at most {behind:.2f} s")
    return rows
