"""The dashboard in a real headless Chromium (Debian's chromium and chromium-driver, driven by
selenium; `.ci/run` installs them when missing): a `flowq dashboard --allow-actions` process
serves the pages, the browser logs in, opens each page, checks that hostile text in
arguments and errors stays text (no script ran, no element was injected), finds a dead run,
retries it (one from its page, one ticked on the dead letters page) and sees it succeed.

With FLOWQ_SCREENSHOTS=DIR set, it saves the pages as PNG files there (docs/img has them).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dashboard_app as da
import httpx
import pytest
import sqlalchemy as sa

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        drain(engine, da.app, raise_on_dead=False)
        with engine.begin() as conn:
            flowq.enqueue(conn, da.fragile, note="waiting for a worker")
        assert get_run(engine, first).status == "dead"

        # Log in through the URL `flowq dashboard` prints: the token leaves the address bar.
        browser.get(f"{dashboard}/?token={TOKEN}")
        assert "token" not in browser.current_url
        assert browser.find_element(By.TAG_NAME, "h1").text == "Queues"
        queues = browser.find_element(By.ID, "queues").text
        assert "dash" in queues and "dash-limited" in queues
        assert "dash_fragile" in browser.find_element(By.ID, "dead-by-task").text
        shot(browser, "queues")
        for link, heading in (("Workers", "Workers"), ("Runs", "Runs"),
                              ("Dead letters", "Dead letters")):
            browser.find_element(By.LINK_TEXT, link).click()
            assert browser.find_element(By.TAG_NAME, "h1").text == heading
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
        assert "1 dead run(s) retried" in flash(browser)

        drain(engine, da.app)  # a worker runs them again: now they succeed

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
        assert len(browser.find_elements(By.CSS_SELECTOR, "#runs td.num a")) == 3
        shot(browser, "runs")
    finally:
        da.BROKEN["on"] = True
