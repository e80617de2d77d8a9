"""The producer-side scenarios: enqueue (per transaction and bulk), latency, and soak.

- enqueue: business transactions (one ORM insert, `sessionmaker(class_=flowq.Session)`), with
  and without `session.enqueue`, alternated in blocks so drift hits both; single enqueues,
  one per transaction on a SQLAlchemy `Connection`, against a raw psycopg INSERT of the same
  row with `pg_notify` in the same statement (alternated the same way), with the round trips
  and bytes on the wire of one of each (libpq's protocol trace); and a bulk `enqueue_many`
  against a raw `INSERT … SELECT unnest(…)` of the same rows.
- latency: one idle worker; jobs enqueued one per transaction at a steady rate; the handler
  stamps `time.time()` when it starts, the producer notes it right after its commit returns.
  References: a raw LISTEN + claim loop stamping the same way as soon as its claim returns,
  and the same loop stamping once its claim has committed (as flowq's handler starts).
- soak: a steady producer for `duration` with the pruner on (short retention); the size and
  dead tuples of each job table (`flowq.jobs`, and `flowq.job_history` over its partitions)
  and p99 pickup latency sampled over time, first half against second half.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import psycopg
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

import flowq
from flowq_bench import baselines
from flowq_bench.app import noop, stamp
from flowq_bench.drains import engine_for
from flowq_bench.harness import Server, WorkerGroup, conninfo, reset, wait_for
from flowq_bench.options import Options
from flowq_bench.progress import repeats
from flowq_bench.report import Figure, Row, percentile
from flowq_bench.tables import HISTORY, HISTORY_DEAD, HISTORY_SIZE, JOBS, JOBS_DEAD, JOBS_SIZE

__all__ = ["enqueue", "latency", "soak"]

BLOCK = 50


class _Base(DeclarativeBase):
    pass


class BenchOrder(_Base):
    __tablename__ = "bench_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str]


# -- enqueue ----------------------------------------------------------------------------------

def _transactions(make: sessionmaker[flowq.Session], n: int) -> tuple[float, float]:
    """Seconds spent in `n` transactions with an enqueue and `n` without, interleaved."""
    spent = [0.0, 0.0]
    done = 0
    while done < n:
        block = min(BLOCK, n - done)
        for with_job in (True, False):
            t = time.perf_counter()
            for i in range(block):
                with make.begin() as s:
                    s.add(BenchOrder(item=f"order {done + i}"))
                    if with_job:
                        s.enqueue(noop, n=done + i)
            spent[0 if with_job else 1] += time.perf_counter() - t
        done += block
    return spent[0], spent[1]


_RAW_BULK = """INSERT INTO flowq.jobs (task, step, queue, max_attempts, args)
    SELECT 'noop', 'noop', 'bench', 10, a FROM unnest(%s::jsonb[]) AS a"""


def _bulk(engine: sa.Engine, dsn: str, n: int) -> tuple[float, float]:
    make = sessionmaker(engine, class_=flowq.Session)
    reset(engine)
    t = time.perf_counter()
    with make.begin() as s:
        s.enqueue_many(noop, [{"n": i} for i in range(n)])
    ours = n / (time.perf_counter() - t)
    reset(engine)
    with psycopg.connect(dsn) as conn:
        t = time.perf_counter()
        with conn.transaction():
            conn.execute(_RAW_BULK, ([json.dumps({"n": i}) for i in range(n)],))
        raw = n / (time.perf_counter() - t)
    return ours, raw


# The row `flowq.enqueue(noop, n=...)` writes, by hand: the fastest honest single enqueue.
_RAW_SINGLE = """INSERT INTO flowq.jobs (task, step, queue, max_attempts, args)
    VALUES ('noop', 'noop', 'bench', 10, %s::jsonb)
    RETURNING id, run_id, pg_notify('flowq', 'bench')"""


def _singles(engine: sa.Engine, raw: psycopg.Connection[Any], n: int) -> tuple[float, float]:
    """Seconds spent in `n` transactions of one `flowq.enqueue` on a Connection and `n` of
    the raw INSERT + NOTIFY, interleaved in blocks."""
    spent = [0.0, 0.0]
    done = 0
    while done < n:
        block = min(BLOCK, n - done)
        t = time.perf_counter()
        for i in range(block):
            with engine.begin() as c:
                flowq.enqueue(c, noop, n=done + i)
        spent[0] += time.perf_counter() - t
        t = time.perf_counter()
        for i in range(block):
            with raw.transaction():
                raw.execute(_RAW_SINGLE, (json.dumps({"n": done + i}),)).fetchone()
        spent[1] += time.perf_counter() - t
        done += block
    return spent[0], spent[1]


def _wire(conn: psycopg.Connection[Any], call: Callable[[], object]) -> tuple[int, int]:
    """Round trips (turns from client to server) and bytes both ways of one `call` on
    `conn`, read from libpq's protocol trace."""
    with tempfile.TemporaryFile("w+") as f:
        conn.pgconn.trace(f.fileno())
        try:
            call()
        finally:
            conn.pgconn.untrace()
        f.seek(0)
        trips = size = 0
        last = ""
        for line in f:
            parts = line.split("\t")  # timestamp, F/B, length, message (statements span lines)
            if len(parts) < 4 or parts[1] not in ("F", "B") or not parts[2].isdigit():
                continue
            size += int(parts[2]) + 1  # and the type byte
            trips += parts[1] == "F" and last != "F"
            last = parts[1]
    return trips, size


