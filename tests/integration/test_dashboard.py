"""The dashboard over HTTP (Starlette's test client on a real PostgreSQL): every page, finding
runs, escaping of hostile arguments and errors, and the guards: read-only refuses POSTs, a
wrong token or password is 401 and changes nothing, a POST without the CSRF token (or from
another origin) is refused; mounted under a prefix; `flowq dashboard` as a real process."""

from __future__ import annotations

import base64
import re
import subprocess
import sys
import time
import warnings

import dashboard_app as da
import httpx
import pytest
import sqlalchemy as sa
from dashboard_app import dead_run, reset_broken  # noqa: F401 (an autouse fixture)
from starlette.applications import Starlette
from starlette.routing import Mount
from support import dashboard_client as client
from support import free_port

import flowq

with warnings.catch_warnings():  # it will move to httpx2; what it tests does not change
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from flowq.dashboard import create_app
from flowq.ops.runs import get_run
from flowq.testing import drain, running_worker, wait_until

TOKEN = "s3cret-token-for-tests"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def csrf_of(c: TestClient, path: str = "/dead") -> str:
    page = c.get(path)
    assert page.status_code == 200, page.text
    match = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert match, "no CSRF field on the page"
    return match.group(1)


def logged_in(engine: sa.Engine) -> TestClient:
    c = client(engine, allow_actions=True, token=TOKEN)
    r = c.get(f"/?token={TOKEN}")
    assert r.status_code == 200 and "Queues" in r.text
    return c


def test_every_page_renders_what_the_database_holds(engine: sa.Engine, db_url: str) -> None:
    run_id = dead_run(engine, note="plain", key="order-42")
    with engine.begin() as conn:
        ok = flowq.enqueue(conn, da.two, n=1).id
    drain(engine, da.app)
    c = client(engine)
    with running_worker(da.app, db_url, name="dash-worker-1"):
        wait_until(lambda: "dash-worker-1" in c.get("/workers").text, message="the worker")
        home = c.get("/")
    assert home.status_code == 200
    assert "dash" in home.text and "dash-limited" in home.text
    assert "concurrency 3" in home.text and "read-only" in home.text
    assert "dash_fragile" in home.text  # dead jobs by task
    runs = c.get("/runs")
    assert f">{run_id}<" in runs.text and f">{ok}<" in runs.text
    assert f">{ok}<" not in c.get("/runs?status=dead").text
    assert f">{run_id}<" in c.get("/runs?status=dead&task=dash_fragile").text
    assert f">{run_id}<" not in c.get("/runs?queue=dash-limited").text
    assert f">{ok}<" in c.get("/runs?queue=dash-limited").text
    run = c.get(f"/runs/{ok}")
    assert run.status_code == 200 and "succeeded" in run.text and "first" in run.text
    assert "&#34;n&#34;: 2" in run.text or '"n": 2' in run.text.replace("&#34;", '"')
    dead = c.get("/dead")
    assert f">{run_id}<" in dead.text and "failed on plain" in dead.text
    assert "<button" not in dead.text.replace('<button type="submit">Filter', "")  # read-only
    # Find by id and by idempotency key; an unknown one says so.
    assert c.get(f"/runs?find={run_id}", follow_redirects=False).headers["location"] == \
        f"/runs/{run_id}"
    assert c.get("/runs?find=order-42", follow_redirects=False).headers["location"] == \
        f"/runs/{run_id}"
    missing = c.get("/runs?find=no-such-key")
    assert missing.status_code == 200 and "No run has that id" in missing.text


def test_hostile_arguments_and_errors_are_escaped(engine: sa.Engine) -> None:
    run_id = dead_run(engine)
    c = client(engine)
    for path in (f"/runs/{run_id}", "/dead", "/runs"):
        page = c.get(path)
        assert "<script>" not in page.text and "<img src=x" not in page.text, path
        assert "default-src 'none'" in page.headers["content-security-policy"]
    run = c.get(f"/runs/{run_id}").text
    assert "&lt;script&gt;document.title=" in run  # the argument and the error, as text
    assert run.count("&lt;script&gt;") >= 2


def test_bad_input_gets_a_page_not_a_traceback(engine: sa.Engine) -> None:
    c = client(engine)
    assert c.get("/runs/123456789").status_code == 404
    assert c.get(f"/runs/{2**70}").status_code == 404
    assert c.get("/runs?status=bogus").status_code == 400
    assert c.get("/runs?task=%3Cscript%3E").status_code == 400
    assert c.get("/runs?queue=bad%20queue").status_code == 400
    assert c.get("/runs?before=abc").status_code == 400
    assert "&lt;script&gt;" in c.get("/runs?task=%3Cscript%3E").text


