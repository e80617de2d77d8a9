"""The deploy check (flowq.ops.deploy, `flowq deploy-check`) over runs staged between steps by
version A of an app (tests/apps/deploy_a.py), against version B (deploy_b.py); and the rule
at run time (flowq.worker.resolution.resolve) for a job B cannot run: left to a live worker
serving A, or dead with the sentence."""

from __future__ import annotations

import json

import deploy_a
import deploy_b
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from support import rows

from flowq.cli import main
from flowq.db.rows import ClaimedJob, read
from flowq.db.runner import runner
from flowq.db.sql import queries
from flowq.db.store import Store
from flowq.ops.deploy import check_deploy
from flowq.ops.doctor import doctor
from flowq.ops.runs import list_runs
from flowq.ops.status import status
from flowq.testing import drain
from flowq.worker.attempt import Attempt, run_attempt
from flowq.worker.model import Failed, Retried
from flowq.worker.registry import Registry
from flowq.worker.resolution import Elsewhere, ServedBy
from flowq.worker.writes import write_outcome

RUNS = 3  # per pipeline


@pytest.fixture
def staged(engine: sa.Engine) -> dict[str, list[int]]:
    """RUNS runs of each of A's pipelines, their first steps run by A, the rest waiting."""
    with engine.begin() as conn:
        conn.exec_driver_sql(deploy_a.LEDGER_DDL)
        runs = {p.name: [p.enqueue(conn, n=i).id for i in range(RUNS)] for p in deploy_a.app}
    with engine.connect() as conn:
        drain(conn, deploy_a.app)
        conn.commit()
    # A's worker registered what it serves (its shapes are what B is compared with).
    Registry(engine, "flowq", worker="worker-a", queues=["default"],
             tasks=[p.name for p in deploy_a.app], concurrency=1,
             definitions=deploy_a.app.definitions).register()
    return runs


def test_the_check_names_exactly_the_runs_b_cannot_continue(
        engine: sa.Engine, staged: dict[str, list[int]]) -> None:
    report = check_deploy(engine, deploy_b.app)
    assert not report.ok
    by_pipeline = {p.pipeline: p for p in report.pipelines}
    assert by_pipeline["versioned"].compatible
    for name in deploy_a.STRANDED:
        stranded = by_pipeline[name].stranded
        assert {s.runs for s in stranded} == {RUNS}, (name, stranded)
        assert {s.example_run_id for s in stranded} == {min(staged[name])}
        assert all(s.served_by == ("worker-a",) for s in stranded)
    reasons = {p: [s.reason for s in r.stranded] for p, r in by_pipeline.items()}
    assert reasons["chain"] == [f"step 'b' was removed while {RUNS} run(s) wait to run it"]
    assert reasons["rename"] == [f"step 'q' was removed (renamed to 'q2'?) while {RUNS} run(s) "
                                 "wait to run it"]
    assert reasons["argchange"] == [f"step 't' now needs argument(s) 'm': arguments step(s) "
                                    f"'s' did not produce ({RUNS} run(s) wait to run it)"]
    assert sorted(reasons["fanin"]) == [
        f"join 'z' gained parent(s) 'y3', which a run at step '{s}' never runs (the join "
        f"would never start) ({RUNS} run(s) at step '{s}')" for s in ("y1", "y2")]
    label = f"version 1 ({deploy_a.chain.fingerprint[:12]})"
    assert by_pipeline["chain"].in_flight == {label: RUNS}
    # A's own code can continue them all.
    assert check_deploy(engine, deploy_a.app).ok


def test_the_command_exits_1_and_says_why(engine: sa.Engine, db_url: str,
                                          staged: dict[str, list[int]]) -> None:
    runner_ = CliRunner()
    bad = runner_.invoke(main, ["deploy-check", "deploy_b:app", "--database-url", db_url])
    assert bad.exit_code == 1, bad.output
    assert "chain: 1 problem(s) (in flight: version 1" in bad.output
    assert f"step 'b' was removed while {RUNS} run(s) wait to run it" in bad.output
    assert "versioned: compatible" in bad.output
    assert f"not ok: {4 * RUNS + RUNS:,} run(s) could not continue" in bad.output
    good = runner_.invoke(main, ["deploy-check", "deploy_a:app", "--database-url", db_url,
                                 "--json"])
    assert good.exit_code == 0, good.output
    assert json.loads(good.output)["ok"] is True


