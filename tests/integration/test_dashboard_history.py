"""Time on the dashboard, on a real PostgreSQL: the attempt history the fenced retry and end
statements keep (bounded, and never written by a first-attempt success), the run page's
graph, timeline and attempts, the queue charts, the auto-refresh toggle, waits and due
times, the filters' lists, the argument search, what each worker runs, and bulk cancel."""

from __future__ import annotations

import re
import warnings
from datetime import timedelta
from typing import Any

import dashboard_app as da
import psycopg
import pytest
import sqlalchemy as sa
from dashboard_app import reset_broken  # noqa: F401 (an autouse fixture)
from runs_cli import cli, cli_json
from support import dashboard_client as client
from support import enqueue_id as enqueue

from flowq.dashboard.reads import activity
from flowq.db import normalize_url
from flowq.db.runner import runner
from flowq.db.sql.fragments import ATTEMPT_ERROR_CHARS, ATTEMPT_LOG_LENGTH
from flowq.db.store import Store
from flowq.ops.runs import get_run
from flowq.testing import drain, job_rows

with warnings.catch_warnings():
    warnings.simplefilter("ignore")

TOKEN = "s3cret-token-for-tests"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# -- the attempt history ----------------------------------------------------------------------


def test_failed_attempts_are_kept_and_a_first_success_writes_none(engine: sa.Engine) -> None:
    flaky = enqueue(engine, da.flaky, n=7)
    plain = enqueue(engine, da.two, n=1)
    drain(engine, da.app)
    [row] = job_rows(engine, where="run_id = :r", r=flaky)
    assert row.status == "succeeded" and row.attempts == 3
    log = row.attempt_log
    assert [e["attempt"] for e in log] == [1, 2]
    assert [e["error"].splitlines()[0] for e in log] == [
        "ValueError: flaky attempt 1 of 7", "ValueError: flaky attempt 2 of 7"]
    assert all(e["worker"] == "flowq.testing" and e["started_at"] <= e["finished_at"]
               for e in log)
    assert row.started_at is not None and row.started_at <= row.finished_at
    for r in job_rows(engine, where="run_id = :r", r=plain):
        assert r.attempt_log is None and r.started_at is not None  # nothing appended

    history = get_run(engine, flaky).steps[0].history
    assert [(a.attempt, a.worker is not None, a.error is not None) for a in history] == [
        (1, True, True), (2, True, True), (3, False, False)]
    shown = get_run(engine, flaky).to_dict()["steps"][0]["history"]
    assert shown[0]["error"].startswith("ValueError: flaky attempt 1") and \
        isinstance(shown[0]["started_at"], str)


def test_runs_show_lists_the_failed_attempts(engine: sa.Engine, db_url: str) -> None:
    flaky = enqueue(engine, da.flaky, n=5)
    drain(engine, da.app)
    code, out, _ = cli(db_url, "show", str(flaky))
    assert code == 0
    shown = out[out.index("failed attempts:"):]
    assert "dash_flaky attempt 1: started" in shown and "flaky attempt 2 of 5" in shown
    history = cli_json(db_url, "show", str(flaky))["steps"][0]["history"]
    assert [a["attempt"] for a in history] == [1, 2, 3]


@pytest.fixture
def store(db_url: str) -> Any:
    url = normalize_url(db_url).set(drivername="postgresql")
    with psycopg.connect(url.render_as_string(hide_password=False), autocommit=True) as conn:
        yield Store(runner(conn))


def test_the_history_is_bounded_in_length_and_text(engine: sa.Engine, store: Store) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO flowq.jobs (task, step, max_attempts) "
                             "VALUES ('t', 't', 100)"))
    for n in range(ATTEMPT_LOG_LENGTH + 5):
        [job] = store.claim("default", 1, f"w-{n}")
        assert store.retry((job.id, job.lease), 0, f"E{n}:" + "x" * 10_000) is not None
    [job] = store.claim("default", 1, "w-last")
    assert store.end((job.id, job.lease), "dead", "the end") == "dead"
    [row] = job_rows(engine)
    log = row.attempt_log
    assert len(log) == ATTEMPT_LOG_LENGTH  # the latest kept
    assert [e["attempt"] for e in log] == list(range(7, 27))
    assert log[-1] == {**log[-1], "error": "the end", "worker": "w-last"}
    assert all(len(e["error"]) <= ATTEMPT_ERROR_CHARS for e in log)
    # A late worker's retry changes nothing: the fence holds for the history too.
    assert store.retry((job.id, job.lease), 0, "late") is None
    assert job_rows(engine)[0].attempt_log == log


