"""Fixed-rate load in phases, and what each phase's window reads back from the job rows.

The machinery the `pressure` and `overload` scenarios share, so that both offer load and read
pickup the same way:

- `Producer`: offers no-op jobs at a fixed rate, a batch every `TICK` seconds in one
  transaction (`enqueue_many`), so the producer itself keeps up at any rate one worker can be
  offered; at most `MAX_BATCH` jobs per batch, so a producer that fell behind catches up in
  bounded steps and says how far behind it fell (`behind`). Its rate can change between
  phases (`offer`): the schedule restarts there, and a debt of the previous phase is dropped.
- `run_phases(engine, phases, seconds)`: one `Producer` through `phases` of `seconds` each,
  each with what runs beside it (`Phase.beside`); with `settle`, the producer pauses between
  phases until nothing is pending or running (the backlog of one phase never falls into the
  next). Then it waits for the last backlog to drain and reads each phase's window
  (`PhaseFigures`): jobs enqueued in it (offered) and their pickups p50/p99 (from the row's
  `created_at` to its claim, `started_at`, both the database's clock: read from the job rows
  themselves, so the handler does nothing and no handler's timing is what is measured), jobs
  finished in it (completed), the backlog at its end, the WAL written per completed job
  (`pg_current_wal_insert_lsn()` at the phase's edges; the server's, so the producer's
  inserts count too, and the writes of both job tables) and, at its end, the dead tuples
  and the size of each job table, named apart (`tables`): `flowq.jobs`, the live rows, and
  `flowq.job_history`, where a finished row moves, summed over its partitions
  (`pg_stat_user_tables`, updated asynchronously: indicative). Finished and enqueued rows
  are read in `flowq.job_history` and `flowq.steps` (both tables): a finished row has left
  `flowq.jobs`.

Every wait is bounded (`DRAIN_TIMEOUT`, `SETTLE_TIMEOUT`); an error in the producer stops the
phase at once and is raised, and the producer is stopped on any error of the caller's.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

import flowq
from flowq_bench.app import noop
from flowq_bench.harness import wait_for
from flowq_bench.progress import repeats
from flowq_bench.tables import (
    HISTORY,
    HISTORY_DEAD,
    HISTORY_SIZE,
    JOBS,
    JOBS_DEAD,
    JOBS_SIZE,
    STEPS,
)

__all__ = ["DRAIN_TIMEOUT", "MAX_BATCH", "TICK", "Phase", "PhaseFigures", "Producer", "left",
           "nothing_beside", "run_phases"]

TICK: Final = 0.02  # seconds between the producer's batches
MAX_BATCH: Final = 5_000  # jobs in one batch at most (100,000 jobs/s is 2,000 a batch)
DRAIN_TIMEOUT: Final = 600.0  # the backlog left after the last phase
SETTLE_TIMEOUT: Final = 600.0  # the backlog of one phase, before the next (`settle`)
STOP_TIMEOUT: Final = 30.0  # the producer's last batch
MIB: Final = 1024.0 * 1024.0

_EDGE = sa.text(f"""SELECT pg_current_wal_insert_lsn()::text AS lsn,
    extract(epoch FROM clock_timestamp())::float8 AS at,
    {JOBS_DEAD} AS jobs_dead, {HISTORY_DEAD} AS history_dead,
    {JOBS_SIZE} AS jobs_size, {HISTORY_SIZE} AS history_size,
    (SELECT count(*) FROM {JOBS} WHERE status = 'pending') AS backlog""")
_WAL = sa.text("SELECT pg_wal_lsn_diff(CAST(:b AS pg_lsn), CAST(:a AS pg_lsn))::float8")
# Only finished rows have a finished_at: job_history's (its finished_at index serves this).
_FINISHED = sa.text(f"SELECT count(*) FROM {HISTORY} WHERE task = 'noop' AND "
                    "finished_at >= to_timestamp(:a) AND finished_at < to_timestamp(:b)")
# The jobs enqueued in a phase, and their pickups (created_at to the claim, in ms): live or
# finished by now, so both tables.
_ENQUEUED = sa.text(f"""SELECT count(*) AS n, percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (
        ORDER BY extract(epoch FROM started_at - created_at) * 1000) AS pickups
    FROM {STEPS} WHERE task = 'noop'
     AND created_at >= to_timestamp(:a) AND created_at < to_timestamp(:b)""")
_LEFT = sa.text(f"SELECT count(*) FROM {JOBS} WHERE status IN ('pending', 'running')")


@dataclass
class Producer:
    """Offers `rate` no-op jobs per second (`offer` changes it) until `stop` is set; an
    exception ends `run` and is kept in `error` (and sets `failed`)."""

    engine: sa.Engine
    rate: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)
    failed: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    behind: float = 0.0  # the most the producer fell behind its schedule (s)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _start: float = field(default_factory=time.perf_counter, repr=False)
    _due: int = 0  # jobs enqueued since `_start`

    def offer(self, rate: float, now: float | None = None) -> None:
        """From `now` (default: now, on `time.perf_counter`'s clock), `rate` jobs per second
        (0: none), on a schedule that starts there."""
        with self._lock:
            self.rate, self._due = rate, 0
            self._start = time.perf_counter() if now is None else now

    def sent(self, n: int) -> None:
        """`n` more jobs were enqueued on the schedule."""
        with self._lock:
            self._due += n

    def owed(self, now: float) -> int:
        """Jobs the schedule asks for by `now` and not enqueued yet, at most `MAX_BATCH`."""
        with self._lock:
            return max(0, min(MAX_BATCH, int((now - self._start) * self.rate) - self._due))

    def run(self) -> None:
        make = sessionmaker(self.engine, class_=flowq.Session)
        try:
            while not self.stop.is_set():
                owed = self.owed(time.perf_counter())
                if owed:
                    with make.begin() as s:
                        s.enqueue_many(noop, [{"n": 0}] * owed)
                    self.sent(owed)
                with self._lock:
                    if self.rate > 0:
                        late = time.perf_counter() - self._start - self._due / self.rate
                        self.behind = max(self.behind, late)
                self.stop.wait(TICK)
        except BaseException as exc:  # raised by run_phases, in the caller's thread
            self.error = exc
            self.failed.set()


@contextmanager
def producing(producer: Producer) -> Iterator[Producer]:
    """`producer` running on a thread for the block; stopped however the block ends, and its
    error (if it had one) raised."""
    thread = threading.Thread(target=producer.run, name="flowq-bench-producer", daemon=True)
    thread.start()
    try:
        yield producer
    finally:
        producer.stop.set()
        thread.join(timeout=STOP_TIMEOUT)
    if producer.error is not None:
        raise RuntimeError(f"the bench's producer failed: {producer.error}") from producer.error


@contextmanager
def nothing_beside() -> Iterator[None]:
    """A phase with nothing running beside the load."""
    yield


@dataclass(frozen=True)
class Phase:
    """One phase of load: its name, the jobs/s offered, what runs beside it."""

    name: str
    rate: float
    beside: Callable[[], AbstractContextManager[Any]] = nothing_beside


@dataclass
class _Edge:
    lsn: str
    at: float
    jobs_dead: int
    history_dead: int
    jobs_size: int
    history_size: int
    backlog: int


def _edge(engine: sa.Engine) -> _Edge:
    with engine.connect() as c:
        r = c.execute(_EDGE).one()
    return _Edge(r.lsn, float(r.at), int(r.jobs_dead or 0), int(r.history_dead or 0),
                 int(r.jobs_size), int(r.history_size), int(r.backlog))


@dataclass(frozen=True)
class PhaseFigures:
    """What one phase's window reads from the job rows (pickups in ms)."""

    name: str
    rate: float  # jobs/s the producer was asked for
    seconds: float  # the window, on the database's clock
    offered: int  # jobs enqueued in the window
    completed: int  # jobs finished in the window
    p50: float = math.nan  # pickup of the jobs enqueued in the window
    p99: float = math.nan
    backlog: int = 0  # jobs pending at the window's end
    wal_per_job: float = 0.0  # WAL bytes written in the window (server's), per completed job
    dead: int = 0  # dead tuples of flowq.jobs at the window's end
    history_dead: int = 0  # dead tuples of flowq.job_history (all partitions) at its end
    jobs_mb: float = 0.0  # size of flowq.jobs (indexes and TOAST included) at its end, MiB
    history_mb: float = 0.0  # size of flowq.job_history (all partitions) at its end, MiB

    @property
    def offered_per_s(self) -> float:
        return self.offered / self.seconds if self.seconds > 0 else math.nan

    @property
    def completed_per_s(self) -> float:
        return self.completed / self.seconds if self.seconds > 0 else math.nan

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "offered_per_s": self.offered_per_s,
                "completed_per_s": self.completed_per_s}