def _wire_rows(engine: sa.Engine, make: sessionmaker[flowq.Session],
               raw: psycopg.Connection[Any]) -> dict[str, tuple[int, int]]:
    """(round trips, bytes) per transaction of each case, on a warm connection (psycopg
    prepares a statement on its 5th use): the enqueue's cost is the difference."""
    def orm(job: bool) -> None:
        with make.begin() as s:
            s.add(BenchOrder(item="order"))
            if job:
                s.enqueue(noop, n=0)

    def single() -> None:
        with engine.begin() as c:
            flowq.enqueue(c, noop, n=0)

    def by_hand() -> None:
        with raw.transaction():
            raw.execute(_RAW_SINGLE, (json.dumps({"n": 0}),)).fetchone()

    cases: dict[str, Callable[[], None]] = {
        "ORM insert alone": lambda: orm(False), "ORM insert + session.enqueue": lambda: orm(True),
        "Connection enqueue": single, "raw INSERT + pg_notify": by_hand}
    out = {}
    for name, call in cases.items():
        for _ in range(6):
            call()
        if name == "raw INSERT + pg_notify":
            out[name] = _wire(raw, call)
            continue
        with engine.connect() as c:  # the pool's warm connection, the one `call` gets next
            dbapi = c.connection.dbapi_connection
        assert isinstance(dbapi, psycopg.Connection)
        out[name] = _wire(dbapi, call)
    return out


def enqueue(server: Server, o: Options) -> list[Row]:
    with_job, without, bulk, raw_bulk, single, raw_single = [], [], [], [], [], []
    wire: dict[str, tuple[int, int]] = {}
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            make = sessionmaker(engine, class_=flowq.Session)
            _transactions(make, min(20, o.transactions))  # warm the pool and the caches
            for _ in repeats(o.repeat, "enqueue in transactions, bulk"):
                reset(engine)
                a, b = _transactions(make, o.transactions)
                with_job.append(a / o.transactions * 1000)
                without.append(b / o.transactions * 1000)
                with psycopg.connect(conninfo(url)) as raw_conn:
                    a, b = _singles(engine, raw_conn, o.transactions)
                    if not wire:
                        wire = _wire_rows(engine, make, raw_conn)
                single.append(o.transactions / a)
                raw_single.append(o.transactions / b)
                ours, raw = _bulk(engine, conninfo(url), o.bulk)
                bulk.append(ours)
                raw_bulk.append(raw)
        finally:
            engine.dispose()
    on_wire = "; ".join(f"{k}: {t} round trips, {n} B" for k, (t, n) in wire.items())
    return [
        Row("enqueue", Figure("ms per tx: ORM insert + session.enqueue", "ms", with_job, False),
            [Figure("ms per tx: ORM insert alone", "ms", without, False)],
            note="target: <= 1.2x the transaction without the enqueue",
            extra={"wire": {k: {"round_trips": t, "bytes": n} for k, (t, n) in wire.items()}}),
        Row("enqueue", Figure("single enqueue per tx (Connection)", "jobs/s", single),
            [Figure("raw psycopg INSERT + pg_notify per tx", "jobs/s", raw_single)],
            note=f"target: ~1x; per tx on the wire: {on_wire}"),
        Row("enqueue", Figure(f"enqueue_many of {o.bulk:,}", "rows/s", bulk),
            [Figure("raw INSERT … SELECT unnest(jsonb[])", "rows/s", raw_bulk)],
            note="target: >= 0.7x the raw multi-row INSERT"),
    ]


