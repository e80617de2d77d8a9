"""Queues as configuration (flowq.queues): global concurrency and rate limits, per-key
concurrency, pause and resume, enforced in the claim; cooperative cancellation of running
handlers. Real worker processes (tests/apps/queues_app.py) and a ledger of start/end times."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import queues_app as qa
import sqlalchemy as sa
from support import max_overlap, scalar

import flowq
from flowq.db import normalize_url
from flowq.db.rows import ClaimedJob
from flowq.db.sql import Queries
from flowq.ops.queues import list_queues, pause, resume
from flowq.ops.runs import cancel_run, get_run
from flowq.testing import wait_until
from flowq.worker.claimer import Claimer
from flowq.worker.config import WorkerConfig
from flowq.worker.connection import DedicatedConnection
from flowq.worker.registry import Registry
from flowq.worker.worker import Worker

FAST = ("--poll-interval", "0.2", "--heartbeat-interval", "0.5", "--stale-after", "5",
        "--reap-interval", "1")
Q = Queries("flowq")


def intervals(engine: sa.Engine, task: str) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text(
            "SELECT key, started, ended FROM queue_ledger WHERE task = :t"), {"t": task}))


def done(engine: sa.Engine, task: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM queue_ledger WHERE task = :t"),
                                {"t": task}).scalar_one())


# -- definitions and bad input --------------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda app: app.queue("q", concurrency=0), "at least 1"),
    (lambda app: app.queue("q", concurrency=True), "at least 1"),
    (lambda app: app.queue("q", rate_limit=flowq.Rate(0)), "at least 1"),
    (lambda app: app.queue("q", rate_limit=flowq.Rate(5, per=0)), "positive"),
    (lambda app: app.queue("q", rate_limit=flowq.Rate(5, per=timedelta(seconds=-1))),
     "positive"),
    (lambda app: app.queue("q", rate_limit=5), "flowq.Rate"),
    (lambda app: app.queue("q", concurrency=2**31), "at most"),
    (lambda app: app.queue("q", rate_limit=flowq.Rate(10**12)), "at most"),
    (lambda app: app.queue("q", rate_limit=flowq.Rate(5, per=float("nan"))), "positive"),
    (lambda app: app.queue("not a queue!"), "not valid"),
])
def test_bad_queue_declarations_are_refused(make: Any, match: str) -> None:
    with pytest.raises(flowq.FlowqError, match=match):
        make(flowq.FlowQ())


PERIOD_RANGE = r"from 0\.001 \(1 ms\) to 31622400 \(366 days\), got "


@pytest.mark.parametrize("limit, per, match", [
    # A denormal period overflowed `limit / period` in every claim of the queue: it wedged.
    (5, 1e-320, PERIOD_RANGE + "1e-320"),
    (5, 0, PERIOD_RANGE + "0"),
    (5, -1, PERIOD_RANGE + "-1"),
    (5, float("nan"), PERIOD_RANGE + "nan"),
    (5, float("inf"), PERIOD_RANGE + "inf"),
    (5, 1e309, PERIOD_RANGE + "inf"),  # 1e309 is a float's infinity
    (5, 10**400, PERIOD_RANGE + r"1000.*\(401 characters\)"),
    (5, 0.0009, PERIOD_RANGE + "0.0009"),
    (5, timedelta(days=367), PERIOD_RANGE),
    (5, True, "seconds or a timedelta"),
    (5, "1", "seconds or a timedelta"),
    (2**31 - 1, 0.001, r"allows 2,147,483,647,000 starts per second, more than the at most "
                       r"1,000,000 a rate limit can enforce"),
    (1_000_001, 1, "allows 1,000,001 starts per second"),
    (2**31, 1, "at most 2147483647"),
    (10**400, 1, r"at most 2147483647\), got 1000.*\(401 characters\)"),
    (True, 1, "at least 1 start"),
    (-1, 1, "at least 1 start"),
])
def test_a_rate_the_claim_cannot_enforce_is_refused_when_declared(limit: Any, per: Any,
                                                                  match: str) -> None:
    with pytest.raises(flowq.ConfigurationError, match=match):
        flowq.Rate(limit, per=per)


def test_the_rate_bounds_are_allowed() -> None:
    for rate in (flowq.Rate(1, per=0.001), flowq.Rate(1000, per=0.001),
                 flowq.Rate(1_000_000), flowq.Rate(2**31 - 1, per=timedelta(days=366)),
                 flowq.Rate(1, per=timedelta(days=366)), flowq.Rate(1, per=10**6)):
        flowq.FlowQ().queue("q", rate_limit=rate)


def test_bad_key_options_are_refused() -> None:
    app = flowq.FlowQ()
    with pytest.raises(flowq.ConfigurationError, match="not one of its arguments"):
        @app.task(concurrency_key="customer")
        def a(ctx: flowq.Context, user: str) -> None: ...
    with pytest.raises(flowq.ConfigurationError, match="at least 1"):
        @app.task(concurrency_key="user", key_concurrency=0)
        def b(ctx: flowq.Context, user: str) -> None: ...
    with pytest.raises(flowq.ConfigurationError, match="no concurrency_key"):
        @app.task(key_concurrency=2)
        def c(ctx: flowq.Context, user: str) -> None: ...


def test_a_key_that_is_not_a_json_scalar_is_refused_at_enqueue(engine: sa.Engine) -> None:
    app = flowq.FlowQ()

    @app.task(concurrency_key="user")
    def a(ctx: flowq.Context, user: Any) -> None: ...

    @app.task(concurrency_key=lambda user: {"u": user})
    def b(ctx: flowq.Context, user: Any) -> None: ...

    with engine.begin() as conn:
        with pytest.raises(flowq.InvalidArgumentsError, match="JSON scalar"):
            a.enqueue(conn, user=[1, 2])
        with pytest.raises(flowq.InvalidArgumentsError, match="JSON scalar"):
            b.enqueue(conn, user=1)
        a.enqueue(conn, user="ann")
        key = conn.execute(sa.text("SELECT concurrency_key, key_limit FROM flowq.steps")).one()
    assert tuple(key) == ('"ann"', 1)


def test_pausing_an_invalid_queue_name_is_refused(engine: sa.Engine, db_url: str) -> None:
    with pytest.raises(flowq.InvalidQueueError):
        pause(engine, "no such queue!")
    proc = subprocess.run([sys.executable, "-m", "flowq", "queues", "pause", "bad name!",
                           "--database-url", db_url], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "not valid" in proc.stderr


def test_pausing_a_queue_nothing_uses_says_what_was_meant(engine: sa.Engine,
                                                          db_url: str) -> None:
    from click.testing import CliRunner

    from flowq.cli import main

    with engine.begin() as conn:
        flowq.enqueue(conn, "send", queue="emails", delay=60)
    result = CliRunner().invoke(main, ["queues", "pause", "emials", "--database-url", db_url])
    assert result.exit_code == 0 and result.stdout == "queue 'emials' paused.\n"
    assert "no queue 'emials' has jobs or a declaration: did you mean 'emails'?" in (
        result.stderr)
    result = CliRunner().invoke(main, ["queues", "pause", "emails", "--database-url", db_url])
    assert result.exit_code == 0 and result.stderr == ""


# -- the claim ------------------------------------------------------------------------------


def claim(engine: sa.Engine, queue: str, limit: int, worker: str = "w") -> list[Any]:
    """A limited claim exactly as the claimer sends it: lock the queue row, then claim."""
    with engine.begin() as conn:
        conn.execute(Q.lock_queue, {"queue": queue})
        rows = list(conn.execute(Q.claim_limited_jobs, {"queue": queue, "limit": limit,
                                                        "worker": worker, "scan": 100}))
    assert rows, "a limited claim always returns a row (its `more` flag)"
    held_back[queue] = rows[0].more
    return [r for r in rows if r.id is not None]


held_back: dict[str, bool] = {}


def test_the_limited_claim_honours_concurrency_rate_and_keys(engine: sa.Engine) -> None:
    app = flowq.FlowQ()

    @app.task(queue="k", concurrency_key="who", key_concurrency=2)
    def keyed(ctx: flowq.Context, who: str) -> None: ...

    @app.task(queue="c")
    def plain(ctx: flowq.Context) -> None: ...

    with engine.begin() as conn:
        flowq.enqueue_many(conn, keyed, [{"who": "a"}] * 5 + [{"who": "b"}] * 5)
        flowq.enqueue_many(conn, plain, [{}] * 10)
        conn.execute(Q.declare_queues, {"names": ["c"], "concurrencies": [4],
                                        "rate_limits": [None], "rate_periods": [None],
                                        "worker": "t"})
        conn.execute(Q.mark_keyed_queues, {"names": ["k"], "served": []})
        # A plain claim leaves controlled queues alone.
        assert conn.execute(Q.claim_jobs, {"queue": "c", "limit": 10, "worker": "w"}).all() == []
    got = claim(engine, "k", 10)
    assert sorted(json.loads(r.args)["who"] for r in got) == ["a", "a", "b", "b"]
    assert claim(engine, "k", 10) == []  # both keys at their limit
    assert held_back["k"]  # due jobs were held back: the worker looks again soon
    assert len(claim(engine, "c", 10)) == 4
    assert claim(engine, "c", 10) == []
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'succeeded' WHERE queue = 'c' "
                             "AND status = 'running' AND id IN (SELECT id FROM flowq.steps "
                             "WHERE queue = 'c' AND status = 'running' LIMIT 1)"))
    assert len(claim(engine, "c", 10)) == 1
    # A rate: a bucket of 3, refilled at 3 per hour: 3 now, then nothing.
    with engine.begin() as conn:
        conn.execute(Q.declare_queues, {"names": ["c"], "concurrencies": [None],
                                        "rate_limits": [3], "rate_periods": [3600.0],
                                        "worker": "t"})
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'pending' WHERE queue = 'c'"))
    assert len(claim(engine, "c", 10)) == 3
    assert claim(engine, "c", 10) == []
    pause(engine, "k")
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'pending' WHERE queue = 'k'"))
    assert claim(engine, "k", 10) == []
    assert resume(engine, "k") and not resume(engine, "k")
    assert len(claim(engine, "k", 10)) == 4
    info = {q.name: q for q in list_queues(engine)}
    assert info["c"].rate_limit == 3 and info["k"].running == 4 and not info["k"].paused


def test_the_shortest_rate_period_allowed_still_drains(engine: sa.Engine) -> None:
    """Rate(1, per=1 ms), the tightest the declaration allows: every claim's refill is finite
    and the queue drains (a denormal period failed every claim with a float8 overflow)."""
    app = flowq.FlowQ()
    rate = app.queue("tiny", rate_limit=flowq.Rate(1, per=timedelta(milliseconds=1))).rate_limit
    assert rate is not None

    @app.task(queue="tiny")
    def quick(ctx: flowq.Context) -> None: ...

    with engine.begin() as conn:
        flowq.enqueue_many(conn, quick, [{}] * 20)
        conn.execute(Q.declare_queues, {"names": ["tiny"], "concurrencies": [None],
                                        "rate_limits": [rate.limit],
                                        "rate_periods": [rate.seconds], "worker": "t"})
    claimed: list[Any] = []
    wait_until(lambda: claimed.extend(claim(engine, "tiny", 10)) or len(claimed) == 20,
               timeout=30, message="20 jobs claimed through a 1 ms rate")
    assert len({r.id for r in claimed}) == 20


def test_a_claim_that_waited_for_the_queue_never_refills_back_in_time(engine: sa.Engine) -> None:
    """A limited claim's now() is its transaction's start, which may be before the refill of
    a claim it waited for on the queue's row: it adds no tokens for a negative lag and leaves
    `refilled_at` where it was, so the next claim counts no span twice."""
    app = flowq.FlowQ()
    rate = app.queue("lag", rate_limit=flowq.Rate(10, per=1)).rate_limit
    assert rate is not None

    @app.task(queue="lag")
    def tick(ctx: flowq.Context) -> None: ...

    with engine.begin() as conn:
        flowq.enqueue_many(conn, tick, [{}] * 30)
        conn.execute(Q.declare_queues, {"names": ["lag"], "concurrencies": [None],
                                        "rate_limits": [rate.limit],
                                        "rate_periods": [rate.seconds], "worker": "t"})
    early = engine.connect()
    early.begin()
    early.execute(sa.text("SELECT now()"))  # its now() is fixed here, before the next claim
    assert len(claim(engine, "lag", 4)) == 4
    later = scalar(engine, "SELECT refilled_at FROM flowq.queues WHERE name = 'lag'")
    tokens = scalar(engine, "SELECT tokens FROM flowq.queues WHERE name = 'lag'")
    early.execute(Q.lock_queue, {"queue": "lag"})
    got = [r for r in early.execute(Q.claim_limited_jobs, {
        "queue": "lag", "limit": 30, "worker": "early", "scan": 100}) if r.id is not None]
    early.commit()
    early.close()
    assert len(got) <= tokens  # no token for the negative lag
    assert scalar(engine, "SELECT refilled_at FROM flowq.queues WHERE name = 'lag'") == later


ELSEWHERE = ("enqueue", "idempotency_key", "unique_key", "by name", "enqueue_many")


@pytest.mark.parametrize("how", ELSEWHERE)
def test_a_key_limit_holds_in_whatever_queue_the_job_is_enqueued_into(
        engine: sa.Engine, db_url: str, how: str) -> None:
    """Issue 20, #1: three jobs of one key, `key_concurrency=1`, enqueued with
    `queue="other"` (the task's own queue is "own"): three claimers with free slots, the
    real `Claimer`, start one of them; the others once it has finished."""
    app = flowq.FlowQ()

    @app.task(name="keyed_elsewhere", queue="own", concurrency_key="who", key_concurrency=1)
    def keyed(ctx: flowq.Context, who: str) -> None: ...

    with engine.begin() as conn:
        if how == "enqueue_many":
            flowq.enqueue_many(conn, keyed, [{"who": "a"}] * 3, queue="other")
        for i in range(3 if how != "enqueue_many" else 0):
            options: dict[str, Any] = {
                "enqueue": {}, "idempotency_key": {"idempotency_key": f"i{i}"},
                "unique_key": {"unique_key": f"u{i}"}, "by name": {}}[how]
            target: Any = "keyed_elsewhere" if how == "by name" else keyed
            flowq.enqueue(conn, target, queue="other", who="a", **options)
    claimed: list[ClaimedJob] = []
    connections = [DedicatedConnection(normalize_url(db_url), f"test claim {i}")
                   for i in range(3)]
    claimers = [Claimer(c, "flowq", ["other"], f"w{i}", claimed.append)
                for i, c in enumerate(connections)]
    try:
        # A claimer that has not re-read flowq.queues since the queue was marked takes its
        # plain path, which leaves the keyed queue alone; once it has, the limited path.
        assert claimers[0].run_once(3) == 0
        for c in claimers:
            c.refresh()
        assert sum(c.run_once(3) for c in claimers) == 1
        assert sum(c.run_once(3) for c in claimers) == 0
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE flowq.jobs SET status = 'succeeded' WHERE id = :id"),
                         {"id": claimed[0].id})
        assert sum(c.run_once(3) for c in claimers) == 1
        assert [j.queue for j in claimed] == ["other", "other"]
    finally:
        for c in connections:
            c.close()


def test_a_keyed_enqueue_into_a_keyed_queue_holds_no_lock_on_it(engine: sa.Engine) -> None:
    """Only the first keyed enqueue into a queue writes its `flowq.queues` row; later ones,
    held open in a producer's transaction, never make the queue's limited claims wait."""
    app = flowq.FlowQ()

    @app.task(name="keyed_no_lock", queue="own", concurrency_key="who")
    def keyed(ctx: flowq.Context, who: str) -> None: ...

    with engine.begin() as conn:
        flowq.enqueue(conn, keyed, queue="marked", who="a")
    for how in ("enqueue", "idempotency_key", "unique_key", "enqueue_many"):
        with engine.connect() as producer, engine.connect() as claimer:
            producer.begin()
            if how == "enqueue_many":
                flowq.enqueue_many(producer, keyed, [{"who": "b"}], queue="marked")
            else:
                flowq.enqueue(producer, keyed, queue="marked", who="b",
                              **({} if how == "enqueue" else {how: f"{how}-1"}))
            with claimer.begin():
                claimer.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
                assert claimer.execute(Q.lock_queue, {"queue": "marked"}).scalar() == "marked"
            producer.rollback()


def test_a_worker_start_marks_served_queues_holding_unmarked_keyed_jobs(
        engine: sa.Engine) -> None:
    """Keyed jobs an older flowq enqueued into another queue without marking it: a worker
    serving that queue marks it at start, so they are limited from then on."""
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO flowq.jobs (task, step, queue, concurrency_key, key_limit) "
            "VALUES ('t', 't', 'legacy', '\"a\"', 1), ('t', 't', 'legacy', '\"a\"', 1), "
            "('t', 't', 'plainq', NULL, NULL)"))
    registry = Registry(engine, "flowq", worker="w", queues=["legacy", "plainq", "own"],
                        tasks=["t"], concurrency=3)
    registry.declare_queues([], ["own"])
    with engine.connect() as conn:
        keyed = set(conn.execute(sa.text(
            "SELECT name FROM flowq.queues WHERE keyed")).scalars())
    assert {"legacy", "own"} <= keyed and "plainq" not in keyed
    assert len(claim(engine, "legacy", 10)) == 1


def test_a_worker_runs_one_job_of_a_key_at_a_time_in_another_queue(
        engine: sa.Engine, db_url: str) -> None:
    """The issue's case with a real worker of concurrency 3, in process: never more than
    one of the key's three jobs running at once, measured in the handler."""
    app = flowq.FlowQ()
    lock = threading.Lock()
    running, peak, finished = [0], [0], []

    @app.task(name="keyed_worker_elsewhere", queue="own", concurrency_key="who",
              key_concurrency=1)
    def keyed(ctx: flowq.Context, who: str) -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.2)  # long enough for the other slots to try to claim the key
        with lock:
            running[0] -= 1
            finished.append(ctx.job_id)

    with engine.begin() as conn:
        for _ in range(3):
            flowq.enqueue(conn, keyed, queue="other", who="a")
    worker = Worker(app, db_url, WorkerConfig(queues=["other"], concurrency=3,
                                              poll_interval=0.1, shutdown_grace=5))
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    thread.start()
    try:
        wait_until(lambda: len(finished) == 3, timeout=60, message="3 keyed jobs to finish")
    finally:
        worker.stop()
        thread.join(30)
    assert peak[0] == 1


