"""Durable execution with real `flowq worker` processes: checkpoints across a SIGKILL, a
zombie's checkpoint (SIGSTOP past the stale limit, then SIGCONT), and 1,000 durable sleeps
that hold no slot and survive a worker restart.

The app is tests/apps/durable_app.py. Each checkpoint logs its call on a connection of its
own (`durable_calls`, whatever becomes of the checkpoint) and writes its effect in the
session that commits with the checkpoint's record (`durable_effects`): so the ledger tells
what ran, and what committed, apart. Time is never asserted; tests wait on conditions.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import durable_app
import pytest
import sqlalchemy as sa
from support import WorkerProcess, enqueue_id, held_when_killed, rows, scalar, stop_workers

import flowq
from flowq.testing import wait_until

APP = "durable_app:app"
FAST = ["--poll-interval", "0.1", "--stale-after", "2", "--heartbeat-interval", "0.5",
        "--reap-interval", "0.5"]
Spawn = Callable[..., WorkerProcess]


@pytest.fixture
def durable(engine: sa.Engine, db_url: str, spawn_worker: Spawn) -> Callable[..., WorkerProcess]:
    """Workers of the durable app, with its ledger tables created and their URL given."""
    with engine.begin() as conn:
        conn.exec_driver_sql(durable_app.LEDGER_DDL)

    def spawn(*args: str) -> WorkerProcess:
        return spawn_worker(APP, db_url, *args, env={"DURABLE_LEDGER_URL": db_url})

    return spawn


def recorded(engine: sa.Engine, run_id: int) -> list[str]:
    return [r.name for r in rows(engine, "SELECT name FROM flowq.checkpoints WHERE run_id = :r "
                                         "ORDER BY position", r=run_id)]


def ledger(engine: sa.Engine, table: str, run_id: int) -> list[tuple[str, int]]:
    return [(r.name, r.attempt) for r in rows(
        engine, f"SELECT name, attempt FROM {table} WHERE run_id = :r ORDER BY id"
        if table == "durable_calls" else
        f"SELECT name, attempt FROM {table} WHERE run_id = :r ORDER BY name", r=run_id)]


def status(engine: sa.Engine, run_id: int) -> str:
    return str(scalar(engine, "SELECT status FROM flowq.steps WHERE run_id = :r", r=run_id))


def test_a_step_killed_after_its_third_checkpoint_runs_only_the_fourth_and_fifth_again(
        engine: sa.Engine, durable: Spawn) -> None:
    """SIGKILL while the first attempt holds after checkpoint 3: the retry replays 1-3
    without calling them and calls 4 and 5 once; every effect committed with its record."""
    first = durable(*FAST)
    run_id = enqueue_id(engine, durable_app.five, hold_after=3)
    wait_until(lambda: len(recorded(engine, run_id)) == 3, timeout=60,
               message="three checkpoints recorded")
    first.signal(signal.SIGKILL)
    held_when_killed(engine, first.pid)
    second = durable(*FAST)
    wait_until(lambda: status(engine, run_id) == "succeeded", timeout=60,
               message="the run succeeded on the retry")
    stop_workers(second)
    assert ledger(engine, "durable_calls", run_id) == [
        ("c1", 1), ("c2", 1), ("c3", 1), ("c4", 2), ("c5", 2)]
    assert ledger(engine, "durable_effects", run_id) == [
        ("c1", 1), ("c2", 1), ("c3", 1), ("c4", 2), ("c5", 2)]
    assert recorded(engine, run_id) == ["c1", "c2", "c3", "c4", "c5"]
    job = rows(engine, "SELECT attempts, result FROM flowq.steps WHERE run_id = :r", r=run_id)[0]
    assert job.attempts == 2 and job.result == {"by": [1, 1, 1, 2, 2]}


def test_a_zombie_records_no_checkpoint_and_commits_none_of_its_writes(
        engine: sa.Engine, durable: Spawn) -> None:
    """Worker A is frozen (SIGSTOP) holding after checkpoint 2 until past the stale limit; B
    reaps the job and finishes it; A, thawed, calls checkpoint 3: its record is fenced out,
    and the effect it wrote in that checkpoint's session rolls back with it."""
    zombie = durable(*FAST)
    run_id = enqueue_id(engine, durable_app.five, hold_after=2)
    wait_until(lambda: len(recorded(engine, run_id)) == 2, timeout=60,
               message="two checkpoints recorded")
    zombie.signal(signal.SIGSTOP)
    try:
        rescuer = durable(*FAST)
        wait_until(lambda: status(engine, run_id) == "succeeded", timeout=60,
                   message="the rescuer finished the run")
        with engine.begin() as conn:  # let the zombie's handler go on, once thawed
            conn.execute(sa.text("INSERT INTO durable_gates VALUES (:r)"), {"r": run_id})
    finally:
        zombie.signal(signal.SIGCONT)
    wait_until(lambda: ("c3", 1) in ledger(engine, "durable_calls", run_id), timeout=60,
               message="the zombie called checkpoint 3")
    wait_until(lambda: "no longer holds its claim" in zombie.log()
               or "dropped: the job is no longer ours" in zombie.log(), timeout=60,
               message="the zombie's attempt ended, fenced out")
    stop_workers(zombie, rescuer)
    assert ledger(engine, "durable_effects", run_id) == [
        ("c1", 1), ("c2", 1), ("c3", 2), ("c4", 2), ("c5", 2)]
    assert recorded(engine, run_id) == ["c1", "c2", "c3", "c4", "c5"]
    assert scalar(engine, "SELECT result FROM flowq.steps WHERE run_id = :r",
                  r=run_id) == {"by": [1, 1, 2, 2, 2]}