# -- latency ----------------------------------------------------------------------------------

def _produce(engine: sa.Engine, n: int, rate: float) -> dict[int, float]:
    """Enqueue `stamp` jobs one per transaction at `rate`/s; run id -> time after commit."""
    make = sessionmaker(engine, class_=flowq.Session)
    commits: dict[int, float] = {}
    interval, next_at = 1.0 / rate, time.perf_counter()
    for i in range(n):
        with make.begin() as s:
            run = s.enqueue(stamp, n=i)
        commits[run.id] = time.time()
        next_at += interval
        time.sleep(max(0.0, next_at - time.perf_counter()))
    return commits


def _pickups(engine: sa.Engine, commits: dict[int, float], since: float = 0.0) -> list[float]:
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT run_id, started FROM bench_stamps WHERE started >= :t"),
                         {"t": since}).all()
    return [(r.started - commits[r.run_id]) * 1000 for r in rows if r.run_id in commits]


def _stamped(engine: sa.Engine, n: int) -> bool:
    with engine.connect() as c:
        return int(c.execute(sa.text("SELECT count(*) FROM bench_stamps")).scalar_one()) >= n


def _measure(engine: sa.Engine, o: Options) -> list[float]:
    """Produce `latency_jobs` at `rate`, wait for every stamp; the pickup latencies (ms)."""
    commits = _produce(engine, o.latency_jobs, o.rate)
    wait_for(lambda: _stamped(engine, len(commits)), 60, "the stamps", 0.1)
    return _pickups(engine, commits)


def _latency_rows(name: str, samples: list[list[float]]) -> list[Figure]:
    return [Figure(f"{name} p50", "ms", [percentile(s, 50) for s in samples], False),
            Figure(f"{name} p99", "ms", [percentile(s, 99) for s in samples], False),
            Figure(f"{name} max", "ms", [max(s) for s in samples], False)]


def latency(server: Server, o: Options) -> list[Row]:
    ours: list[list[float]] = []
    raw: list[list[float]] = []
    durable: list[list[float]] = []
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            with WorkerGroup(url, processes=1, concurrency=o.concurrency) as workers:
                workers.wait_ready(engine)
                for _ in repeats(o.repeat, "flowq latency"):
                    reset(engine)
                    ours.append(_measure(engine, o))
            for _ in repeats(o.repeat, "raw listener latency"):
                for loop, into in (("listener", raw), ("listener_durable", durable)):
                    reset(engine)
                    with baselines.run_loops(loop, conninfo(url), 1) as loops:
                        loops.go()
                        into.append(_measure(engine, o))
        finally:
            engine.dispose()
    mine, refs = _latency_rows("pickup", ours), _latency_rows("raw LISTEN+claim", raw)
    after = _latency_rows("raw, started after its claim commits", durable)
    targets = {"p50": "target: p50 < 5 ms", "p99": "target: p99 < 25 ms"}
    return [Row("latency", f, [r, d], note=targets.get(f.name.split()[-1], ""))
            for f, r, d in zip(mine, refs, after, strict=True)]