def _claim(engine: sa.Engine, step: str) -> ClaimedJob:
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.jobs SET run_at = now() WHERE step = :s"),
                     {"s": step})
        return read(ClaimedJob, runner(conn)(queries("flowq").claim_run_jobs, {
            "queue": "default", "limit": 1, "worker": "worker-b",
            "run_ids": [r.run_id for r in rows(
                engine, "SELECT run_id FROM flowq.steps WHERE step = :s", s=step)]}))[0]


def test_b_leaves_a_job_it_cannot_run_to_a_live_worker_of_a_or_ends_it_dead(
        engine: sa.Engine, staged: dict[str, list[int]]) -> None:
    a_serves = Elsewhere(
        versions={p.fingerprint: p.version for p in deploy_a.app.definitions},
        shapes={p.fingerprint: p.shape for p in deploy_a.app.definitions},
        workers=(ServedBy("worker-a", frozenset({"default"}), {
            p.name: ((p.version, p.fingerprint),) for p in deploy_a.app.definitions}),))
    alone = Elsewhere(versions=a_serves.versions, shapes=a_serves.shapes)
    for step in ("b", "q", "t", "y1"):
        job = _claim(engine, step)
        left = run_attempt(Attempt(deploy_b.app, job, elsewhere=a_serves))
        assert isinstance(left, Retried) and left.handed_over, (step, left)
        assert left.reason.startswith("left to worker 'worker-a'")
        dead = run_attempt(Attempt(deploy_b.app, job, elsewhere=alone))
        assert isinstance(dead, Failed) and dead.retry_in is None, (step, dead)
        assert dead.text.startswith(f"UnknownTaskError: run {job.run_id} (started under "
                                    "definition ")
        assert "no live worker serves a definition that can run it" in dead.text
        assert f"`flowq runs fork {job.run_id}`" in dead.text
        with engine.begin() as conn:  # the hand-over gives the attempt back
            assert write_outcome(Store(runner(conn), "flowq"), job, left) is not None
        [row] = rows(engine, "SELECT status, attempts, last_error FROM flowq.steps WHERE id = :i",
                     i=job.id)
        assert (row.status, row.attempts) == ("pending", 0)
        assert row.last_error.startswith("left to worker 'worker-a'")
    # A job B can run (the same step, a compatible shape) it runs.
    job = _claim(engine, "v_b")
    assert isinstance(Attempt(deploy_b.app, job, elsewhere=alone).resolved, tuple)


def test_status_says_what_was_left_to_another_worker_and_doctor_what_none_can_run(
        engine: sa.Engine, staged: dict[str, list[int]]) -> None:
    job = _claim(engine, "b")
    served = Elsewhere(versions={deploy_a.chain.fingerprint: 1}, workers=(ServedBy(
        "worker-a", frozenset({"default"}), {"chain": ((1, deploy_a.chain.fingerprint),)}),))
    left = run_attempt(Attempt(deploy_b.app, job, elsewhere=served))
    assert isinstance(left, Retried)
    with engine.begin() as conn:
        write_outcome(Store(runner(conn), "flowq"), job, left)
    [handed] = status(engine).handed_over
    assert (handed.task, handed.fingerprint, handed.worker, handed.jobs) == (
        "chain", deploy_a.chain.fingerprint, "worker-a", 1)

    [check] = [c for c in doctor(engine) if c.name == "deploy"]
    assert check.level == "OK"  # worker-a (A) is live and can continue them all
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM flowq.workers"))
    Registry(engine, "flowq", worker="worker-b", queues=["default"],
             tasks=[p.name for p in deploy_b.app], concurrency=1,
             definitions=deploy_b.app.definitions).register()
    [check] = [c for c in doctor(engine) if c.name == "deploy"]
    assert check.level == "WARN"
    assert check.found.startswith(f"{5 * RUNS:,} run(s) in flight that no live worker's "
                                  "definition can continue")
    assert "flowq deploy-check" in check.action


