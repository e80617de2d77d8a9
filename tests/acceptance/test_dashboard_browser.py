"""The dashboard in a real headless Chromium (Debian's chromium and chromium-driver, driven by
selenium; `.ci/run` installs them when missing): a `flowq dashboard --allow-actions` process
serves the pages of a database holding a few hundred runs (succeeded, dead, retried, delayed,
waiting for a signal, a graph with a join, a map); the browser logs in, opens each page,
checks the queue charts, the run graph, the timeline, the attempt history and the
auto-refresh toggle are drawn, that hostile text in arguments and errors stays text (no
script ran, no element was injected), finds a dead run, retries it (one from its page, one
ticked on the dead letters page, confirmed on the page that asks first) and sees it succeed;
opens a queue's page and pauses and resumes it (the warning shows while paused), runs a
schedule now, reads a batch's progress, and signals the run waiting for one.

With FLOWQ_SCREENSHOTS=DIR set, it saves the pages as PNG files there (docs/img has them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import dashboard_app as da
import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker
from support import free_port

import flowq
from flowq.ops.runs import get_run
from flowq.testing import drain, wait_until

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
TOKEN = "browser-test-token-0123"

pytestmark = pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
    reason="needs Debian's chromium and chromium-driver (`apt-get install chromium "
           "chromium-driver`; .ci/run installs them)")


@pytest.fixture
def dashboard(db_url: str, tmp_path: Path) -> Iterator[str]:
    """A real `flowq dashboard --allow-actions` process; yields its base URL."""
    port = free_port()
    log = (tmp_path / "dashboard.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowq", "dashboard", "--database-url", db_url, "--port",
         str(port), "--allow-actions", "--app", "dashboard_app:app"],
        env={**os.environ, "FLOWQ_DASHBOARD_TOKEN": TOKEN,
             "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "apps"),
                                            os.environ.get("PYTHONPATH", "")])},
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{base}/").status_code == 401
        except httpx.TransportError:
            assert proc.poll() is None, (tmp_path / "dashboard.log").read_text()
            return False

    try:
        wait_until(up, timeout=30, message="the dashboard to listen")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 "--window-size=1400,900", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver: Any, name: str) -> None:
    where = os.environ.get("FLOWQ_SCREENSHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(where) / f"dashboard-{name}.png"))


def flash(driver: Any) -> str:
    """The message of the page a form's action redirected to (waiting for it to load)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    found = WebDriverWait(driver, 20).until(ec.presence_of_element_located((By.ID, "flash")))
    return str(found.text)


def dead_run(engine: sa.Engine, note: str) -> int:
    with engine.begin() as conn:
        run_id = flowq.enqueue(conn, da.fragile, note=note).id
    return run_id


