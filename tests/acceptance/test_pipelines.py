"""Pipelines end to end, with real `flowq worker` processes (tests/apps/pipeline_app.py).

Every step writes one ledger row through `ctx.session`, committed with the step's success, so
the ledger says exactly which steps took effect and how often. Run state is read through the
CLI's `--json` output (`flowq runs ...`, invoked in-process) and the jobs table.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pipeline_app as pa
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from support import Spawn, enqueue, rows, scalar

import flowq
from flowq.cli import main
from flowq.testing import job_rows, wait_until

FAST_POLL = ("--poll-interval", "0.1")
FAST_REAP = ("--stale-after", "2", "--heartbeat-interval", "0.5", "--reap-interval", "0.5")

def runs_cli(db_url: str, *args: str) -> dict[str, Any]:
    """`flowq runs ARGS --json`, in-process; its parsed output."""
    result = CliRunner().invoke(main, ["runs", *args, "--json", "--database-url", db_url])
    assert result.exit_code == 0, (result.output, result.exception)
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def ledger_counts(engine: sa.Engine, step: str) -> dict[int, int]:
    """run_id -> how many ledger rows `step` committed for it."""
    return {r.run_id: r.n for r in rows(
        engine, "SELECT run_id, count(*) AS n FROM pipeline_ledger WHERE step = :s "
        "GROUP BY run_id", s=step)}


def job(engine: sa.Engine, run_id: int, step: str) -> Any:
    found = job_rows(engine, where="run_id = :r AND step = :s", r=run_id, s=step)
    return found[0] if found else None


@pytest.mark.slow
def test_500_runs_with_a_step_failing_twice_all_succeed_once(
        ledger: sa.Engine, db_url: str, spawn_worker: Spawn) -> None:
    with ledger.begin() as conn:
        run_ids = flowq.enqueue_many(conn, pa.chain3,
                                     [{"n": i, "fail_times": 2} for i in range(500)])
    for _ in range(2):
        spawn_worker("pipeline_app:app", db_url, "--concurrency", "8", "--no-job-log",
                     *FAST_POLL)

    wait_until(lambda: scalar(ledger, "SELECT count(*) FROM flowq.steps WHERE step = 'finish' "
                                      "AND status = 'succeeded'") == 500,
               timeout=240, interval=0.2, message="500 runs to finish")

    by_step = rows(ledger, "SELECT step, status, attempts, count(*) AS n FROM flowq.steps "
                           "GROUP BY 1, 2, 3 ORDER BY 1")
    assert {(r.step, r.status, r.attempts, r.n) for r in by_step} == {
        ("create", "succeeded", 1, 500), ("flaky", "succeeded", 3, 500),
        ("finish", "succeeded", 1, 500)}
    expected = dict.fromkeys(run_ids, 1)
    assert ledger_counts(ledger, "create") == expected
    assert ledger_counts(ledger, "flaky") == expected  # the failed attempts rolled back
    assert ledger_counts(ledger, "finish") == expected
    # Step 3 received step 2's output, and the run's result is step 3's.
    mismatched = scalar(ledger, """
        SELECT count(*) FROM flowq.steps f JOIN flowq.steps s
          ON s.run_id = f.run_id AND s.step = 'finish'
         WHERE f.step = 'flaky'
           AND (s.args <> f.result OR s.result->>'done' <> f.result->>'token'
                OR f.result->>'token' <> format('tok-%s-%s', f.args->>'n',
                                                (f.args->>'n')::int * 10))""")
    assert mismatched == 0
    shown = runs_cli(db_url, "show", str(run_ids[123]))
    assert shown["status"] == "succeeded"
    assert shown["result"] == {"n": 123, "done": "tok-123-1230"}


@pytest.mark.slow
def test_sigkill_during_step_two_every_run_finishes_with_steps_once(
        ledger: sa.Engine, db_url: str, spawn_worker: Spawn) -> None:
    with ledger.begin() as conn:
        run_ids = flowq.enqueue_many(conn, pa.chain3,
                                     [{"n": i, "sleep": 1.5} for i in range(40)])
    first = spawn_worker("pipeline_app:app", db_url, "--concurrency", "20", *FAST_POLL,
                         *FAST_REAP)
    wait_until(lambda: scalar(ledger, "SELECT count(*) FROM flowq.steps WHERE step = 'flaky' "
                                      "AND status = 'running'") >= 10,
               timeout=60, message="step two of many runs to be running")
    first.signal(signal.SIGKILL)
    first.wait(timeout=30)
    killed = {r.id for r in job_rows(ledger, where="step = 'flaky' AND status = 'running'")}
    assert killed

    spawn_worker("pipeline_app:app", db_url, "--concurrency", "20", *FAST_POLL, *FAST_REAP)
    wait_until(lambda: scalar(ledger, "SELECT count(*) FROM flowq.steps WHERE step = 'finish' "
                                      "AND status = 'succeeded'") == 40,
               timeout=120, interval=0.2, message="all runs to finish")

    assert {r.status for r in job_rows(ledger)} == {"succeeded"}
    expected = dict.fromkeys(run_ids, 1)
    assert ledger_counts(ledger, "create") == expected
    assert ledger_counts(ledger, "flaky") == expected
    assert ledger_counts(ledger, "finish") == expected
    for r in job_rows(ledger, where="id = ANY(:ids)", ids=list(killed)):
        assert r.attempts == 2
        assert r.last_error.startswith("WorkerLost:")


def test_cancel_while_a_step_runs_it_finishes_without_a_successor(
        ledger: sa.Engine, db_url: str, spawn_worker: Spawn, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    run = enqueue(ledger, pa.gated, n=1, gate=str(gate))
    spawn_worker("pipeline_app:app", db_url, *FAST_POLL)
    wait_until(lambda: (j := job(ledger, run.id, "gate_wait")) and j.status == "running",
               timeout=60, message="the gated step to run")

    cancelled = runs_cli(db_url, "cancel", str(run.id))
    waiting = job(ledger, run.id, "gate_wait")
    assert cancelled["cancelled_job_ids"] == []
    assert cancelled["cancel_requested_job_ids"] == [waiting.id]
    assert cancelled["run"]["status"] == "cancelled"
    assert cancelled["run"]["finished_at"] is None  # its running step has not stopped yet

    gate.touch()
    wait_until(lambda: job(ledger, run.id, "gate_wait").status == "succeeded", timeout=60,
               message="the running step to finish")
    # The successor would have been inserted in the very transaction that marked it done.
    assert job(ledger, run.id, "gate_after") is None
    shown = runs_cli(db_url, "show", str(run.id))
    assert shown["status"] == "cancelled" and shown["finished_at"] is not None
    assert [(s["step"], s["status"]) for s in shown["steps"]] == [
        ("gate_open", "succeeded"), ("gate_wait", "succeeded")]
    assert ledger_counts(ledger, "gate_wait") == {run.id: 1}  # its own writes committed


def test_a_result_that_does_not_fit_the_next_step_ends_the_run_dead(
        ledger: sa.Engine, db_url: str, spawn_worker: Spawn) -> None:
    run = enqueue(ledger, pa.misfit, n=3)
    spawn_worker("pipeline_app:app", db_url, *FAST_POLL)
    wait_until(lambda: job(ledger, run.id, "produce").status == "dead", timeout=60,
               message="the misfit step to die")

    shown = runs_cli(db_url, "show", str(run.id))
    assert shown["status"] == "dead"
    [step] = shown["steps"]  # no broken next row
    assert step["attempts"] == 1  # retrying cannot make the result fit
    first_line = step["last_error"].splitlines()[0]
    assert first_line.startswith("InvalidResultError: the result of step 'produce' do not fit "
                                 "step 'consume'")
    assert "unexpected keyword argument(s) 'wrong'" in first_line
    assert ledger_counts(ledger, "produce") == {}  # its ctx.session writes rolled back


@pytest.mark.slow
def test_renamed_pipeline_and_removed_step_end_dead_with_the_reason_then_retry(
        ledger: sa.Engine, db_url: str, spawn_worker: Spawn) -> None:
    deployed = enqueue(ledger, pa.deploy, n=2)
    old = spawn_worker("pipeline_app:app", db_url, "--queues", "default", *FAST_POLL)
    wait_until(lambda: (j := job(ledger, deployed.id, "second")) and j.status == "pending",
               timeout=60, message="step 'second' to be enqueued")
    old.signal(signal.SIGTERM)
    assert old.wait(timeout=60) == 0
    # A producer still on the old code enqueues a pipeline the new deploy renamed.
    renamed = enqueue(ledger, pa.renamed, n=1)

    new = spawn_worker("pipeline_app:app_v2", db_url, "--queues", "default,deploy2", *FAST_POLL)
    wait_until(lambda: job(ledger, renamed.id, "start").status == "dead"
               and job(ledger, deployed.id, "second").status == "dead",
               timeout=90, interval=0.2, message="both runs to die after their attempt caps")
    assert new.proc.poll() is None  # never a crash

    gone = runs_cli(db_url, "show", str(renamed.id))
    assert gone["status"] == "dead"
    assert gone["steps"][0]["attempts"] == 3
    assert gone["steps"][0]["last_error"].startswith(
        "UnknownTaskError: no task or pipeline named 'renamed' is registered")
    removed = runs_cli(db_url, "show", str(deployed.id))
    assert removed["status"] == "dead"
    # A step removed while runs wait to run it: dead at its first attempt, saying why and
    # what to do (flowq.worker.resolution.resolve; no other worker serves the old definition).
    assert [(s["step"], s["status"], s["attempts"]) for s in removed["steps"]] == [
        ("first", "succeeded", 1), ("second", "dead", 1)]
    assert removed["steps"][1]["last_error"].startswith(
        f"UnknownTaskError: run {deployed.id} (started under definition ")
    assert "step 'second' was removed" in removed["steps"][1]["last_error"]

    # Deploying the step again and retrying the run finishes it without re-running 'first'.
    new.signal(signal.SIGTERM)
    assert new.wait(timeout=60) == 0
    spawn_worker("pipeline_app:app", db_url, *FAST_POLL)
    retried = runs_cli(db_url, "retry", str(deployed.id))
    assert retried["retried_step"] == "second"
    wait_until(lambda: runs_cli(db_url, "show", str(deployed.id))["status"] == "succeeded",
               timeout=60, interval=0.2, message="the retried run to succeed")
    assert ledger_counts(ledger, "first") == {deployed.id: 1}
    assert ledger_counts(ledger, "second") == {deployed.id: 1}


def test_idempotency_key_is_stable_per_step_and_distinct_across_steps_and_runs(
        ledger: sa.Engine, db_url: str, spawn_worker: Spawn) -> None:
    runs = [enqueue(ledger, pa.keys, n=i) for i in range(2)]
    spawn_worker("pipeline_app:app", db_url, *FAST_POLL)
    seen: list[str] = []
    for run in runs:
        wait_until(lambda r=run: runs_cli(db_url, "show", str(r.id))["status"] == "succeeded",
                   timeout=60, interval=0.2, message="the keys run to succeed")
        shown = runs_cli(db_url, "show", str(run.id))
        a, b = shown["steps"]
        for step in (a, b):
            assert step["attempts"] == 2
        # The failed first attempt saw the same key as the attempt that succeeded.
        assert a["last_error"].startswith(f"RuntimeError: key={a['result']['key_a']}\n")
        assert b["last_error"].startswith(f"RuntimeError: key={b['result']['key_b']}\n")
        seen += [b["result"]["key_a"], b["result"]["key_b"]]
    assert len(set(seen)) == 4


def test_a_step_on_another_queue_runs_only_on_a_worker_serving_it(
        ledger: sa.Engine, db_url: str, spawn_worker: Spawn) -> None:
    run = enqueue(ledger, pa.queued, n=1)
    local = spawn_worker("pipeline_app:app", db_url, "--queues", "default", *FAST_POLL)
    wait_until(lambda: (j := job(ledger, run.id, "report")) and j.status == "pending",
               timeout=60, message="the 'reports' step to be enqueued")
    # A run enqueued later on 'default' finishes: the local worker kept claiming meanwhile.
    marker = enqueue(ledger, pa.chain3, n=9)
    wait_until(lambda: (j := job(ledger, marker.id, "finish")) and j.status == "succeeded",
               timeout=60, message="a later default run to finish")
    report = job(ledger, run.id, "report")
    assert (report.status, report.attempts, report.queue) == ("pending", 0, "reports")

    reports = spawn_worker("pipeline_app:app", db_url, "--queues", "reports", *FAST_POLL)
    wait_until(lambda: (j := job(ledger, run.id, "local_2")) and j.status == "succeeded",
               timeout=60, message="the run to finish")
    where = {r.step: (r.pid, r.queue) for r in rows(
        ledger, "SELECT step, pid, queue FROM pipeline_ledger WHERE run_id = :r", r=run.id)}
    assert where == {"local_1": (local.pid, "default"), "report": (reports.pid, "reports"),
                     "local_2": (local.pid, "default")}


def test_per_step_timeout_and_attempt_cap(ledger: sa.Engine, db_url: str,
                                          spawn_worker: Spawn) -> None:
    run = enqueue(ledger, pa.policies, n=1)
    worker = spawn_worker("pipeline_app:app", db_url, *FAST_POLL)
    wait_until(lambda: (j := job(ledger, run.id, "always_fails")) and j.status == "dead",
               timeout=60, message="the capped step to die")
    slow, capped = job(ledger, run.id, "slow_once"), job(ledger, run.id, "always_fails")
    assert (slow.status, slow.attempts, slow.max_attempts) == ("succeeded", 2, 3)
    assert slow.last_error.startswith("StepTimeout: step 'slow_once' of 'policies' exceeded "
                                      "its timeout of 0.5s")
    assert (capped.status, capped.attempts, capped.max_attempts) == ("dead", 2, 2)
    assert capped.last_error.startswith("ValueError: always fails (attempt 2)")
    # The timed-out attempt's late result is discarded, its ctx.session writes rolled back.
    wait_until(lambda: "late result of an abandoned attempt discarded" in worker.log(),
               timeout=30, message="the abandoned attempt to return")
    assert [r.attempt for r in rows(ledger, "SELECT attempt FROM pipeline_ledger "
                                            "WHERE step = 'slow_once'")] == [2]
