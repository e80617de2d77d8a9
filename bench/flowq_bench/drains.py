"""Timing a drain: N jobs enqueued in one commit, consumed by flowq workers or by a raw loop.

The clock is the database's: t0 is `clock_timestamp()` read right after the enqueue commits
(flowq workers are already running and listening, so they wake at that commit) or right
before the raw loops are released; the end is `max(finished_at)`, which both flowq and the
raw loops set with `now()`. Process start-up is outside the window either way.

`flowq_drains`, `raw_drains` and `minimal_drains` also measure what a drain costs the server
(`DrainCost`): the WAL it wrote (`pg_current_wal_insert_lsn()` read with t0 and once the
drain is over, `pg_wal_lsn_diff`, per row; WAL is the cluster's, so anything else running on
the server is counted too), and the updates of the drained table and how many were HOT
(`pg_stat_user_tables`, whose counters arrive asynchronously: read once the connections that
made them are gone; for flowq, once per worker group, over all its repeats). Such
a drain starts with a CHECKPOINT before its rows are written (skipped where the role may not
run one), so that no full-page images fall into the window unless a checkpoint does.
They also measure the CPU each drained row cost (`flowq_bench.cpu`): the client's (the
`flowq worker` processes, or the raw loop processes), from before the enqueue (idle until it
commits) to the drain's end, and the local server's (every PostgreSQL process), from t0 to
the drain's end; None for a server not on this machine.
`minimal_drains` drains `baselines.MINIMAL_TABLE`, a minimal jobs table of its own, created
and dropped in the scenario's fresh database.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

import flowq
from flowq_bench import baselines
from flowq_bench.app import app as bench_app
from flowq_bench.cpu import ServerCpu, Window
from flowq_bench.harness import WorkerGroup, conninfo, own_database, reset, reset_table, wait_for
from flowq_bench.progress import repeats
from flowq_bench.tables import JOBS, STEPS

__all__ = [
    "Check",
    "DrainCost",
    "db_clock",
    "enqueue_run",
    "enqueue_runs",
    "fastest_minimal",
    "flowq_drain",
    "flowq_drains",
    "minimal_drains",
    "raw_drain",
    "raw_drains",
    "wait_drained",
]

Check = Callable[[sa.Engine], None]
"""Called after each timed drain (outside the window): raises if the rows are not as expected."""

DRAIN_TIMEOUT: Final = 1800.0

JOBS_TABLE: Final = JOBS
# Drains of each minimal-table variant when `fastest_minimal` picks the reference.
CALIBRATE_ROUNDS: Final = 2
# At most how long the server processes of finished loops or workers take to go.
EXIT_TIMEOUT: Final = 30.0
# application_name of the worker processes' connections and of the raw loops'.
FLOWQ_APPS: Final = "flowq %"
RAW_APPS: Final = "flowq-bench raw %"


def _busy(table: str) -> sa.TextClause:
    return sa.text(f"SELECT EXISTS (SELECT 1 FROM {table} WHERE status = 'pending') "
                   f"OR EXISTS (SELECT 1 FROM {table} WHERE status = 'running')")


def _tally(table: str) -> sa.TextClause:
    """Outcomes of `table`'s rows; flowq's in `flowq.steps`, where the finished ones are."""
    table = STEPS if table == JOBS_TABLE else table
    return sa.text("SELECT count(*) FILTER (WHERE status = 'succeeded') AS ok, "
                   "count(*) AS total, extract(epoch FROM max(finished_at))::float8 AS last "
                   f"FROM {table}")


# Both in one statement, so that the WAL position belongs to the same instant as t0. The
# insert position, not pg_current_wal_lsn() (the write position), which lags behind WAL
# still in the server's buffers (synchronous_commit = off).
_MARK = sa.text("SELECT extract(epoch FROM clock_timestamp())::float8, "
                "pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::float8")
_GONE = sa.text("SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = "
                "current_database() AND application_name LIKE :apps)")
_UPDATES = sa.text("SELECT coalesce(n_tup_upd, 0), coalesce(n_tup_hot_upd, 0) "
                   "FROM pg_stat_user_tables WHERE relid = to_regclass(:table)")


def db_clock(engine: sa.Engine) -> float:
    with engine.connect() as c:
        return float(c.execute(sa.text(
            "SELECT extract(epoch FROM clock_timestamp())::float8")).scalar_one())


def enqueue_runs(engine: sa.Engine, task: str, n: int,
                 clock: Callable[[sa.Engine], float] = db_clock) -> float:
    """Enqueue `n` runs of `task` in one transaction with enqueue_many; the DB clock after
    (read by `clock`)."""
    definition = bench_app.get(task)  # the object, not the name: its queue and first step
    assert definition is not None, task
    make = sessionmaker(engine, class_=flowq.Session)
    with make.begin() as s:
        s.enqueue_many(definition, [{"n": i} for i in range(n)])
    return clock(engine)


def enqueue_run(engine: sa.Engine, task: str, **args: Any) -> float:
    """Enqueue one run of `task` with `args` in a transaction of its own; the DB clock after."""
    definition = bench_app.get(task)
    assert definition is not None, task
    make = sessionmaker(engine, class_=flowq.Session)
    with make.begin() as s:
        s.enqueue(definition, **args)
    return db_clock(engine)


def wait_drained(engine: sa.Engine, expected: int, t0: float, table: str = JOBS_TABLE
                 ) -> float:
    """Wait until nothing is pending or running in `table` (flowq.jobs, or the minimal
    table), at most `DRAIN_TIMEOUT`; the elapsed seconds from `t0` to the last completion.
    Raises if fewer than `expected` rows succeeded (flowq's counted in `flowq.steps`: a
    finished row has left flowq.jobs for flowq.job_history)."""
    busy = _busy(table)

    def idle() -> bool:
        with engine.connect() as c:
            return not c.execute(busy).scalar()

    wait_for(idle, DRAIN_TIMEOUT, "the drain", interval=0.1)
    with engine.connect() as c:
        tally = c.execute(_tally(table)).one()
    if tally.ok < expected:
        raise RuntimeError(f"drain ended with {tally.ok} of {expected} jobs succeeded "
                           f"({tally.total} rows)")
    return max(1e-6, float(tally.last) - t0)


@dataclass
class DrainCost:
    """One timed drain: its rate, and what it cost the server per row drained."""

    rate: float              # rows per second
    wal_per_row: float       # WAL bytes written in the window, per row
    updates_per_row: float   # updates of the drained table (pg_stat_user_tables), per row
    hot_pct: float           # of those, the HOT ones (no index entry written), in %
    client_us: float | None = None  # CPU of the client processes, µs per row
    server_us: float | None = None  # CPU of the server's processes, µs per row (None: remote)

    def as_dict(self) -> dict[str, float | None]:
        return {"rate": self.rate, "wal_bytes_per_row": self.wal_per_row,
                "updates_per_row": self.updates_per_row, "hot_pct": self.hot_pct,
                "client_cpu_us_per_row": self.client_us,
                "server_cpu_us_per_row": self.server_us}

    def set_cpu(self, window: Window, rows: int) -> None:
        self.client_us, self.server_us = window.per_job_us(rows)


def _mark(engine: sa.Engine) -> tuple[float, float]:
    """The database clock (epoch seconds) and the WAL insert position (bytes), together."""
    with engine.connect() as c:
        clock, lsn = c.execute(_MARK).one()
    return float(clock), float(lsn)


def _checkpoint(engine: sa.Engine) -> None:
    """CHECKPOINT, where the role may (superuser, or pg_checkpoint on PostgreSQL 15+)."""
    with contextlib.suppress(sa.exc.DBAPIError), \
            engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(sa.text("CHECKPOINT"))


def _updates(engine: sa.Engine, table: str, apps: str | None = None) -> tuple[int, int]:
    """`table`'s (n_tup_upd, n_tup_hot_upd), once no connection named like `apps` is left.

    Backends report their counters to the statistics system asynchronously: an idle one at
    most once a second, and its last ones up to 10 s later (PostgreSQL 15+), but always as it
    exits, before it leaves pg_stat_activity. pg_stat_force_next_flush() would flush only the
    calling backend's, and the updates are other backends'. So the counters after a drain are
    read once the processes that made them have disconnected and their server processes are
    gone: then they are complete."""
    if apps is not None:
        def gone() -> bool:
            with engine.connect() as c:
                return bool(c.execute(_GONE, {"apps": apps}).scalar())

        wait_for(gone, EXIT_TIMEOUT, "the drain's connections to close", interval=0.02)
    with engine.connect() as c:  # a transaction of its own: a fresh stats snapshot
        row = c.execute(_UPDATES, {"table": table}).one_or_none()
    return (0, 0) if row is None else (int(row[0]), int(row[1]))


def _set_updates(costs: list[DrainCost], rows: int, before: tuple[int, int],
                 after: tuple[int, int]) -> None:
    upd, hot = after[0] - before[0], after[1] - before[1]
    for c in costs:
        c.updates_per_row = upd / rows
        c.hot_pct = 100.0 * hot / upd if upd else 0.0


@contextlib.contextmanager
def _wal(engine: sa.Engine, rows: int, out: list[DrainCost]) -> Iterator[Callable[[], float]]:
    """Around one timed drain of `rows` rows still to be written: a CHECKPOINT first; the
    body calls the yielded `start()` for its t0 (the database clock, read with the WAL
    position) and sets the rate of the DrainCost appended to `out` once the block is over,
    with the WAL written from t0 to then, per row."""
    _checkpoint(engine)
    marks: list[float] = []

    def start() -> float:
        clock, lsn = _mark(engine)
        marks.append(lsn)
        return clock

    yield start
    _, end = _mark(engine)
    out.append(DrainCost(rate=0.0, wal_per_row=max(0.0, end - marks[0]) / rows,
                         updates_per_row=0.0, hot_pct=0.0))


def flowq_drains(url: str, engine: sa.Engine, task: str, runs: int, rows_per_run: int,
                 processes: int, concurrency: int, repeat: int, check: Check | None = None
                 ) -> list[DrainCost]:
    """Rate and WAL of each repeat, through real `flowq worker` processes; the updates per
    row and HOT share are the whole group's (counted from its start to its processes' exit,
    see `_updates`), the same in each repeat's DrainCost."""
    out: list[DrainCost] = []
    n = runs * rows_per_run
    before = _updates(engine, JOBS_TABLE)
    server = ServerCpu.find(engine)
    with WorkerGroup(url, processes=processes, concurrency=concurrency) as workers:
        workers.wait_ready(engine)
        for _ in repeats(repeat, f"flowq {task} P={processes} C={concurrency}"):
            reset(engine)
            cpu = Window(server)
            with _wal(engine, n, out) as start:
                cpu.start_client(workers.group_pids())

                def begin(_: sa.Engine, cpu: Window = cpu,
                          start: Callable[[], float] = start) -> float:
                    cpu.start_server()
                    return start()

                # t0 and the WAL position right after the commit the workers wake at.
                t0 = enqueue_runs(engine, task, runs, clock=begin)
                elapsed = wait_drained(engine, n, t0)
                cpu.stop_client()
                cpu.stop_server()
            out[-1].rate = n / elapsed
            out[-1].set_cpu(cpu, n)
            if check is not None:
                check(engine)
    _set_updates(out, n * repeat, before, _updates(engine, JOBS_TABLE, FLOWQ_APPS))
    return out