def test_the_dashboard_in_a_real_browser(engine: sa.Engine, dashboard: str,
                                         browser: Any) -> None:
    from selenium.webdriver.common.by import By

    da.BROKEN["on"] = True
    try:
        first = dead_run(engine, da.HOSTILE)
        second = dead_run(engine, "second")
        with engine.begin() as conn:
            for n in range(3):
                flowq.enqueue(conn, da.two, n=n)
        with engine.begin() as conn:
            for n in range(200):
                flowq.enqueue(conn, da.two, n=n)
            flaky = [flowq.enqueue(conn, da.flaky, n=n).id for n in range(30)]
            graph = flowq.enqueue(conn, da.graph, order=12).id
            fan = flowq.enqueue(conn, da.fan, n=12).id
        with sessionmaker(engine, class_=flowq.Session).begin() as s, \
                s.batch(on_complete=da.batch_done) as batch:
            for n in range(4):
                s.enqueue(da.two, n=n)
        drain(engine, da.app, raise_on_dead=False, batches=False)
        with engine.begin() as conn:
            # Spread the finished runs over the last hour, as a live queue's would be, so
            # the charts have a shape (each run moved back whole, its times in order).
            conn.execute(sa.text("""
                UPDATE flowq.jobs
                   SET created_at = created_at - make_interval(mins => ((run_id * 7) % 55)::int),
                       run_at = run_at - make_interval(mins => ((run_id * 7) % 55)::int),
                       started_at = started_at - make_interval(mins => ((run_id * 7) % 55)::int)
                                    + make_interval(secs => (run_id % 5) * 0.2),
                       finished_at = finished_at - make_interval(mins => ((run_id * 7) % 55)::int)
                                     + make_interval(secs => (run_id % 5) * 0.3)
                 WHERE status IN ('succeeded', 'dead') AND run_id <> ALL(:keep)"""),
                {"keep": [graph, fan]})
            flowq.enqueue(conn, da.fragile, note="waiting for a worker")
            for n in range(40):
                flowq.enqueue(conn, da.two, n=n)  # due: the depth chart has something
            for n in range(20):
                flowq.enqueue(conn, da.two, n=n, delay=timedelta(hours=1 + n))
        assert get_run(engine, first).status == "dead"
        assert get_run(engine, graph).status == "waiting"

        # Log in through the URL `flowq dashboard` prints: the token leaves the address bar.
        browser.get(f"{dashboard}/?token={TOKEN}")
        assert "token" not in browser.current_url
        assert browser.find_element(By.TAG_NAME, "h1").text == "Queues"
        queues = browser.find_element(By.ID, "queues").text
        assert "dash" in queues and "dash-limited" in queues
        assert "dash_fragile" in browser.find_element(By.ID, "dead-by-task").text
        # The charts: four per queue, drawn on the server.
        charts = browser.find_elements(By.CSS_SELECTOR, "#charts svg.chart")
        assert len(charts) >= 8 and len(charts) % 4 == 0
        assert browser.find_elements(By.CSS_SELECTOR, "#charts svg.chart polyline")
        shot(browser, "queues")
        browser.find_element(By.ID, "window-day").click()
        assert "last day" in browser.find_element(By.ID, "activity").text

        # Auto-refresh: off by default, turned on (a meta refresh, no script), then off.
        assert browser.find_elements(By.CSS_SELECTOR, "meta[http-equiv=refresh]") == []
        browser.find_element(By.CSS_SELECTOR, "#refresh a[href*='every=60']").click()
        [meta] = browser.find_elements(By.CSS_SELECTOR, "meta[http-equiv=refresh]")
        assert meta.get_attribute("content") == "60"
        assert "last day" in browser.find_element(By.ID, "activity").text  # same page
        browser.get(f"{dashboard}/runs")
        assert browser.find_elements(By.CSS_SELECTOR, "meta[http-equiv=refresh]")  # remembered
        browser.find_element(By.CSS_SELECTOR, "#refresh a[href*='every=0']").click()
        assert browser.find_elements(By.CSS_SELECTOR, "meta[http-equiv=refresh]") == []

        # The graph: every step drawn, those after the wait greyed; the timeline.
        browser.get(f"{dashboard}/runs/{graph}")
        nodes = {n.get_attribute("data-step"): n.get_attribute("class")
                 for n in browser.find_elements(By.CSS_SELECTOR, "#dag g.node")}
        assert nodes == {"fetch": "node succeeded", "price": "node succeeded",
                         "stock": "node succeeded", "combine": "node succeeded",
                         "approve": "node waiting", "ship": "node unreached"}
        assert len(browser.find_elements(By.CSS_SELECTOR, "#dag line.edge")) == 6
        assert len(browser.find_elements(By.CSS_SELECTOR, "#timeline g.bar")) == 5
        assert "waits for signal approval" in browser.find_element(By.ID, "steps").text
        browser.set_window_size(1400, 1100)
        shot(browser, "run-graph")
        browser.get(f"{dashboard}/runs/{fan}")
        assert "x12: 12 succeeded" in browser.find_element(By.ID, "dag").text

        # The attempt history of a step that failed twice, then succeeded.
        browser.get(f"{dashboard}/runs/{flaky[0]}#timeline-heading")
        attempts = browser.find_element(By.ID, "attempts").text
        assert "flaky attempt 1 of 0" in attempts and "flaky attempt 2 of 0" in attempts
        assert "flowq.testing" in attempts
        # Every attempt is on the timeline, the two failed ones apart.
        assert len(browser.find_elements(By.CSS_SELECTOR, "#timeline rect.attempt")) == 3
        shot(browser, "run-attempts")
        browser.set_window_size(1400, 900)
        for link, heading in (("Workers", "Workers"), ("Runs", "Runs"),
                              ("Dead letters", "Dead letters")):
            browser.find_element(By.LINK_TEXT, link).click()
            assert browser.find_element(By.TAG_NAME, "h1").text == heading
            if link == "Runs":  # delayed runs say when they are due; filters are lists
                assert "due " in browser.find_element(By.ID, "runs").text
                options = browser.find_elements(By.CSS_SELECTOR, "#filter-task option")
                assert {"dash_two", "dash_flaky"} <= {o.text for o in options}
                shot(browser, "runs-delayed")
        shot(browser, "dead")

        # Hostile text is shown as text: no script ran, no element was injected.
        dead_rows = browser.find_element(By.ID, "dead").text
        assert str(first) in dead_rows and "<script>document.title='pwned'</script>" in dead_rows
        assert browser.find_elements(By.CSS_SELECTOR, "main script, main img") == []
        assert "pwned" not in browser.title

        # Find the dead run, open it, retry it.
        browser.find_element(By.LINK_TEXT, str(first)).click()
        assert browser.find_element(By.ID, "run-status").text == "dead"
        args = browser.find_element(By.CSS_SELECTOR, "#steps td.args").text
        assert da.HOSTILE in args
        error = browser.find_element(By.CSS_SELECTOR, "#steps td.error").text
        assert error.startswith("RuntimeError: " + da.HOSTILE)
        assert browser.find_elements(By.CSS_SELECTOR, "main script, main img") == []
        assert "pwned" not in browser.title
        shot(browser, "run-dead")
        da.BROKEN["on"] = False
        browser.find_element(By.ID, "retry").click()
        assert "1 dead step(s) retried" in flash(browser)
        assert browser.find_element(By.ID, "run-status").text == "pending"

        # The other one: ticked on the dead letters page, retried in bulk.
        browser.find_element(By.LINK_TEXT, "Dead letters").click()
        browser.find_element(By.CSS_SELECTOR, f"input[name=run_id][value='{second}']").click()
        browser.find_element(By.ID, "retry-selected-button").click()
        assert "Retry the 1 selected" in browser.find_element(By.ID, "confirm-question").text
        assert get_run(engine, second).status == "dead"  # asked, not done
        shot(browser, "confirm")
        browser.find_element(By.ID, "confirm-button").click()
        assert "1 dead run(s) retried" in flash(browser)

        drain(engine, da.app, batches=False)  # a worker runs them again: now they succeed

        browser.get(f"{dashboard}/runs/{first}")
        wait_until(lambda: browser.find_element(By.ID, "run-status").text == "succeeded"
                   or browser.refresh(), timeout=10, message="the run to show succeeded")
        assert '"echo"' in browser.find_element(By.TAG_NAME, "dl").text
        shot(browser, "run-succeeded")
        assert get_run(engine, second).status == "succeeded"

        # Filters and find-by-id through the forms.
        browser.get(f"{dashboard}/runs")
        browser.find_element(By.NAME, "find").send_keys(str(second))
        browser.find_elements(By.CSS_SELECTOR, "form.filters button")[1].click()
        wait_until(lambda: re.search(rf"/runs/{second}$", browser.current_url), timeout=20,
                   message="the run's page")
        browser.get(f"{dashboard}/runs?status=succeeded&task=dash_two")
        # 203 succeeded runs of dash_two: a full page, and a link to the older ones.
        assert len(browser.find_elements(By.CSS_SELECTOR, "#runs td.num a")) == 50
        assert browser.find_elements(By.ID, "older")
        shot(browser, "runs")

        # A queue's own page: its charts, its limits; paused, it warns, until resumed.
        browser.get(f"{dashboard}/")
        browser.find_element(By.CSS_SELECTOR, "#queues a[href$='/queues/dash']").click()
        assert browser.find_element(By.TAG_NAME, "h1").text.startswith("Queue dash")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#charts svg.chart")) == 4
        browser.find_element(By.ID, "pause").click()
        assert "paused" in flash(browser)
        warning = browser.find_element(By.ID, "paused-warning")
        assert warning.value_of_css_property("background-color") != \
            browser.find_element(By.TAG_NAME, "main").value_of_css_property("background-color")
        shot(browser, "queue-paused")
        browser.find_element(By.ID, "resume").click()
        assert "resumed" in flash(browser)
        assert browser.find_elements(By.ID, "paused-warning") == []

        # Schedules: the next ticks, and a run enqueued now.
        browser.find_element(By.LINK_TEXT, "Schedules").click()
        table = browser.find_element(By.ID, "schedules").text
        assert "dash_nightly" in table and "03:00:00" in table
        browser.find_element(By.CSS_SELECTOR, "#schedules button.run-now").click()
        assert "enqueued as run" in flash(browser)
        shot(browser, "schedules")

        # Batches: the progress of the batch's runs, then its callback once reaped.
        browser.find_element(By.LINK_TEXT, "Batches").click()
        row = browser.find_element(By.ID, "batches").text
        # Counted by the reaper's pass, which no worker ran here: its runs ended uncounted.
        assert str(batch.id) in row and "0 / 4 (0%)" in row and "to come" in row
        assert browser.find_elements(By.CSS_SELECTOR, "#batches [role=progressbar]")
        shot(browser, "batches")

        # The run waiting for a signal gets it from its page, and finishes.
        browser.get(f"{dashboard}/runs/{graph}")
        assert browser.find_element(By.ID, "signal-name").get_attribute("value") == "approval"
        browser.find_element(By.ID, "signal-payload").send_keys('{"ok": true}')
        browser.find_element(By.ID, "signal-button").click()
        assert "sent to run" in flash(browser)
        drain(engine, da.app)
        assert get_run(engine, graph).status == "succeeded"
    finally:
        da.BROKEN["on"] = True