# -- real workers ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_global_concurrency_limit_holds_across_four_workers(
        ledger: sa.Engine, db_url: str, spawn_worker: Any) -> None:
    with ledger.begin() as conn:
        flowq.enqueue_many(conn, qa.capped, [{"sleep": 0.005}] * 2000)
    workers = [spawn_worker("queues_app:app", db_url, "-c", "10", "--queues", "capped", *FAST)
               for _ in range(4)]
    wait_until(lambda: done(ledger, "capped") == 2000, timeout=300,
               message="2,000 capped jobs to finish")
    for w in workers:
        w.signal(15)
    rows = intervals(ledger, "capped")
    assert max_overlap(rows) <= 3
    assert max_overlap(rows) >= 2  # they did run in parallel, up to the cap


@pytest.mark.slow
def test_one_key_never_overlaps_while_other_keys_run_in_parallel(
        ledger: sa.Engine, db_url: str, spawn_worker: Any) -> None:
    with ledger.begin() as conn:
        flowq.enqueue_many(conn, qa.per_customer,
                           [{"customer": f"c{i % 4}", "sleep": 0.05} for i in range(160)])
    workers = [spawn_worker("queues_app:app", db_url, "-c", "8", "--queues", "keyed", *FAST)
               for _ in range(2)]
    wait_until(lambda: done(ledger, "per_customer") == 160, timeout=180,
               message="160 keyed jobs to finish")
    for w in workers:
        w.signal(15)
    rows = intervals(ledger, "per_customer")
    for key in ("c0", "c1", "c2", "c3"):
        assert max_overlap([r for r in rows if r.key == key]) == 1, key
    assert max_overlap(rows) >= 2