def test_a_thousand_sleepers_hold_no_slot_survive_a_restart_and_spend_no_attempt(
        engine: sa.Engine, durable: Spawn) -> None:
    """1,000 runs each sleeping 2 s on one `-c 4` worker: far more than 4 are asleep at once
    (pending, due later, their sleep recorded), the worker is restarted while they sleep,
    and every run ends succeeded on its first attempt, after its recorded deadline."""
    with sa.orm.Session(engine) as s:
        run_ids = flowq.enqueue_many(s, durable_app.nap, [{"seconds": 2.0}] * 1000)
        s.commit()
    asleep_at_once = 0

    def asleep() -> int:
        nonlocal asleep_at_once
        n = int(scalar(engine, "SELECT count(*) FROM flowq.steps WHERE status = 'pending' "
                               "AND run_at > now()"))
        asleep_at_once = max(asleep_at_once, n)
        return n

    def sleeps_recorded() -> int:
        asleep()
        return int(scalar(engine, "SELECT count(*) FROM flowq.checkpoints "
                                  "WHERE name = 'flowq.sleep.0'"))

    worker = durable("-c", "4", "--poll-interval", "0.2")
    wait_until(lambda: sleeps_recorded() >= 300, timeout=120, interval=0.05,
               message="300 runs asleep")
    stop_workers(worker)  # a restart while they sleep
    worker = durable("-c", "4", "--poll-interval", "0.2")

    def finished() -> bool:
        asleep()
        return int(scalar(engine, "SELECT count(*) FROM flowq.steps WHERE status = 'succeeded'"
                          )) == 1000

    wait_until(finished, timeout=180, interval=0.05, message="all 1,000 runs succeeded")
    stop_workers(worker)
    assert asleep_at_once >= 100, asleep_at_once  # a sleep held a slot: at most 4 could be
    summary = rows(engine, """
        SELECT count(*) AS n, count(*) FILTER (WHERE j.attempts = 1) AS first_attempt,
               count(*) FILTER (WHERE j.result = '{"attempt": 1}') AS said_first,
               count(*) FILTER (WHERE j.finished_at >= (k.result->>'until')::timestamptz)
                   AS after_deadline,
               count(DISTINCT k.run_id) AS slept
          FROM flowq.steps j JOIN flowq.checkpoints k
            ON k.run_id = j.run_id AND k.name = 'flowq.sleep.0'
         WHERE j.run_id = ANY(:ids)""", ids=run_ids)[0]
    assert tuple(summary) == (1000, 1000, 1000, 1000, 1000)