def test_runs_list_filters_by_the_version_a_run_started_on(
        engine: sa.Engine, db_url: str, staged: dict[str, list[int]]) -> None:
    with engine.begin() as conn:
        newest = [deploy_b.versioned.enqueue(conn, n=i).id for i in range(2)]
    Registry(engine, "flowq", worker="worker-b", queues=["default"],
             tasks=[p.name for p in deploy_b.app], concurrency=1,
             definitions=deploy_b.app.definitions).register()
    v1 = {r.run_id for r in list_runs(engine, task="versioned", version=1)}
    v2 = {r.run_id for r in list_runs(engine, task="versioned", version=2)}
    assert (v1, v2) == (set(staged["versioned"]), set(newest))
    assert {r.run_id for r in list_runs(engine, version=2)} == set(newest)
    assert list_runs(engine, version=3) == []
    out = CliRunner().invoke(main, ["runs", "list", "--database-url", db_url, "--task",
                                    "versioned", "--version", "2", "--json"])
    assert out.exit_code == 0, out.output
    assert {r["run_id"] for r in json.loads(out.output)["runs"]} == set(newest)


def test_a_run_shows_the_version_it_started_on_in_runs_show_and_the_dashboard(
        engine: sa.Engine, db_url: str, staged: dict[str, list[int]]) -> None:
    import warnings

    from flowq.dashboard import create_app
    from flowq.ops.runs import get_run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    with engine.begin() as conn:
        newest = deploy_b.versioned.enqueue(conn, n=7).id
        by_name = conn.execute(sa.text(
            "INSERT INTO flowq.jobs (task, step, queue) VALUES ('versioned', '', 'default') "
            "RETURNING run_id")).scalar_one()  # enqueued without the definition
    Registry(engine, "flowq", worker="worker-b", queues=["default"],
             tasks=[p.name for p in deploy_b.app], concurrency=1,
             definitions=deploy_b.app.definitions).register()
    old = staged["versioned"][0]
    assert (get_run(engine, old).version, get_run(engine, newest).version) == (1, 2)
    newest_definition = deploy_b.app.get("versioned")
    assert newest_definition.version == 2
    assert get_run(engine, newest).fingerprint == newest_definition.fingerprint
    assert (get_run(engine, by_name).version, get_run(engine, by_name).fingerprint) == (None,
                                                                                         None)
    short = newest_definition.fingerprint[:12]
    shown = CliRunner().invoke(main, ["runs", "show", str(newest), "--database-url", db_url])
    assert shown.exit_code == 0 and f"started on version 2 ({short})" in shown.output
    as_json = CliRunner().invoke(main, ["runs", "show", str(newest), "--database-url", db_url,
                                        "--json"])
    assert json.loads(as_json.output)["version"] == 2
    c = TestClient(create_app(engine), base_url="http://127.0.0.1:8080")
    page = c.get(f"/runs/{newest}")
    assert page.status_code == 200 and 'id="version">2' in page.text and short in page.text
    assert 'id="version"' not in c.get(f"/runs/{by_name}").text
    listed = c.get("/runs?task=versioned&version=2")
    assert listed.status_code == 200 and f"/runs/{newest}" in listed.text
    assert f"/runs/{old}\"" not in listed.text
    assert f"/runs/{old}" in c.get("/runs?task=versioned&version=1").text
    for hostile in ("two", "-1", "1e3", "\u0661", "9" * 40):
        bad = c.get("/runs", params={"version": hostile})
        assert bad.status_code == 400 and "version must be a whole number" in bad.text, hostile


def test_another_process_s_odd_registry_entry_is_read_without_trusting_it(
        engine: sa.Engine, staged: dict[str, list[int]]) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO flowq.workers (name, host, pid, queues, tasks, concurrency, version, "
            "definitions) VALUES ('odd', 'h', 1, '{default}', '{chain}', 1, 'x', "
            "CAST(:d AS jsonb))"), {"d": json.dumps(
                {"chain": [{"version": "1", "fingerprint": 7}, "junk"], "rename": "junk",
                 "{runs}": [{"version": 1, "fingerprint": "sha256:{runs}"}]})})
    registry = Registry(engine, "flowq", worker="worker-b", queues=["default"],
                        tasks=[p.name for p in deploy_b.app], concurrency=1,
                        definitions=deploy_b.app.definitions)
    registry.register()
    odd = next(w for w in registry.elsewhere.workers if w.worker == "odd")
    assert odd.definitions["chain"] == () and "rename" not in odd.definitions
    report = check_deploy(engine, deploy_b.app)  # no crash, the same answer
    assert {s.pipeline for s in report.stranded} == set(deploy_a.STRANDED)