def test_the_reaper_logs_the_lost_attempt(engine: sa.Engine, store: Store) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO flowq.jobs (task, step) VALUES ('t', 't')"))
    assert len(store.claim("default", 1, "w-gone")) == 1
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.jobs SET heartbeat_at = now() - interval '1 hour'"))
    assert len(store.reap(60, 10)) == 1
    [entry] = job_rows(engine)[0].attempt_log
    assert entry["worker"] == "w-gone" and entry["error"].startswith("WorkerLost: worker w-gone")


# -- the pages ----------------------------------------------------------------------------------


def test_the_run_page_draws_the_graph_timeline_and_attempts(engine: sa.Engine) -> None:
    flaky = enqueue(engine, da.flaky, n=3)
    graph = enqueue(engine, da.graph, order=4)
    fan = enqueue(engine, da.fan, n=5)
    drain(engine, da.app)
    c = client(engine)

    page = c.get(f"/runs/{graph}").text
    assert '<svg class="dag" id="dag"' in page
    # The definition is imported here: every step is drawn, the ones after the wait greyed.
    for step in ("fetch", "price", "stock", "combine", "approve", "ship"):
        assert f'data-step="{step}"' in page
    assert re.search(r'<g class="node unreached" data-step="ship">', page)
    assert re.search(r'<g class="node waiting" data-step="approve">', page)
    assert page.count('class="edge"') == 6  # fetch→price, fetch→stock, 2→combine, →approve, →ship
    assert "waits for signal <strong>approval</strong> until" in page
    assert '<svg class="timeline" id="timeline"' in page

    page = c.get(f"/runs/{fan}").text
    assert '<g class="node succeeded" data-step="item">' in page and "x5: 5 succeeded" in page

    page = c.get(f"/runs/{flaky}").text
    attempts = page[page.index('id="attempts"'):]
    assert attempts.count("ValueError: flaky attempt") >= 2 and "flowq.testing" in attempts
    assert "(not kept after success)" in attempts


