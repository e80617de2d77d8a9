"""Claim-ahead: a worker claims beyond its free handlers only what it would start within a few
tens of milliseconds at the rate its handlers finish, never runs more than `concurrency` at
once, hands back what waited too long (handlers turned slow) and what it holds at shutdown.
Fairness with real worker processes: two workers of -c 10 share 20 one-second jobs evenly,
and a worker whose fast jobs turn slow does not hoard them from an idle one. Every test
checks a ledger: each job ran exactly once."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Any

import ledger_app as la
import pytest
import sqlalchemy as sa
from support import rows, scalar

import flowq
from flowq.db.rows import ClaimedJob
from flowq.durable.context import Context
from flowq.durable.session import StepSession
from flowq.testing import job_rows, running_worker, wait_until
from flowq.worker import Worker, WorkerConfig
from flowq.worker.executor import Executor
from flowq.worker.model import Outcome

FAST_POLL = ("--poll-interval", "0.1")


def ledger(engine: sa.Engine) -> list[Any]:
    return rows(engine, "SELECT job_id, pid FROM ledger")


def live_workers(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT count(*) FROM flowq.workers"))


# -- the executor: at most `concurrency` running, the rest ready ------------------------------


class _Outcomes:
    def __init__(self) -> None:
        self.got: dict[int, Outcome] = {}

    def submit(self, job: ClaimedJob, outcome: Outcome, duration: float) -> None:
        self.got[job.id] = outcome


def test_the_executor_runs_at_most_concurrency_and_keeps_the_rest_ready(
        app: flowq.FlowQ) -> None:
    running, peak, gate = [0], [0], threading.Event()
    lock = threading.Lock()

    def counted(seconds: float) -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        gate.wait(5)
        time.sleep(seconds)
        with lock:
            running[0] -= 1

    @app.task()
    def hold(ctx: Context) -> None:
        counted(0.05)

    @app.task(timeout=0.5)
    def quick(ctx: Context) -> None:
        counted(0.3)

    outcomes = _Outcomes()
    executor = Executor(app, outcomes, concurrency=2,  # type: ignore[arg-type]
                        session_factory=lambda: StepSession(), on_slot_free=lambda n: None)
    started: list[int] = []
    executor.on_start = lambda job, waited: started.append(job.id)
    executor.start()

    def submit(i: int, task: str) -> None:
        executor.submit(ClaimedJob(i, i, i, task, task, 0, "default", 0, 1, 10, "{}", False,
                                   0.0))

    try:
        for i in range(1, 7):
            submit(i, "hold" if i <= 2 else "quick")
        assert (executor.active, executor.ready, executor.in_flight) == (2, 4, 6)
        assert started == [1, 2]
        # Waiting ready does not count towards a step's timeout: the clock starts at the
        # start. The quick ones wait 0.6 s here, then run 0.3 s of their 0.5 s.
        time.sleep(0.6)
        assert executor.take_ready(older_than=10.0) == []  # none waited that long
        gate.set()
        wait_until(lambda: len(outcomes.got) == 6, timeout=20, message="six outcomes")
        assert peak[0] == 2 and started == [1, 2, 3, 4, 5, 6]
        assert {type(o).__name__ for o in outcomes.got.values()} == {"Succeeded"}
        assert (executor.active, executor.ready, executor.in_flight) == (0, 0, 0)
        # Taking the ready ones: they never start, and their claims go to the caller.
        gate.clear()
        for i in range(7, 11):
            submit(i, "hold")
        assert executor.take_ready() == [(9, 9), (10, 10)]
        gate.set()
        wait_until(lambda: len(outcomes.got) == 8, timeout=20, message="the two running")
        time.sleep(0.2)
        assert sorted(outcomes.got) == [1, 2, 3, 4, 5, 6, 7, 8]
        assert executor.in_flight == 0
    finally:
        gate.set()
        executor.stop()


# -- the worker: sized from the rate, handed back when stale or at shutdown -------------------


def test_fast_jobs_are_claimed_ahead_and_each_runs_once(app: flowq.FlowQ, engine: sa.Engine,
                                                        db_url: str) -> None:
    seen: Counter[int] = Counter()
    lock = threading.Lock()

    @app.task()
    def fast(ctx: Context, n: int) -> None:
        with lock:
            seen[n] += 1

    with engine.begin() as conn:
        flowq.enqueue_many(conn, fast, [{"n": i} for i in range(3000)])
    with running_worker(app, db_url, concurrency=2) as worker:
        wait_until(lambda: len(seen) == 3000, timeout=120, message="3,000 jobs")
        ahead_seen = worker.producer.ahead
    assert set(seen.values()) == {1}
    assert ahead_seen > 0  # the rate of no-op handlers earns a claim-ahead at -c 2
    assert {r.status for r in job_rows(engine)} == {"succeeded"}
    assert {r.attempts for r in job_rows(engine)} == {1}


def test_claim_ahead_is_off_with_zero_and_refused_when_bad(app: flowq.FlowQ,
                                                          db_url: str) -> None:
    @app.task()
    def fast(ctx: Context) -> None: ...

    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(flowq.ConfigurationError, match="claim_ahead"):
            Worker(app, db_url, WorkerConfig(claim_ahead=bad))  # type: ignore[arg-type]
    w = Worker(app, db_url, WorkerConfig(claim_ahead=0, concurrency=4))
    w.executor.finished = 100_000
    w.producer.rate_at -= 1.0
    w.producer.size_claim_ahead(time.monotonic())
    assert w.producer.ahead == 0 and w.producer.free_slots() == 4


def held_worker(app: flowq.FlowQ, engine: sa.Engine, db_url: str, jobs: int, ahead: int,
                **config: Any) -> tuple[Worker, threading.Event, list[int]]:
    """A worker whose `jobs` handlers wait for the event it returns, given a claim-ahead of
    `ahead` as if fast handlers had earned it (and kept: no re-measuring during the test)."""
    release = threading.Event()

    @app.task()
    def slow(ctx: Context, n: int) -> None:
        release.wait(10)

    with engine.begin() as conn:
        ids = flowq.enqueue_many(conn, slow, [{"n": i} for i in range(jobs)])
    w = Worker(app, db_url, WorkerConfig(poll_interval=0.1, shutdown_grace=5, **config))
    w.producer.ahead = ahead
    w.producer.rate_at = time.monotonic() + 3600
    return w, release, ids


def test_jobs_claimed_ahead_are_handed_back_at_shutdown_with_their_attempt(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    w, release, ids = held_worker(app, engine, db_url, 10, 3, concurrency=2)
    with w.running():
        wait_until(lambda: w.executor.active == 2 and w.executor.ready == 3, timeout=10,
                   message="2 running and 3 claimed ahead")
        assert scalar(engine, "SELECT count(*) FROM flowq.steps WHERE status = 'running'") == 5
        w.stop()
        # The shutdown takes the ready ones back before the running ones finish.
        wait_until(lambda: w.executor.ready == 0, timeout=10, message="the ready ones taken")
        release.set()
    rows = {r.id: r for r in job_rows(engine)}
    assert sorted(rows) == sorted(ids)
    assert Counter(r.status for r in rows.values()) == {"succeeded": 2, "pending": 8}
    # The three claimed ahead went back without using an attempt.
    assert {r.attempts for r in rows.values() if r.status == "pending"} == {0}


def test_jobs_claimed_ahead_that_wait_too_long_are_handed_back(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str) -> None:
    w, release, _ = held_worker(app, engine, db_url, 6, 4, concurrency=1, claim_ahead=4)
    try:
        with w.running():
            # Claimed ahead, then handed back after CLAIM_AHEAD_MAX_WAIT: the claim-ahead is
            # reset to nothing, so the worker holds just its running job.
            wait_until(lambda: w.executor.active == 1 and w.executor.ready == 0
                       and w.producer.ahead == 0, timeout=10, message="the stale ones handed back")
            wait_until(lambda: scalar(engine, "SELECT count(*) FROM flowq.steps "
                                              "WHERE status = 'running'") == 1,
                       timeout=10, message="one row running")
            assert scalar(engine, "SELECT count(*) FROM flowq.steps WHERE status = 'pending' "
                                  "AND attempts = 0") == 5
            release.set()
            wait_until(lambda: {r.status for r in job_rows(engine)} == {"succeeded"},
                       timeout=30, message="all six done")
    finally:
        release.set()
    assert {r.attempts for r in job_rows(engine)} == {1}


# -- fairness between real worker processes ----------------------------------------------------


def two_idle_workers(engine: sa.Engine, db_url: str, spawn_worker: Any, *,
                     concurrency: int) -> None:
    """Two `flowq worker ledger_app:app` processes, registered and idle; the ledger made."""
    with engine.begin() as conn:
        conn.exec_driver_sql(la.LEDGER_DDL)
    for _ in range(2):
        spawn_worker("ledger_app:app", db_url, "-c", str(concurrency), "--no-job-log",
                     *FAST_POLL)
    wait_until(lambda: live_workers(engine) == 2, timeout=60, message="two workers")


def test_two_workers_share_twenty_one_second_jobs_evenly(engine: sa.Engine, db_url: str,
                                                         spawn_worker: Any) -> None:
    two_idle_workers(engine, db_url, spawn_worker, concurrency=10)
    with engine.begin() as conn:
        ids = flowq.enqueue_many(conn, la.record, [{"n": i, "sleep": 1.0} for i in range(20)])
    wait_until(lambda: len(ledger(engine)) == 20, timeout=60, message="20 jobs")
    rows = ledger(engine)
    assert sorted(r.job_id for r in rows) == sorted(ids)  # each exactly once
    per_worker = Counter(r.pid for r in rows)
    assert len(per_worker) == 2 and min(per_worker.values()) >= 8, per_worker


def test_a_worker_whose_jobs_turn_slow_does_not_hoard_them(engine: sa.Engine, db_url: str,
                                                           spawn_worker: Any) -> None:
    """2,000 no-op jobs, then 12 of one second each, in one commit, to two workers of -c 2:
    the no-op ones earn each worker a claim-ahead, so the slow ones are claimed ahead too;
    what waits there is handed back, and the idle worker runs its share."""
    two_idle_workers(engine, db_url, spawn_worker, concurrency=2)
    with engine.begin() as conn:
        fast = flowq.enqueue_many(conn, la.record, [{"n": i} for i in range(2000)])
        slow = flowq.enqueue_many(conn, la.record, [{"n": i, "sleep": 1.0}
                                                    for i in range(12)])
    wait_until(lambda: len(ledger(engine)) == 2012, timeout=120, message="2,012 jobs")
    rows = ledger(engine)
    assert sorted(r.job_id for r in rows) == sorted(fast + slow)  # each exactly once
    slow_per_worker = Counter(r.pid for r in rows if r.job_id in set(slow))
    assert len(slow_per_worker) == 2 and min(slow_per_worker.values()) >= 4, slow_per_worker
    with engine.connect() as c:
        attempts = {r.attempts for r in c.execute(sa.text(
            "SELECT attempts FROM flowq.steps WHERE id = ANY(:ids)"), {"ids": slow})}
    assert attempts == {1}  # a hand-back gives the attempt back
    assert json.dumps(sorted(slow_per_worker.values()))  # (printed on failure above)


# -- the producer's wake-ups, without a database ----------------------------------------------


class _Idle:
    finished = 0
    in_flight = 0
    queued = 0

    def oldest_ready_age(self) -> float:
        return 0.0

    def take_ready(self, older_than: float | None = None) -> list[tuple[int, int]]:
        return []

    def flush(self, timeout: float) -> bool:
        return True


def idle_producer(**config: Any) -> tuple[Any, threading.Event]:
    from flowq.db import normalize_url
    from flowq.worker.claimer import Claimer
    from flowq.worker.connection import DedicatedConnection
    from flowq.worker.producer import Producer

    conn = DedicatedConnection(normalize_url("postgresql://unused/none"), "unused")
    claimer = Claimer(conn, "flowq", ["default"], "w", lambda job: None)
    wake = threading.Event()
    producer = Producer(WorkerConfig(**config), claimer, _Idle(), _Idle(),
                        wake=wake, stopping=threading.Event())
    return producer, wake


def test_the_producer_remembers_due_wake_ups_and_ignores_what_the_poll_covers() -> None:
    producer, wake = idle_producer(poll_interval=5.0)
    now = time.monotonic()
    producer.wake_at(10.0)  # after the next poll anyway: not remembered
    assert producer.take_due(now + 60) == (False, float("inf"))
    assert not wake.is_set()
    producer.wake_at(0.2)
    producer.wake_at(0.1)
    assert wake.is_set()
    due, next_due = producer.take_due(now)
    assert not due and now + 0.05 < next_due < now + 0.2
    assert producer.take_due(now + 0.15)[0]  # the first one is due; the other remains
    assert producer.take_due(now + 1.0) == (True, float("inf"))
    for hostile in (float("nan"), float("inf"), -1.0, 0.0):  # anyone may NOTIFY: wake now
        wake.clear()
        producer.wake_at(hostile)
        assert wake.is_set() and producer.take_due(now + 1.0) == (False, float("inf"))


def test_the_producer_is_woken_by_freed_slots_only_for_a_batch() -> None:
    producer, wake = idle_producer(concurrency=8)
    assert producer.batch_threshold == 4 and producer.free_slots() == 8
    producer.slot_freed(7)  # one slot free: not worth a claim
    assert not wake.is_set()
    producer.slot_freed(4)  # half of them
    assert wake.is_set()
    wake.clear()
    producer.slot_freed(0)  # none busy
    assert wake.is_set()
    wake.clear()
    producer.notified()
    assert wake.is_set()
