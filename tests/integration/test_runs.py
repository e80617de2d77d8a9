"""flowq.runs and `flowq runs`: inspect, cancel and retry runs against a real PostgreSQL.

Runs are driven by an in-process worker (`flowq.testing.run_until_idle`) over the pipelines
of tests/apps/pipeline_app.py; the acceptance tests with real worker processes are in
test_pipelines.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pipeline_app as pa
import pytest
import sqlalchemy as sa
from runs_cli import cli, cli_json
from support import enqueue

import flowq
from flowq.db.sql import Queries
from flowq.ops.runs import cancel_run, get_run, list_runs, retry_run
from flowq.testing import job_rows, run_until_idle, wait_until

RUN_KEYS = {"run_id", "task", "status", "cancel_requested", "idempotency_key", "created_at",
            "finished_at", "result", "steps", "graph", "checkpoints", "forked_from",
            "deadline", "fingerprint", "version", "parent", "children"}
STEP_KEYS = {"job_id", "step", "index", "queue", "status", "attempts", "max_attempts",
             "cancel_requested", "run_at", "created_at", "locked_at", "heartbeat_at",
             "locked_by", "finished_at", "last_error", "args", "result", "map_index",
             "last_error_earlier", "started_at", "history", "progress"}


def work(db_url: str, queues: tuple[str, ...] = ("default",)) -> None:
    run_until_idle(pa.app, db_url, queues=list(queues))


def ledger_steps(engine: sa.Engine, run_id: int) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text(
            "SELECT step FROM pipeline_ledger WHERE run_id = :r ORDER BY id"), {"r": run_id}
        ).scalars())


def test_unknown_run_is_a_clear_error(engine: sa.Engine, db_url: str) -> None:
    with pytest.raises(flowq.RunNotFoundError, match="no run 12345"):
        get_run(engine, 12345)
    code, _, err = cli(db_url, "show", str(2**70))
    assert code == 2 and "no run 1180591620717411303424 exists" in err
    for command in ("show", "cancel", "retry"):
        code, out, err = cli(db_url, command, "12345")
        assert code == 2
        assert out == ""
        assert "no run 12345 exists" in err
        assert len(err.strip().splitlines()) == 1
        assert "Traceback" not in err


def test_show_a_succeeded_run(ledger: sa.Engine, db_url: str) -> None:
    run = enqueue(ledger, pa.chain3, n=4, fail_times=1, idempotency_key="show-me")
    work(db_url)

    info = get_run(ledger, run.id)
    assert info.status == "succeeded"
    assert info.task == "chain3"
    assert info.idempotency_key == "show-me"
    assert info.result == {"n": 4, "done": "tok-4-40"}
    assert [s.step for s in info.steps] == ["create", "flaky", "finish"]
    assert [s.index for s in info.steps] == [0, 1, 2]
    assert [s.attempts for s in info.steps] == [1, 2, 1]
    assert info.steps[1].last_error is not None
    assert info.steps[1].last_error.startswith("RuntimeError: flaky failure 1")
    # it succeeded on its second attempt: the error is labelled as the first's
    assert [s.last_error_earlier for s in info.steps] == [False, True, False]
    assert info.steps[2].args == {"n": 4, "token": "tok-4-40"}
    assert info.finished_at == info.steps[2].finished_at

    data = cli_json(db_url, "show", str(run.id))
    assert set(data) == RUN_KEYS
    assert all(set(s) == STEP_KEYS for s in data["steps"])
    assert data["status"] == "succeeded"
    assert data["result"] == {"n": 4, "done": "tok-4-40"}
    assert data["steps"][1]["attempts"] == 2
    assert data["steps"][1]["last_error_earlier"] is True

    code, out, _ = cli(db_url, "show", str(run.id))
    assert code == 0
    assert f"run {run.id}  chain3  succeeded" in out
    assert "flaky" in out and "2/5" in out
    assert "(earlier attempt) RuntimeError: flaky failure 1" in out


def test_cancel_a_pending_run_then_again_then_a_finished_one(ledger: sa.Engine,
                                                            db_url: str) -> None:
    later = enqueue(ledger, pa.chain3, n=1, delay=3600)
    res = cancel_run(ledger, later.id)
    assert res.changed
    assert res.cancelled == (res.run.steps[0].job_id,)
    assert res.cancel_requested == ()
    assert res.run.status == "cancelled"
    assert res.run.finished_at is not None
    step = res.run.steps[0]
    assert step.status == "cancelled"
    assert step.last_error == "cancelled by flowq.ops.runs.cancel_run"

    again = cli_json(db_url, "cancel", str(later.id))
    assert again["cancelled_job_ids"] == [] and again["cancel_requested_job_ids"] == []
    assert again["run"]["status"] == "cancelled"

    done = enqueue(ledger, pa.chain3, n=2)
    work(db_url)
    with pytest.raises(flowq.RunStateError, match="already ended succeeded"):
        cancel_run(ledger, done.id)
    code, _, err = cli(db_url, "cancel", str(done.id))
    assert code == 2 and "nothing to cancel" in err
    assert get_run(ledger, done.id).status == "succeeded"


def test_cancel_mid_run_leaves_earlier_steps_and_creates_nothing_more(
        ledger: sa.Engine, db_url: str) -> None:
    run = enqueue(ledger, pa.queued, n=1)
    work(db_url)  # serves only 'default': the 'reports' step waits
    assert [s.status for s in get_run(ledger, run.id).steps] == ["succeeded", "pending"]

    data = cli_json(db_url, "cancel", str(run.id))
    report_job = data["run"]["steps"][1]["job_id"]
    assert data["cancelled_job_ids"] == [report_job]
    assert data["run"]["status"] == "cancelled"
    assert [s["status"] for s in data["run"]["steps"]] == ["succeeded", "cancelled"]
    assert "flowq runs cancel" in data["run"]["steps"][1]["last_error"]

    work(db_url, ("default", "reports"))
    assert [r.status for r in job_rows(ledger, where="run_id = :r", r=run.id)] == [
        "succeeded", "cancelled"]
    assert ledger_steps(ledger, run.id) == ["local_1"]


def test_retry_a_dead_run_from_the_step_that_died(ledger: sa.Engine, db_url: str) -> None:
    run = enqueue(ledger, pa.fixable, n=5)
    work(db_url)
    dead = get_run(ledger, run.id)
    assert dead.status == "dead"
    one, two = dead.steps
    assert (one.status, two.status, two.attempts, two.max_attempts) == (
        "succeeded", "dead", 2, 2)
    assert two.last_error is not None and "not fixed yet" in two.last_error

    not_dead = enqueue(ledger, pa.chain3, n=1, delay=3600)
    with pytest.raises(flowq.RunStateError, match="is pending, not dead"):
        retry_run(ledger, not_dead.id)
    code, _, err = cli(db_url, "retry", str(not_dead.id))
    assert code == 2 and "only a dead run can be retried" in err

    with ledger.begin() as conn:
        conn.execute(sa.text("INSERT INTO switches VALUES ('fixed')"))
    data = cli_json(db_url, "retry", str(run.id))
    assert data["retried_job_id"] == two.job_id and data["retried_step"] == "fix_two"
    assert data["run"]["status"] == "pending"
    retried = data["run"]["steps"][1]
    assert (retried["status"], retried["attempts"], retried["finished_at"]) == (
        "pending", 0, None)
    assert "not fixed yet" in retried["last_error"]  # kept until the next attempt ends
    assert data["run"]["steps"][0]["result"] == one.result == {"n": 5, "from_one": 10}

    work(db_url)
    after = get_run(ledger, run.id)
    assert after.status == "succeeded"
    assert after.result == {"n": 5, "total": 11}
    assert after.steps[0] == one  # the first step was not re-run nor touched
    assert after.steps[1].attempts == 1
    assert ledger_steps(ledger, run.id) == ["fix_one", "fix_two"]


def test_idempotent_enqueue_returns_the_run_whatever_its_state(ledger: sa.Engine,
                                                               db_url: str) -> None:
    first = enqueue(ledger, pa.chain3, n=1, idempotency_key="signup:alice")
    assert first.created
    again = enqueue(ledger, pa.chain3, n=999, idempotency_key="signup:alice")
    assert (again.id, again.created) == (first.id, False)
    assert cli_json(db_url, "show", str(first.id))["status"] == "pending"

    work(db_url)
    data = cli_json(db_url, "show", str(first.id))
    assert data["status"] == "succeeded" and data["idempotency_key"] == "signup:alice"
    after = enqueue(ledger, pa.chain3, n=2, idempotency_key="signup:alice")
    assert (after.id, after.created) == (first.id, False)
    work(db_url)
    assert len(job_rows(ledger)) == 3  # one run of three steps, nothing more
    assert cli_json(db_url, "show", str(first.id))["result"] == {"n": 1, "done": "tok-1-10"}


def test_list_runs_by_status(ledger: sa.Engine, db_url: str) -> None:
    ok = enqueue(ledger, pa.chain3, n=1)
    bad = enqueue(ledger, pa.fixable, n=1)
    waiting = enqueue(ledger, pa.chain3, n=2, delay=3600)
    work(db_url)
    assert [r.run_id for r in list_runs(ledger)] == [waiting.id, bad.id, ok.id]
    dead = list_runs(ledger, status="dead")
    assert [(r.run_id, r.step, r.step_index) for r in dead] == [(bad.id, "fix_two", 1)]
    assert [r.run_id for r in list_runs(ledger, limit=1)] == [waiting.id]
    data = cli_json(db_url, "list", "--status", "succeeded")
    assert [r["run_id"] for r in data["runs"]] == [ok.id]
    code, out, _ = cli(db_url, "list")
    assert code == 0 and "fixable" in out and "dead" in out


def test_a_filter_that_matches_nothing_says_what_was_meant(engine: sa.Engine,
                                                           db_url: str) -> None:
    with engine.begin() as conn:
        flowq.enqueue(conn, "fulfil_order", queue="shipping", delay=3600)
    code, out, _ = cli(db_url, "list", "--task", "fulfil_ordr")
    assert code == 0
    assert out.strip() == ("no runs. (no recent run has task 'fulfil_ordr': did you mean "
                           "'fulfil_order'?)")
    code, out, _ = cli(db_url, "list", "--queue", "shiping", "--task", "fulfil_order")
    assert "no recent run has queue 'shiping': did you mean 'shipping'?" in out
    assert "task" not in out.replace("--task", "")  # the task is known: nothing said of it
    code, out, _ = cli(db_url, "list", "--task", "fulfil_order", "--status", "dead")
    assert out.strip() == "no runs."  # known names: an empty page is just that


def test_runs_in_another_schema(server_url: str, db_url: str, engine: sa.Engine) -> None:
    flowq.migrate(engine, schema="other")
    with engine.begin() as conn:
        run = flowq.enqueue(conn, "anything", queue="default", schema="other", delay=3600)
    assert get_run(engine, run.id, schema="other").status == "pending"
    with pytest.raises(flowq.RunNotFoundError):
        get_run(engine, run.id)
    data = cli_json(db_url, "cancel", str(run.id), "--schema", "other")
    assert data["run"]["status"] == "cancelled"


def test_a_connection_joins_the_callers_transaction(ledger: sa.Engine) -> None:
    run = enqueue(ledger, pa.chain3, n=1, delay=3600)
    with ledger.connect() as conn:
        conn.begin()
        assert cancel_run(conn, run.id).changed
        conn.rollback()
    assert get_run(ledger, run.id).status == "pending"
    with ledger.connect() as conn:
        cancel_run(conn, run.id)  # no transaction of the caller's: committed here
    assert get_run(ledger, run.id).status == "cancelled"


def test_cancel_waits_for_a_completing_step_and_cancels_its_successor(ledger: sa.Engine
                                                                      ) -> None:
    """A completion in flight when cancel starts: cancel waits for it, then sees (and cancels)
    the successor it inserted, which its first snapshot could not see."""
    q = Queries("flowq")
    run = enqueue(ledger, pa.chain3, n=1)
    with ledger.connect() as worker:
        with worker.begin():
            claimed = worker.execute(q.claim_jobs, {"queue": "default", "limit": 1,
                                                    "worker": "test"}).one()
        tx = worker.begin()
        worker.execute(q.complete_steps, {
            "ids": [claimed.id], "leases": [claimed.lease], "results": ['{"n": 1}'],
            "next_ids": [claimed.id], "next_leases": [claimed.lease],
            "next_tasks": ["chain3"], "next_steps": ["flaky"],
            "next_step_indexes": [1], "next_queues": ["default"], "next_max_attempts": [5],
            "next_args": ['{"n": 1, "account": 10, "fail_times": 0, "sleep": 0}'],
            "next_map_indexes": [None], "next_delays": [0.0], "channel": "flowq"})
        with ThreadPoolExecutor(1) as pool:
            cancelling = pool.submit(cancel_run, ledger, run.id)
            wait_until(lambda: someone_waits_for_a_lock(ledger), timeout=30,
                       message="cancel to wait for the completion's row lock")
            tx.commit()
            res = cancelling.result(timeout=30)
    assert [(s.step, s.status) for s in res.run.steps] == [
        ("create", "succeeded"), ("flaky", "cancelled")]
    assert res.cancelled == (res.run.steps[1].job_id,)
    assert res.run.status == "cancelled"


def someone_waits_for_a_lock(engine: sa.Engine) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'")).scalar())


def test_runs_list_names_due_jobs_no_live_worker_serves(ledger: sa.Engine, db_url: str) -> None:
    """A job whose queue no live worker serves waits forever; `flowq runs list` says so, and
    stops saying it once a worker that serves it is registered (issue 10)."""
    with ledger.begin() as conn:
        flowq.enqueue(conn, "fast", queue="default", n=21)
    data = cli_json(db_url, "list")
    assert [(u["queue"], u["task"], u["jobs"]) for u in data["unserved"]] == [
        ("default", "fast", 1)]
    code, out, _ = cli(db_url, "list")
    assert code == 0 and "served by no live worker" in out and "'fast'" in out
    with ledger.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO flowq.workers (name, host, pid, queues, tasks, concurrency, version) "
            "VALUES ('w', 'h', 1, '{default}', '{fast}', 1, 'x')"))
    assert cli_json(db_url, "list")["unserved"] == []
