"""The dashboard's operator pages and actions: bulk actions confirmed on the server, a page per
queue (paused in the warning colour), schedules with "Run now", batches, signals to a waiting
run, every attempt on the timeline, progress as a bar, charts spanning their data."""

from __future__ import annotations

import html
import re
import warnings
from datetime import timedelta

import dashboard_app as da
import pytest
import sqlalchemy as sa
from dashboard_app import dead_run, reset_broken  # noqa: F401 (an autouse fixture)
from sqlalchemy.orm import sessionmaker
from support import dashboard_client as client
from support import enqueue_id

import flowq
from flowq.dashboard import reads
from flowq.db.store import Store
from flowq.db.store.queues import QueueLimits
from flowq.ops.runs import get_run, list_runs
from flowq.testing import drain
from flowq.worker.reaper import Reaper

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

TOKEN = "s3cret-token-for-tests"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def logged_in(engine: sa.Engine, **kwargs: object) -> TestClient:
    c = client(engine, allow_actions=True, token=TOKEN, **kwargs)
    assert c.get(f"/?token={TOKEN}").status_code == 200
    return c


def csrf_of(c: TestClient, path: str = "/dead") -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', c.get(path).text)
    assert match, "no CSRF field on the page"
    return match.group(1)


def confirm_form(page: str) -> dict[str, list[str]]:
    """The hidden fields of a confirmation page's form, as the browser would send them."""
    form = re.search(r'<form id="confirm".*?</form>', page, re.S)
    assert form, "no confirmation form"
    fields: dict[str, list[str]] = {}
    for n, v in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">',
                           form.group(0)):
        fields.setdefault(html.unescape(n), []).append(html.unescape(v))
    return fields


def test_bulk_actions_change_nothing_until_confirmed(engine: sa.Engine) -> None:
    runs = [dead_run(engine, note=f"b{i}") for i in range(3)]
    c = logged_in(engine)
    dead = c.get("/dead").text
    assert 'id="retry-all-button"' in dead
    assert not re.search(r'<button class="primary"[^>]*>Retry every', dead)  # not primary
    csrf = csrf_of(c)
    # Every dead run: the first POST asks, says how many, and retries nothing.
    r = c.post("/dead/retry", data={"csrf": csrf, "all": "1", "task": "dash_fragile"})
    assert r.status_code == 200 and "3 run(s) now" in r.text
    assert "task 'dash_fragile'" in html.unescape(r.text)
    assert {get_run(engine, i).status for i in runs} == {"dead"}
    fields = confirm_form(r.text)
    assert fields["confirm"] == ["yes"] and fields["all"] == ["1"]
    r = c.post("/dead/retry", data=fields)
    assert "3 dead run(s) retried" in r.text
    assert {get_run(engine, i).status for i in runs} == {"pending"}
    # Selected runs: the same, and the confirmation lists them.
    drain(engine, da.app, raise_on_dead=False)
    r = c.post("/dead/retry", data={"csrf": csrf, "run_id": [str(runs[0]), str(runs[1])]})
    assert r.status_code == 200 and f">{runs[0]}</a>" in r.text
    assert {get_run(engine, i).status for i in runs} == {"dead"}
    r = c.post("/dead/retry", data=confirm_form(r.text))
    assert "2 dead run(s) retried" in r.text and get_run(engine, runs[2]).status == "dead"
    # Nothing matching: no confirmation, one sentence.
    r = c.post("/dead/retry", data={"csrf": csrf, "all": "1", "task": "dash_two"})
    assert "No dead run matches" in r.text
    # A bad filter is refused on the first step already.
    r = c.post("/dead/retry", data={"csrf": csrf, "all": "1", "queue": "bad queue"})
    assert r.status_code == 400
    # Cancel the ticked runs: asked first too.
    later = [enqueue_id(engine, da.two, n=i, delay=timedelta(hours=1)) for i in range(2)]
    r = c.post("/runs/cancel", data={"csrf": csrf, "run_id": [str(i) for i in later]})
    assert r.status_code == 200 and "Cancel the 2 selected run(s)?" in r.text
    assert {get_run(engine, i).status for i in later} == {"pending"}
    r = c.post("/runs/cancel", data=confirm_form(r.text))
    assert "2 run(s) cancelled" in r.text
    # The confirmation's own form still needs the CSRF token.
    asked = c.post("/dead/retry", data={"csrf": csrf, "all": "1"}).text
    fields = {k: v for k, v in confirm_form(asked).items() if k != "csrf"}
    assert c.post("/dead/retry", data=fields).status_code == 403
    assert get_run(engine, runs[2]).status == "dead"