def _read(engine: sa.Engine, phase: Phase, a: _Edge, b: _Edge) -> PhaseFigures:
    window = {"a": a.at, "b": b.at}
    with engine.connect() as c:
        completed = int(c.execute(_FINISHED, window).scalar_one())
        enqueued = c.execute(_ENQUEUED, window).one()
        wal = float(c.execute(_WAL, {"a": a.lsn, "b": b.lsn}).scalar_one())
    p50, p99 = enqueued.pickups or (math.nan, math.nan)
    return PhaseFigures(phase.name, phase.rate, seconds=b.at - a.at, offered=int(enqueued.n),
                        completed=completed, p50=float(p50), p99=float(p99),
                        backlog=b.backlog, wal_per_job=wal / max(1, completed),
                        dead=b.jobs_dead, history_dead=b.history_dead,
                        jobs_mb=b.jobs_size / MIB, history_mb=b.history_size / MIB)


def left(engine: sa.Engine) -> int:
    """Jobs pending or running."""
    with engine.connect() as c:
        return int(c.execute(_LEFT).scalar_one())


def run_phases(engine: sa.Engine, phases: Sequence[Phase], seconds: float, *,
               settle: bool = False, what: str = "phase"
               ) -> tuple[list[PhaseFigures], float]:
    """Offer each of `phases` for `seconds` (with `settle`, once the previous phase's backlog
    is gone); once the last backlog drained, each phase's figures and how far the producer
    fell behind its schedule at most (s)."""
    windows: list[tuple[_Edge, _Edge]] = []
    producer = Producer(engine)
    with producing(producer):
        b: _Edge | None = None
        for i in repeats(len(phases), what):
            phase = phases[i]
            if settle and b is not None:
                producer.offer(0.0)
                wait_for(lambda: producer.failed.is_set() or left(engine) == 0,
                         SETTLE_TIMEOUT, f"the backlog of {phases[i - 1].name}", 0.1)
                b = None
            a = b if b is not None else _edge(engine)  # back to back: the edges are shared
            if phase.rate != producer.rate:
                producer.offer(phase.rate)  # else the schedule runs on, unbroken
            with phase.beside():
                producer.failed.wait(seconds)
            if producer.failed.is_set():
                break  # `producing` raises its error
            b = _edge(engine)
            windows.append((a, b))
    wait_for(lambda: left(engine) == 0, DRAIN_TIMEOUT, "the last backlog", 0.2)
    return ([_read(engine, p, a, b) for p, (a, b) in zip(phases, windows, strict=True)],
            producer.behind)