def test_a_run_of_an_unknown_pipeline_is_drawn_without_guessed_edges(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        run_id = conn.execute(sa.text(
            "INSERT INTO flowq.jobs (task, step, step_index, status, finished_at) "
            "VALUES ('ghost', 'a', 0, 'succeeded', now()) RETURNING run_id")).scalar_one()
        conn.execute(sa.text("INSERT INTO flowq.jobs (run_id, task, step, step_index) "
                             "VALUES (:r, 'ghost', 'b', 1)"), {"r": run_id})
    page = client(engine).get(f"/runs/{run_id}").text
    assert 'data-step="a"' in page and 'data-step="b"' in page
    assert 'class="edge"' not in page and "without edges" in page


def test_the_queue_charts_and_the_window(engine: sa.Engine) -> None:
    enqueue(engine, da.flaky, n=1)
    enqueue(engine, da.two, n=2)
    da.BROKEN["on"] = True
    enqueue(engine, da.fragile, note="x")
    drain(engine, da.app, raise_on_dead=False)
    enqueue(engine, da.two, n=3)  # due, not started: depth
    act = activity(engine, "hour")
    dash = act.queues["dash"]
    # dash: flaky (1 row), fragile (dead), two's first steps (2, one still pending).
    assert (sum(dash.finished), sum(dash.dead), sum(dash.started)) == (3, 1, 3)
    assert sum(dash.failed) == 3  # flaky's two retried attempts, fragile's last one
    assert dash.depth[-1] == 1 and act.queues["dash-limited"].depth[-1] == 0
    assert sum(act.queues["dash-limited"].finished) == 1 and not act.truncated
    assert any(p is not None and p >= 0 for p in dash.p50)
    c = client(engine)
    home = c.get("/").text
    for kind in ("depth", "throughput", "dead", "delay"):
        assert f'id="chart-{kind}-1"' in home
    assert "Activity over the last hour" in home and "<polyline" in home
    day = c.get("/?window=day")
    assert day.status_code == 200 and "Activity over the last day" in day.text
    assert "Per 15 minutes" in day.text
    assert c.get("/?window=<b>").status_code == 400


def test_auto_refresh_is_off_by_default_and_remembered(engine: sa.Engine) -> None:
    c = client(engine)
    assert 'http-equiv="refresh"' not in c.get("/runs").text
    r = c.get("/refresh?every=15&next=/runs", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/runs"
    assert "flowq_refresh=15" in r.headers["set-cookie"]
    assert '<meta http-equiv="refresh" content="15">' in c.get("/runs").text
    assert '<meta http-equiv="refresh" content="15">' in c.get("/").text
    r = c.get("/refresh?every=0&next=//evil.example/", follow_redirects=False)
    assert r.headers["location"] == "/"  # never another site
    assert 'http-equiv="refresh"' not in c.get("/runs").text
    c.get("/refresh?every=1")  # not a choice: off
    assert 'http-equiv="refresh"' not in c.get("/").text


def test_runs_list_due_times_filters_and_argument_search(engine: sa.Engine) -> None:
    later = enqueue(engine, da.two, n=9, delay=timedelta(hours=2))
    done = enqueue(engine, da.two, n=41)
    drain(engine, da.app)
    c = client(engine)
    runs = c.get("/runs").text
    assert re.search(rf">{later}</a>.*?due \d{{4}}-", runs, re.S)
    task_options = re.search(r'<select name="task" id="filter-task">(.*?)</select>', runs, re.S)
    assert task_options and "dash_two" in task_options.group(1)
    queue_options = re.search(r'<select name="queue" id="filter-queue">(.*?)</select>', runs,
                              re.S)
    assert queue_options and "dash-limited" in queue_options.group(1)

    found = c.get("/runs", params={"args": '{"n": 41}'}).text
    matches = found[found.index('id="matches"'):found.index("</table>", found.index('id="matches"'))]
    assert f">{done}</a>" in matches and f">{later}</a>" not in matches
    assert f">{done}</a>" in c.get("/runs", params={"args": "n=41"}).text
    for bad in ("{not json", "[1, 2]", "novalue", '{"s": "\\u0000"}'):
        assert c.get("/runs", params={"args": bad}).status_code == 400, bad


def test_workers_page_lists_what_each_runs(engine: sa.Engine) -> None:
    run_id = enqueue(engine, da.two, n=1)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE flowq.jobs SET status = 'running', attempts = 1, "
                             "locked_by = 'w-<b>1</b>', locked_at = now(), "
                             "heartbeat_at = now(), lease = 1 WHERE run_id = :r"), {"r": run_id})
    page = client(engine).get("/workers").text
    running = page[page.index('id="running"'):]
    assert "w-&lt;b&gt;1&lt;/b&gt;" in running and f">{run_id}</a>" in running


def test_bulk_cancel_from_the_runs_list(engine: sa.Engine) -> None:
    a = enqueue(engine, da.two, n=1, delay=timedelta(hours=1))
    b = enqueue(engine, da.two, n=2, delay=timedelta(hours=1))
    done = enqueue(engine, da.two, n=3)
    drain(engine, da.app)
    ro = client(engine)
    assert ro.post("/runs/cancel", data={"run_id": str(a)}).status_code == 403
    c = client(engine, allow_actions=True, token=TOKEN)
    page = c.get(f"/runs?token={TOKEN}").text
    assert f'name="run_id" value="{a}"' in page and f'name="run_id" value="{done}"' not in page
    csrf = re.search(r'name="csrf" value="([^"]+)"', page)
    assert csrf
    assert c.post("/runs/cancel", data={"run_id": str(a)}).status_code == 403  # no CSRF
    r = c.post("/runs/cancel", data={"csrf": csrf.group(1), "next": "/runs", "confirm": "yes",
                                     "run_id": [str(a), str(b), str(done)]},
               follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/runs"
    assert "2 run(s) cancelled" in c.get("/runs").text
    assert {get_run(engine, x).status for x in (a, b)} == {"cancelled"}
    assert get_run(engine, done).status == "succeeded"
    r = c.post("/runs/cancel", data={"csrf": csrf.group(1), "run_id": "x"})
    assert r.status_code == 400