def test_a_queue_has_a_page_and_a_paused_one_is_in_the_warning_colour(
        engine: sa.Engine) -> None:
    waiting = enqueue_id(engine, da.two, n=1)
    with engine.begin() as conn:  # what a worker of the app declares as it starts
        Store.of(conn).declare_queues([QueueLimits("dash-limited", 3, None, None)], "w")
    c = logged_in(engine)
    home = c.get("/").text
    assert 'href="/queues/dash-limited"' in home and 'id="paused-warning"' not in home
    page = c.get("/queues/dash-limited")
    assert page.status_code == 200 and "concurrency 3" in page.text
    page = c.get("/queues/dash")
    assert f">{waiting}</a>" in page.text  # its due run
    assert 'id="charts"' in page.text and 'id="pause"' in page.text
    csrf = csrf_of(c, "/queues/dash")
    r = c.post("/queues/dash/pause", data={"csrf": csrf, "next": "/queues/dash"},
               follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/queues/dash"
    page = c.get("/queues/dash").text
    assert 'class="status paused"' in page and 'id="paused-warning"' in page
    assert 'id="resume"' in page
    home = c.get("/").text
    assert 'id="paused-warning"' in home and '<tr class="paused">' in home
    c.post("/queues/dash/resume", data={"csrf": csrf})
    assert 'id="paused-warning"' not in c.get("/queues/dash").text
    # A queue nobody uses yet is a page that says so; a bad name is one sentence.
    assert "No job of this queue" in c.get("/queues/nothing-here").text
    bad = c.get("/queues/%3Cscript%3E")
    assert bad.status_code == 400 and "<script>" not in bad.text
    assert client(engine).get("/queues/dash").status_code == 200  # read-only: no form
    assert 'id="pause"' not in client(engine).get("/queues/dash").text


def test_schedules_list_their_next_ticks_and_run_now(engine: sa.Engine) -> None:
    c = logged_in(engine, app=da.app)
    page = c.get("/schedules")
    assert page.status_code == 200 and "dash_nightly" in page.text and "0 3 * * *" in page.text
    assert page.text.count(" 03:00:00") == 3  # the next three ticks
    assert "no on/off switch" in page.text
    before = list_runs(engine, task="dash_report")
    csrf = csrf_of(c, "/schedules")
    r = c.post("/schedules/dash_nightly/run", data={"csrf": csrf})
    assert r.status_code == 200 and "enqueued as run" in r.text
    after = list_runs(engine, task="dash_report")
    assert len(after) == len(before) + 1 and get_run(engine, after[0].run_id).steps[0].args == \
        {"n": 5}
    r = c.post("/schedules/nope/run", data={"csrf": csrf})
    assert r.status_code == 404 and "no schedule named 'nope'" in html.unescape(r.text)
    assert c.post("/schedules/dash_nightly/run", data={}).status_code == 403  # no CSRF
    ro = client(engine, app=da.app)
    assert 'class="run-now"' not in ro.get("/schedules").text
    assert ro.post("/schedules/dash_nightly/run", data={"csrf": csrf}).status_code == 403
    # Without the app: the schedule is unknown here, and the page says how to fix it.
    other = logged_in(engine, app=flowq.FlowQ())
    page = other.get("/schedules").text
    assert 'class="run-now"' not in page


def test_batches_show_progress_and_their_callback(Session: sessionmaker[flowq.Session]) -> None:
    engine = Session.kw["bind"]
    with Session.begin() as s, s.batch(on_complete=da.batch_done) as batch:
        runs = [s.enqueue(da.two, n=i).id for i in range(2)]
    c = client(engine)
    page = c.get("/batches").text
    assert f">{batch.id}<" in page and "0 / 2 (0%)" in page and "to come" in page
    drain(engine, da.app, runs=runs)
    Reaper(engine, "flowq", stale_after=30).run_once()
    page = c.get("/batches").text
    assert "2 / 2 (100%)" in page
    callback = re.search(r'class="callback"><a href="/runs/(\d+)"', page)
    assert callback, page
    drain(engine, da.app)
    assert "succeeded" in c.get("/batches").text.split('class="callback"')[1]
    assert c.get("/batches?before=x").status_code == 400
    assert c.get(f"/batches?before={batch.id}").text.count(f">{batch.id}<") == 0


def test_a_signal_sent_from_the_run_page(engine: sa.Engine) -> None:
    run_id = enqueue_id(engine, da.graph, order=4)
    drain(engine, da.app)
    assert get_run(engine, run_id).status == "waiting"
    c = logged_in(engine, app=da.app)
    page = c.get(f"/runs/{run_id}").text
    assert 'id="signal"' in page and 'value="approval"' in page  # the awaited name
    csrf = csrf_of(c, f"/runs/{run_id}")
    url = f"/runs/{run_id}/signal"
    r = c.post(url, data={"csrf": csrf, "name": "approval", "payload": "{not json"})
    assert r.status_code == 400 and "not JSON" in r.text
    r = c.post(url, data={"csrf": csrf, "name": "<b>nobody</b>", "payload": ""})
    assert r.status_code == 400 and "<b>nobody" not in r.text
    assert c.post(url, data={"csrf": csrf, "name": " "}).status_code == 400
    assert c.post(url, data={"csrf": csrf, "name": "approval",
                             "payload": "1" * 100_001}).status_code == 400
    assert c.post(url, data={"name": "approval"}).status_code == 403  # no CSRF
    assert client(engine).post(url, data={"csrf": csrf, "name": "approval"}).status_code == 403
    assert get_run(engine, run_id).status == "waiting"
    r = c.post(url, data={"csrf": csrf, "name": "approval", "payload": '{"ok": true}'})
    assert r.status_code == 200 and "Signal 'approval' sent" in html.unescape(r.text)
    drain(engine, da.app)
    assert get_run(engine, run_id).status == "succeeded"
    r = c.post(url, data={"csrf": csrf, "name": "approval", "payload": '{"ok": false}'})
    assert r.status_code in (400, 409)
    assert c.post("/runs/999999999/signal",
                  data={"csrf": csrf, "name": "approval"}).status_code == 404


def test_the_timeline_draws_every_attempt(engine: sa.Engine) -> None:
    run_id = enqueue_id(engine, da.flaky, n=3)
    drain(engine, da.app)
    assert get_run(engine, run_id).status == "succeeded"
    page = client(engine).get(f"/runs/{run_id}").text
    timeline = page.split('id="timeline"')[1].split("</svg>")[0]
    assert 'data-attempts="3"' in timeline
    assert timeline.count('class="attempt"') == 3
    assert timeline.count("(failed)") == 2


def test_progress_is_a_bar_with_a_readable_time(engine: sa.Engine) -> None:
    run_id = enqueue_id(engine, da.two, n=1, delay=timedelta(hours=1))
    with engine.begin() as conn:
        conn.execute(sa.text(
            "UPDATE flowq.jobs SET progress = CAST(:p AS jsonb) WHERE run_id = :r"),
            {"r": run_id, "p": '{"done": 3, "total": 12, "message": "<i>labels</i>", '
                               '"at": "2030-01-02T03:04:05.678901+00:00"}'})
    page = client(engine).get(f"/runs/{run_id}").text
    assert 'role="progressbar"' in page and "width:25.0%" in page and "3 / 12 (25%)" in page
    assert "2030-01-02 03:04:05" in page and "678901" not in page
    assert "&lt;i&gt;labels" in page
    with engine.begin() as conn:
        conn.execute(sa.text(
            "UPDATE flowq.jobs SET progress = CAST(:p AS jsonb) WHERE run_id = :r"),
            {"r": run_id, "p": '{"done": "<b>x</b>", "total": 0}'})
    page = client(engine).get(f"/runs/{run_id}").text
    assert 'role="progressbar"' not in page and "&lt;b&gt;x" in page


def test_json_arguments_keep_their_lines(engine: sa.Engine) -> None:
    run_id = enqueue_id(engine, da.fragile, note="a fairly long note that must not wrap")
    page = client(engine).get(f"/runs/{run_id}").text
    assert "word-break: break-word" not in page
    assert re.search(r"pre \{[^}]*white-space: pre;", page)
    assert '<div class="wide">' in page


def test_fresh_charts_span_their_own_data(engine: sa.Engine) -> None:
    enqueue_id(engine, da.two, n=1)
    drain(engine, da.app)
    act = reads.activity(engine, "hour")
    assert act.buckets == reads.MIN_SHOWN_BUCKETS
    assert len(act.queues["dash"].started) == reads.MIN_SHOWN_BUCKETS
    assert sum(act.queues["dash"].finished) == 1
    assert act.now - act.since <= timedelta(seconds=60 * (reads.MIN_SHOWN_BUCKETS + 1))
    only = reads.activity(engine, "hour", queue="dash-limited")
    assert list(only.queues) == ["dash-limited"]