# -- soak -------------------------------------------------------------------------------------

# Each job table on its own (`tables`): the live rows' flowq.jobs, and flowq.job_history,
# where finished rows move and the pruner deletes them, summed over its partitions.
_SIZES = sa.text(f"""SELECT {JOBS_SIZE} AS jobs_size, {HISTORY_SIZE} AS history_size,
    {JOBS_DEAD} AS jobs_dead, {HISTORY_DEAD} AS history_dead,
    (SELECT count(*) FROM {JOBS}) AS jobs_rows, (SELECT count(*) FROM {HISTORY}) AS history_rows""")
# The soak's sampled series: key, unit, label.
_SOAK_SERIES: Final = (("jobs_mb", "MB", "flowq.jobs size"),
                       ("history_mb", "MB", "flowq.job_history size"),
                       ("jobs_dead", "tuples", "flowq.jobs dead tuples"),
                       ("history_dead", "tuples", "flowq.job_history dead tuples"),
                       ("p99_ms", "ms", "pickup p99"))


def soak(server: Server, o: Options) -> list[Row]:
    samples: list[dict[str, Any]] = []
    # A short soak needs a short retention, or the pruner never gets to work within it.
    retention = min(o.soak_retention, o.duration / 6)
    sample_every = min(o.sample_every, o.duration / 12)
    with server.fresh_database() as url:
        engine = engine_for(url)
        try:
            extra = ("--retention", str(retention),
                     "--prune-interval", str(max(1.0, retention / 6)))
            with WorkerGroup(url, processes=1, concurrency=o.concurrency, extra=extra,
                             module=("flowq_bench.worker",)) as workers:
                workers.wait_ready(engine)
                stop = threading.Event()
                shared: dict[int, float] = {}
                producer = threading.Thread(target=_produce_into, args=(
                    engine, o.rate, stop, shared), daemon=True)
                start = time.time()
                producer.start()
                while time.time() - start < o.duration:
                    time.sleep(sample_every)
                    since = time.time() - sample_every
                    with engine.connect() as c:
                        s = c.execute(_SIZES).one()
                    lat = _pickups(engine, dict(shared), since)
                    samples.append({"t": round(time.time() - start, 1),
                                    "jobs_mb": s.jobs_size / 2**20,
                                    "history_mb": s.history_size / 2**20,
                                    "jobs_dead": int(s.jobs_dead or 0),
                                    "history_dead": int(s.history_dead or 0),
                                    "jobs_rows": int(s.jobs_rows),
                                    "history_rows": int(s.history_rows),
                                    "p99_ms": percentile(lat, 99), "jobs": len(lat)})
                stop.set()
                producer.join(timeout=10)
        finally:
            engine.dispose()
    half = max(1, len(samples) // 2)
    first, second = samples[:half], samples[half:] or samples[:half]

    def peak(part: list[dict[str, Any]], key: str) -> list[float]:
        return [max(float(s[key]) for s in part)]

    rows = []
    for key, unit, label in _SOAK_SERIES:
        rows.append(Row("soak", Figure(f"{label}, peak in 2nd half", unit, peak(second, key),
                                       False),
                        [Figure("peak in 1st half", unit, peak(first, key), False)],
                        extra={"series": [{"t": s["t"], key: s[key]} for s in samples]}))
    rows[0].note = (f"{o.duration:.0f}s at {o.rate:g} jobs/s, pruner retention "
                    f"{retention:g}s; ratio ~1 = levelled off")
    return rows


def _produce_into(engine: sa.Engine, rate: float, stop: threading.Event,
                  out: dict[int, float]) -> None:
    make = sessionmaker(engine, class_=flowq.Session)
    interval, next_at, i = 1.0 / rate, time.perf_counter(), 0
    while not stop.is_set():
        with make.begin() as s:
            run = s.enqueue(stamp, n=i)
        out[run.id] = time.time()
        i += 1
        next_at += interval
        time.sleep(max(0.0, next_at - time.perf_counter()))
