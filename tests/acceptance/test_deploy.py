"""Acceptance: a deploy under 1,000 runs in flight between steps (issue 23).

One worker of version A of an app (tests/apps/deploy_a.py) and one of version B
(deploy_b.py: a step removed, a step renamed, an argument added, a join parent added, and a
pipeline kept as version 1 beside a version 2) over one database. A runs the first step of
1,000 runs (two batches of 100 per pipeline), whose second steps wait (`deploy_a.GATE`).
Then:

1. the deploy check of B names exactly the runs B cannot continue, and none of the
   versioned pipeline's;
2. with A and B live, batch 1 is made due: every run finishes; each job B cannot run is
   left to A (its attempt given back) and run by A, the ledger says so;
3. A stops; batch 2 is made due: each job B cannot run ends dead with the sentence naming
   the mismatch and the fix, every other run finishes, nothing is left active (nothing
   waits unseen), and the check then says version 1 of `versioned` drained.
"""

from __future__ import annotations

import signal
from collections import Counter

import deploy_a
import deploy_b
import pytest
import sqlalchemy as sa
from support import Spawn, assert_no_crash_lines, rows, scalar

from flowq.ops.deploy import check_deploy
from flowq.testing import wait_until

FAST = ("--concurrency", "8", "--heartbeat-interval", "0.5", "--stale-after", "3",
        "--reap-interval", "0.5", "--poll-interval", "0.5")
PER_BATCH = 100  # runs per pipeline per batch: 5 pipelines x 2 batches = 1,000 runs
LAST = {"chain": "c", "rename": "r", "argchange": "u", "fanin": "z", "versioned": "v_c"}
ACTIVE = "status IN ('pending', 'running', 'waiting')"


def _active(engine: sa.Engine, runs: list[int]) -> int:
    return int(scalar(engine, f"SELECT count(*) FROM flowq.steps WHERE {ACTIVE} "
                      "AND run_id = ANY(:r)", r=runs))


def _release(engine: sa.Engine, runs: list[int]) -> None:
    """Make the waiting second steps of `runs` due now."""
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.jobs SET run_at = now() WHERE status = 'pending' "
                             "AND run_id = ANY(:r)"), {"r": runs})


@pytest.mark.slow
def test_a_deploy_under_runs_in_flight(engine: sa.Engine, db_url: str,
                                       spawn_worker: Spawn) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(deploy_a.LEDGER_DDL)
        batches = [{p.name: [p.enqueue(conn, n=i).id for i in range(PER_BATCH)]
                    for p in deploy_a.app} for _ in range(2)]
    one, two = ([r for runs in b.values() for r in runs] for b in batches)
    assert len(one) + len(two) == 1_000
    a = spawn_worker("deploy_a:app", db_url, *FAST)
    # A runs every first step; the second steps wait (pending, due in an hour).
    wait_until(lambda: scalar(engine, "SELECT count(*) FROM deploy_ledger") == 1_000,
               timeout=120, interval=0.2, message="A to run the 1,000 first steps")

    # 1. The check names exactly the runs B cannot continue.
    wait_until(lambda: scalar(engine, "SELECT count(*) FROM flowq.steps WHERE status = "
                              "'pending'") == 1_200, timeout=30, message="1,200 steps waiting")
    report = check_deploy(engine, deploy_b.app)
    assert not report.ok
    by = {p.pipeline: p for p in report.pipelines}
    assert by["versioned"].compatible
    for name, steps in deploy_a.STRANDED.items():
        assert sorted(s.runs for s in by[name].stranded) == [2 * PER_BATCH] * len(steps), name
        assert {s.example_run_id for s in by[name].stranded} == {batches[0][name][0]}
        assert all(len(s.served_by) == 1 for s in by[name].stranded)  # A, still live
    assert sum(s.runs for s in report.stranded) == 2 * PER_BATCH * 5  # fanin's twice

    # 2. A and B live: every run of batch 1 finishes; what B cannot run, A runs.
    b = spawn_worker("deploy_b:app", db_url, *FAST)
    wait_until(lambda: scalar(engine, "SELECT count(*) FROM flowq.workers WHERE definitions "
                              "IS NOT NULL") == 2, timeout=60, message="B registered")
    with engine.begin() as conn:  # new runs start on the newest version, B's version 2
        newest = [deploy_b.versioned.enqueue(conn, n=i).id for i in range(20)]
    wait_until(lambda: _active(engine, newest) == 20 and scalar(
        engine, "SELECT count(*) FROM flowq.steps WHERE step = 'w_b' AND status = 'pending'")
        == 20, timeout=60, message="B to run the new runs' first steps")
    _release(engine, one + newest)
    wait_until(lambda: _active(engine, one + newest) == 0, timeout=180, interval=0.5,
               message="batch 1 to finish with A and B live")
    assert scalar(engine, "SELECT count(*) FROM flowq.steps WHERE status = 'dead'") == 0
    ran = Counter((r.step, r.release) for r in rows(
        engine, "SELECT l.step, l.release FROM deploy_ledger l WHERE l.run_id = ANY(:r)",
        r=one))
    for name, steps in deploy_a.STRANDED.items():
        for step in (*steps, *("z" if name == "fanin" else ())):
            assert ran[step, "A"] == PER_BATCH and ran[step, "B"] == 0, (step, ran)
        assert ran[LAST[name], "A"] + ran[LAST[name], "B"] == PER_BATCH, name
    assert ran["v_b", "A"] + ran["v_b", "B"] == PER_BATCH
    handed = scalar(engine, "SELECT count(*) FROM flowq.steps WHERE run_id = ANY(:r) "
                    "AND last_error LIKE 'left to worker %'", r=one)
    assert handed > 0  # B claimed some of them and left them to A
    assert scalar(engine, "SELECT count(*) FROM deploy_ledger WHERE step = 'w_c' AND "
                  "release = 'B'") == 20

    # 3. A stops: what B cannot run ends dead with the sentence; the rest finishes.
    a.signal(signal.SIGTERM)
    assert a.wait(timeout=60) == 0
    wait_until(lambda: scalar(engine, "SELECT count(*) FROM flowq.workers") == 1,
               timeout=30, message="A's registry entry gone")
    _release(engine, two)
    wait_until(lambda: _active(engine, two) == 0, timeout=180, interval=0.5,
               message="batch 2 to end with B alone")
    dead = rows(engine, "SELECT j.task, j.step, j.run_id, j.attempts, j.last_error "
                "FROM flowq.steps j WHERE j.status = 'dead'")
    assert Counter(d.task for d in dead) == {
        "chain": PER_BATCH, "rename": PER_BATCH, "argchange": PER_BATCH,
        "fanin": 2 * PER_BATCH}
    for d in dead:
        assert d.step in deploy_a.STRANDED[d.task] and d.attempts == 1, d
        assert d.last_error.startswith(f"UnknownTaskError: run {d.run_id} (started under "
                                       "definition "), d.last_error
        assert "no live worker serves a definition that can run it" in d.last_error
        assert f"`flowq runs fork {d.run_id}`" in d.last_error
    finished = {r.run_id for r in rows(engine, "SELECT DISTINCT run_id FROM deploy_ledger "
                                       "WHERE step = 'v_c'")}
    assert set(batches[1]["versioned"]) <= finished
    after = check_deploy(engine, deploy_b.app)
    assert after.ok
    assert any("drained: version 1" in line for line in after.lines())
    assert_no_crash_lines(a, b)