@pytest.mark.slow
def test_a_rate_limit_admits_its_rate(ledger: sa.Engine, db_url: str,
                                      spawn_worker: Any) -> None:
    with ledger.begin() as conn:
        flowq.enqueue_many(conn, qa.metered, [{}] * 1000)
    workers = [spawn_worker("queues_app:app", db_url, "-c", "10", "--queues", "metered",
                            *FAST) for _ in range(2)]
    wait_until(lambda: done(ledger, "metered") > 0, timeout=60, message="a first start")
    first = min(r.started for r in intervals(ledger, "metered"))
    time.sleep(max(0.0, first + 10.0 - time.time()) + 1.0)
    for w in workers:
        w.signal(15)
    for w in workers:
        w.wait(60)
    starts = [r.started for r in intervals(ledger, "metered")]
    in_ten = sum(1 for s in starts if s < first + 10.0)
    # A bucket of 20, refilled at 20/s: 20 + 10 * 20 over 10 s, give or take a period's worth.
    assert 200 - 20 <= in_ten <= 220 + 20, in_ten


@pytest.mark.slow
def test_a_paused_queue_is_left_alone_by_every_worker_and_resumes(
        ledger: sa.Engine, db_url: str, spawn_worker: Any) -> None:
    pause(ledger, "free")
    with ledger.begin() as conn:
        flowq.enqueue_many(conn, qa.free, [{}] * 50)
    workers = [spawn_worker("queues_app:app", db_url, "-c", "4", "--queues", "free", *FAST)
               for _ in range(2)]
    time.sleep(2.0)
    assert done(ledger, "free") == 0
    out = subprocess.run([sys.executable, "-m", "flowq", "queues", "--json", "--database-url",
                          db_url], capture_output=True, text=True, timeout=60, check=True)
    [free] = [q for q in json.loads(out.stdout)["queues"] if q["name"] == "free"]
    assert free["paused"] and free["pending"] == 50
    subprocess.run([sys.executable, "-m", "flowq", "queues", "resume", "free",
                    "--database-url", db_url], check=True, timeout=60, capture_output=True)
    wait_until(lambda: done(ledger, "free") == 50, timeout=60, message="resumed jobs to run")
    for w in workers:
        w.signal(15)


@pytest.mark.slow
@pytest.mark.parametrize("task", [qa.stubborn_sync, qa.stubborn_async])
def test_a_cancelled_handler_stops_within_a_heartbeat(engine: sa.Engine, db_url: str,
                                                      spawn_worker: Any,
                                                      task: flowq.Task[Any, Any]) -> None:
    with engine.begin() as conn:
        run = task.enqueue(conn, seconds=60.0)
    worker = spawn_worker("queues_app:app", db_url, "-c", "2", "--queues", "slow", *FAST)
    wait_until(lambda: get_run(engine, run.id).status == "running", timeout=60,
               message="the handler to start")
    cancel_run(engine, run.id)
    t0 = time.monotonic()
    wait_until(lambda: get_run(engine, run.id).finished_at is not None, timeout=30,
               message="the cancelled handler to stop")
    assert time.monotonic() - t0 < 5.0  # a heartbeat is 0.5 s here; generous for CI
    info = get_run(engine, run.id)
    assert info.status == "cancelled" and info.steps[0].status == "cancelled"
    worker.signal(15)
    assert worker.wait(60) == 0
