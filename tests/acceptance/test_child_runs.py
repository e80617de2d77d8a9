"""Child runs with real `flowq worker` processes: a parent starting 100 children, its worker
SIGKILLed while it starts them, finished by a `-c 1` worker (so the waiting parent holds no
slot: its one slot runs the parent and all the children).

The app is tests/apps/children_app.py. Every start and child call is logged on a connection
of its own (`children_calls`, whatever becomes of it); effects are written in `ctx.session`
(`children_effects`, committed with the step's success): so the ledger tells what ran and
what committed apart. Time is never asserted; tests wait on conditions.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import children_app
import sqlalchemy as sa
from support import WorkerProcess, held_when_killed, rows, scalar, stop_workers

import flowq
from flowq.testing import wait_until

APP = "children_app:app"
FAST = ["--poll-interval", "0.1", "--stale-after", "2", "--heartbeat-interval", "0.5",
        "--reap-interval", "0.5"]
CHILDREN = 100


def test_a_parent_of_a_hundred_children_killed_mid_way_starts_each_once_and_gets_each_result(
        engine: sa.Engine, db_url: str, spawn_worker: Callable[..., WorkerProcess]) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(children_app.LEDGER_DDL)
    env = {"CHILDREN_LEDGER_URL": db_url}
    first = spawn_worker(APP, db_url, *FAST, "--concurrency", "4", env=env)
    with sa.orm.Session(engine) as s:
        run_id = flowq.enqueue(s, children_app.fan_out, count=CHILDREN).id
        s.commit()

    def links() -> int:
        return int(scalar(engine, "SELECT count(*) FROM flowq.children "
                                  "WHERE parent_run_id = :r", r=run_id))

    wait_until(lambda: links() >= 30, timeout=60, message="30 children started")
    first.signal(signal.SIGKILL)
    held_when_killed(engine, first.pid)
    assert links() < CHILDREN, "the parent finished starting before the kill"
    # One slot: the parent waits without holding it, or its children could never run.
    second = spawn_worker(APP, db_url, *FAST, "--concurrency", "1", env=env)
    wait_until(lambda: scalar(engine, "SELECT status FROM flowq.steps WHERE run_id = :r",
                              r=run_id) == "succeeded", timeout=120,
               message="the parent succeeded")
    stop_workers(second)

    children = [r.run_id for r in rows(engine, "SELECT run_id FROM flowq.children "
                                               "WHERE parent_run_id = :r ORDER BY run_id",
                                       r=run_id)]
    # Every child was started once: 100 links, 100 child runs, one per argument.
    assert len(children) == CHILDREN
    args = rows(engine, "SELECT run_id, args FROM flowq.steps WHERE task = 'square'")
    assert sorted(r.run_id for r in args) == children
    assert sorted(r.args["n"] for r in args) == list(range(CHILDREN))
    # Each start was returned the same child on every attempt that reached it.
    starts = rows(engine, "SELECT child, attempt FROM children_calls WHERE run_id = :r "
                          "AND what = 'start' ORDER BY id", r=run_id)
    assert {r.child for r in starts} == set(children)
    assert {r.attempt for r in starts} >= {1, 2}
    # Each child's effect committed once, and the parent's once, with every result in order.
    assert scalar(engine, "SELECT count(*) FROM children_effects WHERE what = 'square'"
                  ) == CHILDREN
    assert scalar(engine, "SELECT count(*) FROM children_effects WHERE what = 'fan_out'") == 1
    result = scalar(engine, "SELECT result FROM flowq.steps WHERE run_id = :r", r=run_id)
    assert result["squares"] == [i * i for i in range(CHILDREN)]
    assert sorted(result["children"]) == children
    # The waits gave their attempts back: the parent spent two (the killed one, the retry).
    assert scalar(engine, "SELECT attempts FROM flowq.steps WHERE run_id = :r", r=run_id) == 2