def test_a_read_only_dashboard_refuses_every_post(engine: sa.Engine) -> None:
    run_id = dead_run(engine)
    c = client(engine)
    csrf = csrf_of(c)
    for path in (f"/runs/{run_id}/retry", f"/runs/{run_id}/cancel", "/queues/dash/pause",
                 "/queues/dash/resume", "/dead/retry"):
        r = c.post(path, data={"csrf": csrf, "all": "1"})
        assert r.status_code == 403 and "read-only" in r.text, path
    assert get_run(engine, run_id).status == "dead"


def test_actions_need_a_login(engine: sa.Engine) -> None:
    with pytest.raises(flowq.ConfigurationError, match="token or basic auth"):
        create_app(engine, allow_actions=True)


def test_a_wrong_token_is_401_and_changes_nothing(engine: sa.Engine) -> None:
    run_id = dead_run(engine)
    c = client(engine, allow_actions=True, token=TOKEN)
    assert c.get("/").status_code == 401  # the pages too, once a token is set
    assert c.get("/?token=wrong-token-value").status_code == 401
    r = c.post(f"/runs/{run_id}/retry", data={"csrf": "x"},
               headers={"Authorization": "Bearer wrong-token-value"})
    assert r.status_code == 401
    r = c.post("/login", data={"token": "wrong-token-value"})
    assert r.status_code == 401
    assert get_run(engine, run_id).status == "dead"
    ok = c.get("/", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200


def test_basic_auth(engine: sa.Engine) -> None:
    run_id = dead_run(engine)
    c = client(engine, allow_actions=True, basic_auth=("ops", "pa:ss"))
    r = c.get("/")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")

    def basic(user: str, password: str) -> dict[str, str]:
        return {"Authorization": "Basic " + base64.b64encode(
            f"{user}:{password}".encode()).decode()}

    assert c.get("/", headers=basic("ops", "wrong")).status_code == 401
    assert c.get("/", headers={"Authorization": "Basic %%%"}).status_code == 401
    page = c.get("/dead", headers=basic("ops", "pa:ss"))
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
    r = c.post(f"/runs/{run_id}/retry", data={"csrf": csrf}, headers=basic("ops", "wrong"))
    assert r.status_code == 401 and get_run(engine, run_id).status == "dead"
    r = c.post(f"/runs/{run_id}/retry", data={"csrf": csrf}, headers=basic("ops", "pa:ss"),
               follow_redirects=False)
    assert r.status_code == 303 and get_run(engine, run_id).status == "pending"


def test_a_forged_post_without_the_csrf_token_is_refused(engine: sa.Engine) -> None:
    run_id = dead_run(engine)
    c = logged_in(engine)
    csrf = csrf_of(c)
    assert c.post(f"/runs/{run_id}/retry").status_code == 403
    assert c.post(f"/runs/{run_id}/retry", data={"csrf": "forged"}).status_code == 403
    # The right field, but from a page of another site.
    r = c.post(f"/runs/{run_id}/retry", data={"csrf": csrf},
               headers={"Origin": "https://evil.example"})
    assert r.status_code == 403
    # The field without the cookie (a cross-site form cannot send the SameSite cookie).
    bare = TestClient(c.app, base_url="http://127.0.0.1:8080")
    r = bare.post(f"/runs/{run_id}/retry", data={"csrf": csrf},
                  headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 403
    assert get_run(engine, run_id).status == "dead"
    r = c.post(f"/runs/{run_id}/retry", data={"csrf": csrf},
               headers={"Origin": "http://127.0.0.1:8080"})
    assert r.status_code == 200 and "1 dead step(s) retried" in r.text
    assert get_run(engine, run_id).status == "pending"


def test_actions_retry_cancel_pause_resume_and_bulk_retry(engine: sa.Engine) -> None:
    runs = [dead_run(engine, note=f"n{i}") for i in range(5)]
    c = logged_in(engine)
    csrf = csrf_of(c)
    r = c.post("/queues/dash/pause", data={"csrf": csrf})
    assert r.status_code == 200 and "paused" in r.text
    assert next(q for q in flowq.ops.queues.list_queues(engine) if q.name == "dash").paused
    r = c.post("/queues/dash/resume", data={"csrf": csrf})
    assert not next(q for q in flowq.ops.queues.list_queues(engine) if q.name == "dash").paused
    # Bulk: two selected, one of them twice and a stale id; then all the rest.
    r = c.post("/dead/retry", data={"csrf": csrf, "confirm": "yes",
                                    "run_id": [str(runs[0]), str(runs[1]), str(runs[1]),
                                               "999999"]})
    assert "2 dead run(s) retried" in r.text and "2 skipped" in r.text
    assert [get_run(engine, i).status for i in runs[:2]] == ["pending", "pending"]
    r = c.post("/dead/retry", data={"csrf": csrf, "run_id": ["1; DROP TABLE x"]})
    assert r.status_code == 400
    r = c.post("/dead/retry", data={"csrf": csrf, "all": "1", "task": "dash_fragile",
                                    "confirm": "yes"})
    assert "3 dead run(s) retried" in r.text
    da.BROKEN["on"] = False
    drain(engine, da.app)
    assert {get_run(engine, i).status for i in runs} == {"succeeded"}
    # Cancel a pending run; cancelling a finished one is a 409 with a sentence.
    with engine.begin() as conn:
        pending = flowq.enqueue(conn, da.fragile, note="later").id
    r = c.post(f"/runs/{pending}/cancel", data={"csrf": csrf})
    assert r.status_code == 200 and get_run(engine, pending).status == "cancelled"
    r = c.post(f"/runs/{runs[0]}/cancel", data={"csrf": csrf})
    assert r.status_code == 409 and "already ended succeeded" in r.text
    # `next` may only point into the dashboard.
    with engine.begin() as conn:
        other = flowq.enqueue(conn, da.fragile, note="x").id
    r = c.post(f"/runs/{other}/cancel", data={"csrf": csrf, "next": "https://evil.example/"},
               follow_redirects=False)
    assert r.headers["location"] == f"/runs/{other}"


def test_mounted_in_an_existing_asgi_app(engine: sa.Engine) -> None:
    run_id = dead_run(engine)
    outer = Starlette(routes=[Mount("/ops/flowq", app=create_app(
        engine, allow_actions=True, token=TOKEN))])
    c = TestClient(outer, base_url="http://127.0.0.1:8080")
    home = c.get(f"/ops/flowq/?token={TOKEN}")
    assert home.status_code == 200
    assert 'href="/ops/flowq/runs"' in home.text
    page = c.get(f"/ops/flowq/runs/{run_id}")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
    assert f'action="/ops/flowq/runs/{run_id}/retry"' in page.text
    r = c.post(f"/ops/flowq/runs/{run_id}/retry", data={"csrf": csrf}, follow_redirects=False)
    assert r.headers["location"] == f"/ops/flowq/runs/{run_id}"
    assert get_run(engine, run_id).status == "pending"


def test_a_database_gone_away_is_a_503_page(engine: sa.Engine) -> None:
    gone = sa.create_engine("postgresql+psycopg://flowq:pw@127.0.0.1:1/nothing")
    c = client(gone)
    r = c.get("/")
    assert r.status_code == 503 and "cannot reach the database" in r.text
    assert "pw@" not in r.text


# -- the command ------------------------------------------------------------------------------


def test_the_command_serves_binds_loopback_and_says_when_the_port_is_taken(
        db_url: str, empty_db_url: str) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flowq", "dashboard", "--database-url",
                             db_url, "--port", str(port), "--allow-actions"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        for _ in range(2):
            line += proc.stderr.readline()  # type: ignore[union-attr]
        assert f"on http://127.0.0.1:{port}/" in line and "actions enabled" in line
        token = re.search(r"\?token=(\S+)", line).group(1)  # type: ignore[union-attr]
        deadline = time.monotonic() + 20
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/?token={token}", follow_redirects=True)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert r.status_code == 200 and "Queues" in r.text
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 401
        # The port is taken now: a second dashboard says so in one sentence.
        taken = subprocess.run([sys.executable, "-m", "flowq", "dashboard", "--database-url",
                                db_url, "--port", str(port)], capture_output=True, text=True,
                               timeout=60)
        assert taken.returncode == 2
        assert "cannot serve the dashboard on 127.0.0.1" in taken.stderr
        assert "Traceback" not in taken.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    no_schema = subprocess.run([sys.executable, "-m", "flowq", "dashboard", "--database-url",
                                empty_db_url, "--port", str(free_port())],
                               capture_output=True, text=True, timeout=60)
    assert no_schema.returncode == 2 and "flowq migrate" in no_schema.stderr
    assert "Traceback" not in no_schema.stderr


def test_long_values_are_cut_on_the_page(engine: sa.Engine) -> None:
    run_id = dead_run(engine, note="x" * 100_000)
    page = client(engine).get(f"/runs/{run_id}")
    assert page.status_code == 200
    assert "more characters)" in page.text and len(page.text) < 150_000


@pytest.mark.parametrize(("args", "message"), [
    (["--token", "short"], "at least 8 characters"),
    (["--basic-auth", "nocolon"], "USER:PASSWORD"),
    (["--basic-auth", ":pw"], "USER:PASSWORD"),
    (["--app", "no_such_module:app"], "no such module"),
])
def test_bad_options_get_one_sentence(db_url: str, args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "flowq", "dashboard", "--database-url", db_url,
                           "--port", str(free_port()), *args], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_without_the_extra_it_says_what_to_install(db_url: str) -> None:
    code = ("import sys; sys.modules['uvicorn'] = None; from flowq.cli import main; "
            f"main(['dashboard', '--database-url', {db_url!r}])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "pip install 'flowq[dashboard]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_token_login_expires_and_logs_out(engine: sa.Engine,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from flowq.dashboard import auth

    c = logged_in(engine)
    home = c.get("/")
    assert home.status_code == 200 and 'id="logout"' in home.text
    csrf = csrf_of(c)
    assert c.post("/logout").status_code == 403  # a form without its CSRF token
    r = c.post("/logout", data={"csrf": csrf}, follow_redirects=False)
    assert r.status_code == 303 and 'flowq_session=""' in r.headers["set-cookie"]
    c.cookies.delete("flowq_session")
    assert c.get("/").status_code == 401
    # Logged in again, then 12 hours later: the cookie is refused.
    assert c.get(f"/?token={TOKEN}").status_code == 200
    now = time.time()
    monkeypatch.setattr(auth.time, "time", lambda: now + auth.SESSION_MAX_AGE + 1)
    assert c.get("/").status_code == 401
    # A cookie from the future, or one whose time was edited, is refused too.
    monkeypatch.setattr(auth.time, "time", lambda: now)
    value = c.cookies.get("flowq_session") or ""
    assert c.get("/").status_code == 200  # the same cookie, now in time again
    issued, _, mac = value.partition(".")
    c.cookies.delete("flowq_session")
    c.cookies.set("flowq_session", f"{int(issued) + 3600}.{mac}")
    assert c.get("/").status_code == 401


def test_a_copied_session_cookie_is_refused_after_logout(engine: sa.Engine) -> None:
    """Issue 20, #3: logout ends the session on the server, so a copy of the cookie (taken
    before the browser deleted it) opens no page and changes nothing."""
    run_id = dead_run(engine)
    c = logged_in(engine)
    csrf = csrf_of(c)
    copied = {"flowq_session": c.cookies["flowq_session"], "flowq_csrf": csrf}
    thief = TestClient(c.app, base_url="http://127.0.0.1:8080", cookies=copied)
    assert thief.get("/dead").status_code == 200  # the copy works while the session lives
    r = c.post("/logout", data={"csrf": csrf}, follow_redirects=False)
    assert r.status_code == 303
    assert thief.get("/").status_code == 401
    assert thief.get(f"/runs/{run_id}").status_code == 401
    for action in (f"/runs/{run_id}/retry", f"/runs/{run_id}/cancel", "/dead/retry",
                   "/queues/dash/pause"):
        r = thief.post(action, data={"csrf": csrf, "run_id": str(run_id), "all": "1"},
                       follow_redirects=False)
        assert r.status_code == 401, (action, r.status_code)
    assert get_run(engine, run_id).status == "dead"
    assert not any(q.paused for q in flowq.ops.queues.list_queues(engine) if q.name == "dash")
    # Logging in again gives a new session; the old copy stays dead.
    assert c.get(f"/?token={TOKEN}").status_code == 200
    assert thief.get("/").status_code == 401


def test_stored_sessions_are_bounded_and_pruned(monkeypatch: pytest.MonkeyPatch) -> None:
    from flowq.dashboard import auth

    guard = auth.Guard(token=TOKEN)
    first = guard.session_value()
    cookies = [guard.session_value() for _ in range(auth.MAX_SESSIONS + 500)]
    assert guard.live_sessions == auth.MAX_SESSIONS
    assert not guard.session_ok(first)  # the oldest were dropped
    assert guard.session_ok(cookies[-1]) and guard.session_ok(cookies[-auth.MAX_SESSIONS])
    assert not guard.session_ok(cookies[-auth.MAX_SESSIONS - 1])
    guard.end_session(cookies[-1])
    assert not guard.session_ok(cookies[-1]) and guard.live_sessions == auth.MAX_SESSIONS - 1
    # Expired sessions are pruned at the next login.
    now = time.time()
    monkeypatch.setattr(auth.time, "time", lambda: now + auth.SESSION_MAX_AGE + 1)
    fresh = guard.session_value()
    assert guard.live_sessions == 1 and guard.session_ok(fresh)
    # A session id under another dashboard's key (or another token) is refused.
    assert not auth.Guard(token=TOKEN).session_ok(fresh)
    assert not auth.Guard(token=TOKEN + "x", _key=b"k" * 32).session_ok(fresh)