def flowq_drain(url: str, engine: sa.Engine, task: str, runs: int, rows_per_run: int,
                processes: int, concurrency: int, repeat: int, check: Check | None = None
                ) -> list[float]:
    """Rows per second through real `flowq worker` processes, once per repeat."""
    rates = []
    with WorkerGroup(url, processes=processes, concurrency=concurrency) as workers:
        workers.wait_ready(engine)
        for _ in repeats(repeat, f"flowq {task} P={processes} C={concurrency}"):
            reset(engine)
            t0 = enqueue_runs(engine, task, runs)
            rates.append(runs * rows_per_run / wait_drained(engine, runs * rows_per_run, t0))
            if check is not None:
                check(engine)
    return rates


def raw_drains(url: str, engine: sa.Engine, kind: str, task: str, runs: int, rows_per_run: int,
               processes: int, repeat: int, check: Check | None = None) -> list[DrainCost]:
    """Rate and cost of each repeat, through P raw psycopg loops of `kind` on flowq.jobs."""
    out: list[DrainCost] = []
    n = runs * rows_per_run
    server = ServerCpu.find(engine)
    for _ in repeats(repeat, f"raw {kind} {task} P={processes}"):
        reset(engine)
        before = _updates(engine, JOBS_TABLE)
        cpu = Window(server)
        with _wal(engine, n, out) as start:
            enqueue_runs(engine, task, runs)
            with baselines.run_loops(kind, conninfo(url), processes) as loops:
                t0 = _go(loops, start, cpu)
            elapsed = wait_drained(engine, n, t0)
            cpu.stop_server()
        out[-1].rate = n / elapsed
        out[-1].set_cpu(cpu, n)
        _set_updates(out[-1:], n, before, _updates(engine, JOBS_TABLE, RAW_APPS))
        if check is not None:
            check(engine)
    return out


