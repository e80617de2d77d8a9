"""Structured worker logs: one JSON object per line, or key=value text."""

from __future__ import annotations

import json
import logging

import pytest
import sqlalchemy as sa
from tenacity import wait_fixed

import flowq
from flowq.durable.context import Context
from flowq.testing import run_until_idle
from flowq.worker.logs import configure_logging, log_event


def test_json_logs_are_one_object_per_line_with_job_fields(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    @app.task(retry=flowq.Retry(wait=wait_fixed(0)))
    def work(ctx: Context) -> None:
        if ctx.attempt == 1:
            raise ValueError("first try\nfails")

    with engine.begin() as conn:
        job_id = flowq.enqueue(conn, work).id
    configure_logging("json")
    run_until_idle(app, db_url)
    lines = capsys.readouterr().err.strip().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    events = {r["event"]: r for r in records}
    assert "worker started" in events and "worker stopped" in events
    started = events["worker started"]
    assert started["database"].endswith(db_url.rsplit("/", 1)[1])
    assert (started["queues"], started["concurrency"]) == ("default", 10)
    failed, done = events["job failed; retrying"], events["job succeeded"]
    for rec, attempt in ((failed, 1), (done, 2)):
        assert rec["task"] == "work" and rec["attempt"] == attempt
        assert rec["job_id"] == job_id  # run id == job id for a single-step first row
        assert isinstance(rec["duration_ms"], (int, float)) and rec["duration_ms"] >= 0
        assert rec["ts"].endswith("Z")
    assert failed["level"] == "warning" and failed["retry_in_s"] == 0
    assert failed["error"] == "ValueError: first try"


def test_text_logs_are_key_value(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("text")
    log_event(logging.WARNING, "job failed; retrying", job_id=1, error="two words", empty="")
    line = capsys.readouterr().err.strip()
    assert "\n" not in line
    assert 'WARNING job failed; retrying job_id=1 error="two words" empty=""' in line


def test_level_filters_events(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("json", "WARNING")
    log_event(logging.INFO, "job succeeded", job_id=1)
    log_event(logging.ERROR, "job dead", job_id=2)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert json.loads(line)["job_id"] == 2


def test_any_logging_setup_shows_the_fields(app: flowq.FlowQ, engine: sa.Engine, db_url: str,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """An application's own handler (here pytest's caplog, `%(message)s` only) sees the job id,
    task and error in the message, not only in `extra=` attributes it does not print."""
    @app.task(retry=flowq.Retry(wait=wait_fixed(0)))
    def flaky(ctx: Context) -> None:
        if ctx.attempt == 1:
            raise ValueError("boom")

    with engine.begin() as conn:
        job_id = flowq.enqueue(conn, flaky).job_id
    with caplog.at_level(logging.INFO, logger="flowq"):
        run_until_idle(app, db_url)
    [failed] = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("job failed; retrying")]
    for part in (f"job_id={job_id}", "task=flaky", "attempt=1", 'error="ValueError: boom"'):
        assert part in failed, failed


def test_text_lines_carry_each_field_once(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("text")
    log_event(logging.WARNING, "job dead", job_id=7)
    line = capsys.readouterr().err.strip()
    assert line.count("job_id=7") == 1


def test_configure_logging_is_public() -> None:
    assert flowq.configure_logging is configure_logging


def test_a_field_named_like_a_record_attribute_is_logged(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """`created`, `name`, `args`... are attributes of every LogRecord, which `extra=` may not
    set: such a field once raised KeyError inside the scheduler's catch-up pass, and the pass
    failed whenever INFO was on."""
    configure_logging("json", level="INFO")
    log_event(logging.INFO, "caught up", created=3, name="tick", args="x")
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert (line["created"], line["name"], line["args"]) == (3, "tick", "x")
