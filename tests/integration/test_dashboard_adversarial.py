"""An adversarial review of the dashboard (docs/observability.md, "The web dashboard"): what a
hostile user or a hostile page could send it. Tests marked `Fixed after review` demonstrated a problem
found by an adversarial review, now fixed; the others check that a promise holds.

Sizes and times of the big pages are printed (run with `-s`), never asserted as times."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import re
import subprocess
import sys
import time
import warnings
from typing import Any

import dashboard_app as da
import httpx
import pytest
import sqlalchemy as sa
from dashboard_app import dead_run, reset_broken  # noqa: F401 (an autouse fixture)
from starlette.applications import Starlette
from starlette.routing import Mount
from support import free_port

import flowq

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from flowq.dashboard import create_app
from flowq.ops.runs import get_run
from flowq.testing import drain

TOKEN = "s3cret-token-for-tests"
BASE = "http://127.0.0.1:8080"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
# Markup that must never appear unescaped on a page (the dashboard's own charts are an
# <svg class="chart|dag|timeline" ...>, drawn by flowq.dashboard.svg: any other is hostile).
HOSTILE_MARKUP = re.compile(
    r"<(?:script|img|b|i|s|u|svg(?! class=\"(?:chart|dag|timeline)\"))[\s>/]", re.I)


def client(engine: sa.Engine, **kwargs: Any) -> TestClient:
    """A client that turns an unhandled exception into the 500 a browser would get."""
    return TestClient(create_app(engine, **kwargs), base_url=BASE, raise_server_exceptions=False)


def csrf_of(c: TestClient, path: str = "/dead") -> str:
    page = c.get(path)
    match = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert match, page.text
    return match.group(1)


def logged_in(engine: sa.Engine) -> TestClient:
    c = client(engine, allow_actions=True, token=TOKEN)
    assert c.get(f"/?token={TOKEN}").status_code == 200
    return c


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


async def raw_asgi(app: Any, method: str, path: str, query: bytes = b"",
                   body: bytes = b"", headers: list[tuple[bytes, bytes]] | None = None
                   ) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request straight to the ASGI app, for what httpx refuses to send (URLs > 64 KiB)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": query,
             "headers": [(b"host", b"127.0.0.1:8080"), *(headers or [])],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8080)}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    status, hdrs, chunks = 0, {}, []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, hdrs
        if message["type"] == "http.response.start":
            status, hdrs = message["status"], dict(message["headers"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, hdrs, b"".join(chunks)


# == Bad input: a 400 (or 404) page, never a 500 =================================================


# Fixed after review: `str.isdigit()` accepts Unicode digits such as "²" that `int()` refuses (ValueError),
# a NUL byte in `find` reaches PostgreSQL (DataError), a 19-digit `before` above 2**63-1 reaches
# PostgreSQL as "bigint out of range" (DataError), and a run id of thousands of digits trips
# Python's int-string limit inside Starlette's `{run_id:int}` convertor. Each is an unhandled
# exception: a bare "Internal Server Error" instead of the promised "400 page with the reason".
@pytest.mark.parametrize("path", [
    "/runs?before=%C2%B2",                  # before=² (superscript two)
    "/dead?before=%C2%B2",
    "/runs?find=%C2%B2",                    # find=²
    "/runs?find=%D9%A1%C2%B2",              # find=١² (Arabic-Indic one, superscript two)
    "/runs?find=abc%00def",                 # a NUL byte
    "/runs?before=9999999999999999999",     # 19 digits, above the bigint range
    "/dead?before=9223372036854775808",     # 2**63
    "/runs/" + "1" * 5000,                  # beyond sys.get_int_max_str_digits()
], ids=["runs-before-sup2", "dead-before-sup2", "find-sup2", "find-arabic-digits", "find-nul",
        "runs-before-19-digits", "dead-before-2**63", "run-id-5000-digits"])
def test_bad_query_values_get_a_4xx_page_not_a_500(engine: sa.Engine, path: str) -> None:
    r = client(engine).get(path)
    # A `find` that is not a run id is looked up as an idempotency key: not found, said so.
    assert r.status_code in (400, 404) or (
        r.status_code == 200 and "No run has that id" in r.text), (r.status_code, r.text[:200])
    assert "text/html" in r.headers["content-type"]


# Fixed after review: the bulk retry form checks each run_id with `isdigit()` and then calls `int()`: a
# "²" is an unhandled ValueError (500) instead of the 400 that "1; DROP TABLE x" gets.
def test_bulk_retry_with_a_unicode_digit_run_id_is_a_400(engine: sa.Engine) -> None:
    dead_run(engine)
    c = logged_in(engine)
    csrf = csrf_of(c)
    r = c.post("/dead/retry", data={"csrf": csrf, "run_id": "\u00b2"})
    assert r.status_code == 400, (r.status_code, r.text[:200])


def test_bad_filters_and_ids_that_are_handled(engine: sa.Engine) -> None:
    c = client(engine)
    for path in ("/runs?status=%00", "/runs?task=%00", "/runs?queue=%00", "/dead?task=%00",
                 "/runs?before=0", "/runs?before=-1", "/runs?status=dead%27", "/dead?queue=a/b"):
        r = c.get(path)
        assert r.status_code == 400, path
    assert c.get(f"/runs/{2**63}").status_code == 404
    assert c.get("/runs/0").status_code == 404
    assert c.get("/runs/-1").status_code == 404  # no route
    assert c.get("/runs?find=%FF%FE").status_code == 200  # undecodable: replaced, not found


# == Escaping =====================================================================================


def test_every_user_value_is_escaped_everywhere(engine: sa.Engine) -> None:
    evil_key = "<script>k</script>\"' onmouseover=alert(1) x='"
    dead = dead_run(engine, key=evil_key)
    da.BROKEN["on"] = False
    with engine.begin() as conn:
        ok = flowq.enqueue(conn, da.fragile, note="<svg onload=alert(2)>\"'&").id
    drain(engine, da.app)  # its result echoes the hostile note
    with engine.begin() as conn:  # a worker row nobody vetted: name, host, queues, version
        conn.execute(sa.text(
            "INSERT INTO flowq.workers (name, host, pid, queues, tasks, concurrency, version) "
            "VALUES (:n, :h, 1, :q, :t, 1, :v)"),
            {"n": "<b>w</b>\"'", "h": "<img src=x onerror=alert(3)>", "q": ["<i>q</i>", "dash"],
             "t": ["<s>t</s>"], "v": "<u>v</u>"})
    c = client(engine)
    pages = ["/", "/workers", "/runs", f"/runs/{dead}", f"/runs/{ok}", "/dead",
             "/runs?find=%22%3E%3Cscript%3Ealert(4)%3C/script%3E",   # echoed into value="..."
             "/runs?task=%22%3E%3Cb%3E", "/dead?queue=%22%3E%3Cb%3E"]  # 400 pages echo them
    for path in pages:
        r = c.get(path)
        assert r.status_code in (200, 400), path
        assert not HOSTILE_MARKUP.search(r.text), (path, HOSTILE_MARKUP.search(r.text))
        assert "script-src" not in r.headers["content-security-policy"]
        assert "default-src 'none'" in r.headers["content-security-policy"]
    assert "&lt;img src=x" in c.get("/workers").text
    assert "&lt;svg onload" in c.get(f"/runs/{ok}").text
    assert "&lt;script&gt;k" in c.get("/runs").text
    found = c.get("/runs?find=%22%3E%3Cscript%3Ealert(4)%3C/script%3E")
    assert 'value="&#34;&gt;&lt;script&gt;' in found.text
    # The flash cookie is not signed: whoever can set a cookie for the host can put text in
    # it, but it stays text.
    fl = TestClient(create_app(engine), base_url=BASE,
                    cookies={"flowq_flash": "<script>alert(5)</script>"})
    assert "&lt;script&gt;alert(5)" in fl.get("/").text


# == Redirects ====================================================================================


@pytest.mark.parametrize("target", [
    "//evil.example", "/\\evil.example", "\\\\evil.example", "/\t/evil.example",
    "https:evil.example", "http:/evil.example", "https://evil.example/",
    "/\r\nSet-Cookie: x=1", "javascript:alert(1)",
])
def test_login_next_never_leaves_the_site(engine: sa.Engine, target: str) -> None:
    c = client(engine, allow_actions=True, token=TOKEN)
    r = c.post("/login", data={"token": TOKEN, "next": target}, follow_redirects=False)
    assert r.status_code == 303
    location = r.headers["location"]
    assert location.startswith("/") and not location.startswith("//")
    assert "\\" not in location and "\r" not in location and "\n" not in location
    assert httpx.URL(BASE).join(location).host == "127.0.0.1"


def test_token_redirect_keeps_the_other_parameters_and_stays_on_the_path(
        engine: sa.Engine) -> None:
    c = client(engine, allow_actions=True, token=TOKEN)
    r = c.get(f"/runs?token={TOKEN}&status=dead&next=//evil.example", follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/runs?status=dead&next=%2F%2Fevil.example"
    assert TOKEN not in r.headers["location"]
    assert "flowq_session=" in r.headers["set-cookie"]
    assert "HttpOnly" in r.headers["set-cookie"] and "SameSite=strict" in r.headers["set-cookie"]


# Fixed after review: when mounted, `next` is accepted as soon as it starts with the mount path, so
# "/ops/flowq/../../elsewhere" sends the browser to "/elsewhere" on the host, out of the
# dashboard (same site, so low). Normalize the path (posixpath.normpath) before the check.
def test_mounted_next_cannot_climb_out_of_the_mount(engine: sa.Engine) -> None:
    outer = Starlette(routes=[Mount("/ops/flowq", app=create_app(
        engine, allow_actions=True, token=TOKEN))])
    c = TestClient(outer, base_url=BASE)
    r = c.post("/ops/flowq/login", data={"token": TOKEN, "next": "/ops/flowq/../../elsewhere"},
               follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/ops/flowq/", r.headers["location"]


def test_mounted_cookies_links_and_login_follow_the_prefix(engine: sa.Engine) -> None:
    run_id = dead_run(engine)
    outer = Starlette(routes=[Mount("/ops/flowq", app=create_app(
        engine, allow_actions=True, token=TOKEN))])
    c = TestClient(outer, base_url=BASE)
    login = c.get("/ops/flowq/dead")
    assert login.status_code == 401
    assert 'action="/ops/flowq/login"' in login.text
    assert 'name="next" value="/ops/flowq/dead"' in login.text
    assert "Path=/ops/flowq/" in login.headers["set-cookie"]
    r = c.get(f"/ops/flowq/runs?token={TOKEN}&status=dead", follow_redirects=False)
    assert r.headers["location"] == "/ops/flowq/runs?status=dead"
    assert "Path=/ops/flowq/" in r.headers["set-cookie"]
    page = c.get("/ops/flowq/runs")
    links = re.findall(r'(?:href|action)="([^"]+)"', page.text)
    assert links and all(link.startswith("/ops/flowq/") for link in links), links
    csrf = csrf_of(c, f"/ops/flowq/runs/{run_id}")
    r = c.post(f"/ops/flowq/runs/{run_id}/retry", data={"csrf": csrf}, follow_redirects=False)
    assert r.headers["location"] == f"/ops/flowq/runs/{run_id}"
    assert "Path=/ops/flowq/" in r.headers["set-cookie"]  # the flash


# == CSRF =========================================================================================


def test_csrf_tricks_are_refused(engine: sa.Engine) -> None:
    run_id = dead_run(engine)
    c = logged_in(engine)
    csrf = csrf_of(c)
    refused = [
        ({"csrf": csrf}, {"Origin": "null"}),
        ({"csrf": csrf}, {"Origin": ""}),
        ({"csrf": csrf}, {"Origin": "http://127.0.0.1:9999"}),  # same site, other port
        ({"csrf": csrf}, {"Origin": "http://127.0.0.1:8080.evil.example"}),
        ({"csrf": csrf}, {"Origin": "http://evil.example@127.0.0.1:8080x"}),
        ({"csrf": csrf + "x"}, {}),
        ({"csrf": ""}, {}),
        ({}, {}),
    ]
    for data, headers in refused:
        r = c.post(f"/runs/{run_id}/retry", data=data, headers=headers, follow_redirects=False)
        assert r.status_code == 403, (data, headers)
    # The field with no cookie; the cookie with no field; a JSON body; the token in the query.
    bare = TestClient(c.app, base_url=BASE, headers={"Authorization": f"Bearer {TOKEN}"})
    assert bare.post(f"/runs/{run_id}/retry", data={"csrf": csrf}).status_code == 403
    assert c.post(f"/runs/{run_id}/retry", json={"csrf": csrf}).status_code == 403
    assert c.post(f"/runs/{run_id}/retry?csrf={csrf}").status_code == 403
    # No method override: GET (or ?_method=) on an action is 405, never an action.
    assert c.get(f"/runs/{run_id}/retry").status_code == 405
    assert c.get(f"/runs/{run_id}/retry?_method=POST&csrf={csrf}").status_code == 405
    assert c.post(f"/runs/{run_id}/retry?_method=POST").status_code == 403
    # A multipart body with a file is a 400 (max_files=0), not a 500.
    assert c.post(f"/runs/{run_id}/retry", data={"csrf": csrf},
                  files={"f": ("a.txt", b"x")}).status_code == 400
    assert get_run(engine, run_id).status == "dead"
    # No Origin at all (old browsers, some proxies) with a matching pair is accepted, whatever
    # the Referer says: the pair alone proves the page was ours.
    r = c.post(f"/runs/{run_id}/retry", data={"csrf": csrf},
               headers={"Referer": "https://evil.example/x"}, follow_redirects=False)
    assert r.status_code == 303 and get_run(engine, run_id).status == "pending"


# == Authentication ===============================================================================


def test_auth_bypasses_fail(engine: sa.Engine) -> None:
    run_id = dead_run(engine)
    app = create_app(engine, allow_actions=True, token=TOKEN)
    c = TestClient(app, base_url=BASE)
    r = c.get("/?token=wrong-token-value", follow_redirects=False)
    assert r.status_code == 401 and "flowq_session" not in r.headers.get("set-cookie", "")
    assert c.get(f"/?token={TOKEN[:-1]}").status_code == 401
    assert c.get(f"/?token={TOKEN}%20").status_code == 401
    # Forged session cookies: empty, the token itself, a plain hash, an HMAC with an empty key.
    for value in ("", "x", TOKEN, hashlib.sha256(TOKEN.encode()).hexdigest(),
                  hmac.new(b"", TOKEN.encode(), hashlib.sha256).hexdigest()):
        forged = TestClient(app, base_url=BASE, cookies={"flowq_session": value})
        assert forged.get("/").status_code == 401, value
    # A real session of another dashboard process (another key) is no good here.
    other = logged_in(engine)
    stolen = TestClient(app, base_url=BASE,
                        cookies={"flowq_session": other.cookies["flowq_session"]})
    assert stolen.get("/").status_code == 401
    for header in ("Bearer", "Bearer ", "bearer wrong-token-value", f"Token {TOKEN}",
                   f"Basic {TOKEN}", f"Bearer{TOKEN}"):
        assert c.get("/", headers={"Authorization": header}).status_code == 401, header
    assert c.get("/", headers={"Authorization": f"bEaReR  {TOKEN} "}).status_code == 200
    # POST /login without credentials, or on a dashboard without a token login: no session.
    assert c.post("/login").status_code == 401
    assert c.post("/login", data={"token": ""}).status_code == 401
    assert client(engine).post("/login", data={"token": "x"}).status_code == 404
    assert client(engine, basic_auth=("ops", "pw")).post(
        "/login", data={"token": "x"}).status_code == 404
    # 401 for who is not logged in, 403 for a read-only dashboard whoever asks.
    assert c.post(f"/runs/{run_id}/retry").status_code == 401
    assert client(engine, token=TOKEN).post(f"/runs/{run_id}/retry").status_code == 403
    assert get_run(engine, run_id).status == "dead"


def test_basic_auth_edge_cases(engine: sa.Engine) -> None:
    c = client(engine, allow_actions=True, basic_auth=("ops", "pässwörd:x"))
    good = basic("ops", "pässwörd:x")
    assert c.get("/", headers=good).status_code == 200
    bad = [
        basic("ops", "pässwörd"), basic("ops", ""), basic("", ""), basic("OPS", "pässwörd:x"),
        {"Authorization": "Basic " + base64.b64encode(b"ops").decode()},  # no colon
        {"Authorization": "Basic " + base64.b64encode("ops:pässwörd:x".encode("latin-1"))
         .decode()},  # latin-1, not UTF-8
        {"Authorization": "Basic not*base64"}, {"Authorization": "Basic "},
        {"Authorization": "Basic " + good["Authorization"][6:-2]},  # truncated
    ]
    for headers in bad:
        r = c.get("/", headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"].startswith("Basic realm=")


# Fixed after review: `create_app(basic_auth=...)` does not check the pair the way the CLI's
# `parse_basic_auth` does: `basic_auth=("", "")` lets in anyone who sends "Authorization: Basic "
# (empty credentials), and `("ops", "")` anyone who sends just the user name. An embedder who
# reads them from an unset environment variable gets an open dashboard with actions. Fix:
# validate in Guard.__post_init__ (both non-empty strings), like the token's length.
@pytest.mark.parametrize("pair", [("", ""), ("ops", ""), ("", "pw")])
def test_create_app_refuses_empty_basic_auth_credentials(engine: sa.Engine,
                                                         pair: tuple[str, str]) -> None:
    with pytest.raises(flowq.ConfigurationError):
        app = create_app(engine, allow_actions=True, basic_auth=pair)
        c = TestClient(app, base_url=BASE)
        for header in ("Basic ", "Basic " + base64.b64encode(b"ops").decode(),
                       "Basic " + base64.b64encode(b":").decode(),
                       "Basic " + base64.b64encode(b":pw").decode()):
            assert c.get("/", headers={"Authorization": header}).status_code == 401, header


# Fixed after review (low): with a token login, a 401 has no WWW-Authenticate header (RFC 9110 §15.5.2:
# a 401 MUST carry one). Send `WWW-Authenticate: Bearer realm="flowq"` (or answer 403/200 with
# the login form).
def test_a_token_401_names_its_scheme(engine: sa.Engine) -> None:
    r = client(engine, allow_actions=True, token=TOKEN).get("/")
    assert r.status_code == 401
    assert r.headers.get("www-authenticate", "").lower().startswith("bearer"), dict(r.headers)


# Fixed after review (low): over HTTPS (behind a TLS proxy with forwarded headers, or mounted in an HTTPS
# app) the session cookie still lacks `Secure`, so a network attacker who gets the browser to
# load any http:// URL of the host reads it. Set secure=True when request.url.scheme == "https".
def test_the_session_cookie_is_secure_over_https(engine: sa.Engine) -> None:
    c = TestClient(create_app(engine, allow_actions=True, token=TOKEN),
                   base_url="https://dash.example")
    r = c.get(f"/?token={TOKEN}", follow_redirects=False)
    assert r.status_code == 303
    assert "secure" in r.headers["set-cookie"].lower(), r.headers["set-cookie"]


# == DNS rebinding ===============================================================================


# Fixed after review (medium): `flowq dashboard` binds 127.0.0.1 and, read-only, asks for no login; but it
# answers any Host header, so a web page the operator visits can DNS-rebind its own name to
# 127.0.0.1 and read every page (job arguments, results and errors) through the browser. The
# loopback bind is the only protection the docs offer without --token. Fix: when --host is a
# loopback address, refuse (400/421) a Host other than localhost/127.0.0.1/[::1] (Starlette's
# TrustedHostMiddleware); a `allowed_hosts=` parameter for create_app.
def test_the_command_refuses_a_foreign_host_header(db_url: str) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flowq", "dashboard", "--database-url",
                             db_url, "--port", str(port)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "the dashboard did not start"
                time.sleep(0.1)
        r = httpx.get(f"http://127.0.0.1:{port}/runs",
                      headers={"Host": f"rebind.attacker.example:{port}"})
        assert r.status_code in (400, 403, 421), (r.status_code, r.text[:100])
    finally:
        proc.terminate()
        proc.wait(timeout=20)


# == Huge inputs ==================================================================================


def test_huge_inputs_are_bounded(engine: sa.Engine) -> None:
    dead_run(engine)
    app = create_app(engine, allow_actions=True, token=TOKEN)
    auth = [(b"authorization", f"Bearer {TOKEN}".encode())]
    # `find` of 1 MB (httpx refuses such a URL: straight to the app): not found, echoed once.
    status, _, body = asyncio.run(raw_asgi(app, "GET", "/runs", b"find=" + b"a" * 1_000_000,
                                           headers=auth))
    print(f"\nfind of 1 MB: {status}, page {len(body):,} bytes")
    assert status == 200 and b"No run has that id" in body and len(body) < 1_100_000
    status, _, body = asyncio.run(raw_asgi(app, "GET", "/runs", b"find=" + b"1" * 1_000_000,
                                           headers=auth))
    assert status == 200
    c = TestClient(app, base_url=BASE, raise_server_exceptions=False)
    c.get(f"/?token={TOKEN}")
    csrf = csrf_of(c)
    form = {"content-type": "application/x-www-form-urlencoded"}
    # 5,000 run_id fields: refused as too many fields; 1,000 are served (all stale here).
    many = "&".join(f"run_id={i}" for i in range(1, 5001)) + f"&csrf={csrf}"
    assert c.post("/dead/retry", content=many, headers=form).status_code == 400
    some = "&".join(f"run_id={i}" for i in range(1000, 2000)) + f"&csrf={csrf}"
    r = c.post("/dead/retry", content=some, headers=form)  # the confirmation: lists 20
    assert r.status_code == 200 and "and 980 more" in r.text and len(r.content) < 200_000
    r = c.post("/dead/retry", content=some + "&confirm=yes", headers=form)
    assert r.status_code == 200 and "1000 skipped" in r.text
    # An enormous body before any login: refused, not buffered into a page.
    bare = TestClient(app, base_url=BASE, raise_server_exceptions=False)
    r = bare.post("/login", content=b"token=" + b"a" * 30_000_000, headers=form)
    assert r.status_code == 400
    fields = "&".join(f"f{i}=1" for i in range(5000)) + f"&token={TOKEN}"
    assert bare.post("/login", content=fields, headers=form).status_code == 400
    # Huge run ids in the path of an action: 404.
    for path in (f"/runs/{2**70}/retry", f"/runs/{2**63}/cancel"):
        assert c.post(path, data={"csrf": csrf}).status_code == 404


def big_run_page(engine: sa.Engine, steps_sql: str) -> tuple[Any, float]:
    """The page of a dead run given many more steps by `steps_sql` (`:r`: the run), and the
    seconds it took to serve."""
    run_id = dead_run(engine, note="n")
    with engine.begin() as conn:
        conn.execute(sa.text(steps_sql), {"r": run_id})
    started = time.monotonic()
    r = client(engine).get(f"/runs/{run_id}")
    return r, time.monotonic() - started


def test_a_run_with_10000_map_instances_is_capped(engine: sa.Engine) -> None:
    r, took = big_run_page(engine, (
        "INSERT INTO flowq.jobs (run_id, task, step, step_index, queue, status, attempts,"
        " max_attempts, args, result, map_index) "
        "SELECT run_id, task, 'each', 1, queue, 'succeeded', 1, 1,"
        " jsonb_build_object('item', g, 'pad', repeat('x', 100)), to_jsonb(g), g "
        "FROM flowq.steps, generate_series(0, 9999) g WHERE run_id = :r"))
    rows = r.text.count("<tr")
    print(f"\nrun of 10,001 steps: {r.status_code}, page {len(r.content):,} bytes, "
          f"{rows} table rows, {took:.2f} s")
    assert r.status_code == 200 and "Steps (10001)" in r.text
    # The steps table's 500 rows, the attempts table's 200 and a few others.
    assert "9501 more rows" in r.text and rows < 720
    assert len(r.content) < 1_000_000


# Fixed after review (medium): "Values longer than 20,000 characters are cut", but a run page shows up to
# 500 steps with three such values each (arguments, result, last error), and escaping can
# multiply a value by 5 ('"' becomes '&#34;'): 200 steps with 25 kB values make a page of
# 56 MB (600 steps: 140 MB, measured), so one run can make the dashboard build, and the
# browser load, a page of over 100 MB. Fix: a budget per page (e.g. cut each cell to ~2,000
# characters in the steps table, fewer rows, or a per-step page), and only select the rows
# shown (get_run loads every step's args/result/error of a 10,000-step run into memory).
def test_a_run_page_with_fat_steps_stays_bounded(engine: sa.Engine) -> None:
    r, took = big_run_page(engine, (
        "INSERT INTO flowq.jobs (run_id, task, step, step_index, queue, status, attempts,"
        " max_attempts, args, result, last_error, map_index) "
        "SELECT run_id, task, 'each', 1, queue, 'dead', 1, 1,"
        " jsonb_build_object('s', repeat('<', 25000)), to_jsonb(repeat('\"', 25000)),"
        " repeat('&', 25000), g "
        "FROM flowq.steps, generate_series(0, 199) g WHERE run_id = :r"))
    print(f"\nrun of 200 steps with 25 kB values: {r.status_code}, "
          f"page {len(r.content):,} bytes, {took:.2f} s")
    assert r.status_code == 200
    assert len(r.content) < 10_000_000, f"a page of {len(r.content):,} bytes"


# == Concurrency ==================================================================================


def test_two_bulk_retries_at_once_retry_each_run_once(engine: sa.Engine) -> None:
    runs = [dead_run(engine, note=f"c{i}") for i in range(6)]
    others = [dead_run(engine, note=f"o{i}") for i in range(3)]
    app = create_app(engine, allow_actions=True, token=TOKEN)

    async def go() -> list[str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE,
                                     headers={"Authorization": f"Bearer {TOKEN}"}) as ac:
            page = await ac.get("/dead")
            csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
            picked = {"csrf": csrf, "run_id": [str(i) for i in runs], "confirm": "yes"}
            every = {"csrf": csrf, "all": "1", "confirm": "yes"}
            answers = await asyncio.gather(ac.post("/dead/retry", data=picked),
                                           ac.post("/dead/retry", data=picked),
                                           ac.post("/dead/retry", data=every),
                                           ac.post("/dead/retry", data=every))
            assert all(a.status_code == 303 for a in answers)
            return [a.headers["set-cookie"] for a in answers]

    notes = asyncio.run(go())
    retried = sum(int(re.search(r"(\d+) dead run\(s\) retried", n).group(1))  # type: ignore[union-attr]
                  for n in notes)
    assert retried == len(runs) + len(others), notes
    assert {get_run(engine, i).status for i in runs + others} == {"pending"}


# == The database ================================================================================


def test_a_database_gone_away_is_a_503_on_every_page_and_action(engine: sa.Engine) -> None:
    gone = sa.create_engine("postgresql+psycopg://flowq:pw@127.0.0.1:1/nothing")
    c = client(gone, allow_actions=True, token=TOKEN)
    c.headers["Authorization"] = f"Bearer {TOKEN}"
    c.cookies.set("flowq_csrf", "known-value")
    for path in ("/", "/workers", "/runs", "/runs/1", "/dead", "/runs?find=abc",
                 "/runs?find=12"):
        r = c.get(path)
        assert r.status_code == 503 and "pw@" not in r.text, path
    for path in ("/runs/1/retry", "/runs/1/cancel", "/queues/dash/pause", "/dead/retry"):
        r = c.post(path, data={"csrf": "known-value", "all": "1"})
        assert r.status_code == 503, path
    gone.dispose()


# Fixed after review (low): a pool with no free connection (a busy dashboard on a small pool, which the
# docs invite by taking "your Engine") raises sqlalchemy.exc.TimeoutError, which `guarded`
# does not catch: a bare 500 instead of the 503 page. Catch sa.exc.TimeoutError (and
# DBAPIError subclasses such as an undefined schema) alongside OperationalError.
def test_an_exhausted_pool_is_a_503(db_url: str) -> None:
    small = sa.create_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    held = small.connect()
    try:
        r = client(small).get("/")
        assert r.status_code == 503, (r.status_code, r.text[:100])
    finally:
        held.close()
        small.dispose()


# Fixed after review (low): `create_app` on a database without the flowq schema (or with a wrong
# `schema=`) answers every page with a bare 500; `flowq dashboard` says "flowq migrate", an
# embedder gets nothing. Map UndefinedTable/InvalidSchemaName to a page that says so.
def test_a_missing_schema_is_a_page_that_says_so(engine: sa.Engine, empty_db_url: str) -> None:
    empty = sa.create_engine(empty_db_url)
    try:
        for app_engine, schema in ((empty, "flowq"), (engine, "nope")):
            r = client(app_engine, schema=schema).get("/")
            assert r.status_code in (500, 503) and "text/html" in r.headers["content-type"], \
                (r.status_code, r.text[:100])
            assert "migrate" in r.text or "schema" in r.text
    finally:
        empty.dispose()