def _go(loops: baselines.RawLoops, start: Callable[[], float], cpu: Window) -> float:
    """Release the connected raw loops and wait for them; t0 (from `start()`). Their CPU is
    read around it, the client's before they are reaped."""
    cpu.start_client(p.pid for p in loops.procs if p.pid is not None)
    t0 = start()
    cpu.start_server()
    loops.go()
    loops.join(finished=cpu.stop_client)
    return t0


def raw_drain(url: str, engine: sa.Engine, kind: str, task: str, runs: int, rows_per_run: int,
              processes: int, repeat: int, check: Check | None = None) -> list[float]:
    """Rows per second through P raw psycopg loops of `kind`, once per repeat."""
    rates = []
    for _ in repeats(repeat, f"raw {kind} {task} P={processes}"):
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


_MINIMAL_FILL = sa.text(f"INSERT INTO {baselines.MINIMAL_TABLE} (payload) "
                        "SELECT jsonb_build_object('n', g) FROM generate_series(0, :n - 1) g")


def fastest_minimal(url: str, engine: sa.Engine, n: int, processes: int,
                    rounds: int = CALIBRATE_ROUNDS) -> tuple[str, dict[str, float]]:
    """Which of `baselines.MINIMAL_VARIANTS` drains fastest here, and every variant's rate:
    the reference is the fastest honest loop. Each variant drains `n` rows `rounds` times,
    the variants in turn (the order reversed every other round, so that drift and a
    neighbour's load do not always fall on the same one), and keeps its best."""
    rates: dict[str, float] = {}
    for r in range(rounds):
        order = baselines.MINIMAL_VARIANTS[::-1 if r % 2 else 1]
        for kind in order:
            rate = minimal_drains(url, engine, n, processes, 1, kind)[0].rate
            rates[kind] = max(rate, rates.get(kind, 0.0))
    rates = {kind: rates[kind] for kind in baselines.MINIMAL_VARIANTS}
    return max(rates, key=rates.__getitem__), rates


def minimal_drains(url: str, engine: sa.Engine, n: int, processes: int, repeat: int,
                   kind: str = baselines.MINIMAL_REFERENCE) -> list[DrainCost]:
    """Rate and cost of each repeat of P `kind` loops (one of `baselines.MINIMAL_VARIANTS`)
    draining `n` rows of the minimal table, created for this (in a database `fresh_database`
    made) and dropped after. Its rows are written in one commit, like enqueue_many's, by one
    INSERT … SELECT."""
    with engine.begin() as c:
        own_database(c)
        for ddl in baselines.MINIMAL_DDL:
            c.execute(sa.text(ddl))
    out: list[DrainCost] = []
    server = ServerCpu.find(engine)
    try:
        for _ in repeats(repeat, f"raw minimal table P={processes}"):
            reset_table(engine, baselines.MINIMAL_TABLE)
            before = _updates(engine, baselines.MINIMAL_TABLE)
            cpu = Window(server)
            with _wal(engine, n, out) as start:
                with engine.begin() as c:
                    c.execute(_MINIMAL_FILL, {"n": n})
                with baselines.run_loops(kind, conninfo(url), processes) as loops:
                    t0 = _go(loops, start, cpu)
                elapsed = wait_drained(engine, n, t0, baselines.MINIMAL_TABLE)
                cpu.stop_server()
            out[-1].rate = n / elapsed
            out[-1].set_cpu(cpu, n)
            _set_updates(out[-1:], n, before,
                         _updates(engine, baselines.MINIMAL_TABLE, RAW_APPS))
    finally:
        with engine.begin() as c:
            own_database(c)
            c.execute(sa.text(f"DROP TABLE IF EXISTS {baselines.MINIMAL_TABLE}"))
    return out


def engine_for(url: str, **kw: Any) -> sa.Engine:
    return sa.create_engine(url, pool_size=4, **kw)
