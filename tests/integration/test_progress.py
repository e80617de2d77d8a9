"""ctx.progress: kept in memory, written by the heartbeat at most once per beat, shown by
`flowq runs show` (and `--json`), refused when hostile; against a real PostgreSQL and an
in-process worker.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Any

import pytest
import sqlalchemy as sa
from runs_cli import cli, cli_json

import flowq
from flowq.durable.context import PROGRESS_MESSAGE_CHARS, Context, progress_of
from flowq.ops.runs import get_run
from flowq.testing import running_worker, wait_until
from flowq.worker import heartbeat

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # starlette's client
app = flowq.FlowQ()
LOOP = 1_000_000
release = threading.Event()


@app.task()
def count_up(ctx: Context, n: int) -> dict[str, int]:
    for i in range(n):
        ctx.progress(i + 1, n, f"item {i + 1}")
    release.wait(60)  # the test reads the progress while the job still runs
    return {"n": n}


def dashboard(engine: sa.Engine) -> Any:
    with warnings.catch_warnings():  # it will move to httpx2; what it tests does not change
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
    from flowq.dashboard import create_app

    return TestClient(create_app(engine), base_url="http://127.0.0.1:8080")


class Beats:
    """Counts the heartbeat's beats and those that wrote progress (wraps `progress_of`)."""

    def __init__(self) -> None:
        self.beats = 0
        self.writes = 0

    def __call__(self, job_ids: Any) -> dict[int, str]:
        found = progress_of(job_ids)
        self.beats += 1
        self.writes += bool(found)
        return found


def test_a_tight_loop_writes_a_few_rows_and_runs_show_shows_it(
        engine: sa.Engine, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    beats = Beats()
    monkeypatch.setattr(heartbeat, "progress_of", beats)
    release.clear()
    with engine.begin() as conn:
        run_id = flowq.enqueue(conn, count_up, n=LOOP).id
    with running_worker(app, db_url, heartbeat_interval=0.1, stale_after=30):
        def shown() -> dict[str, Any] | None:
            step = get_run(engine, run_id).steps[0]
            return step.progress if step.progress and step.progress["done"] == LOOP else None

        progress = wait_until(shown, timeout=120, message="the loop's last report stored")
        assert progress["total"] == LOOP and progress["message"] == f"item {LOOP}"
        assert isinstance(progress["at"], str)  # the database's time of the beat
        code, out, err = cli(db_url, "show", str(run_id))
        assert code == 0, err
        job_id = get_run(engine, run_id).steps[0].job_id
        assert (f"count_up (job {job_id}, running): 1,000,000/1,000,000 (100%) "
                f"item {LOOP}, at ") in out
        data = cli_json(db_url, "show", str(run_id))
        assert data["steps"][0]["progress"]["done"] == LOOP
        page = dashboard(engine).get(f"/runs/{run_id}")
        assert page.status_code == 200
        assert (f'<dd class="progress">count_up (running): <span class="bar" '
                f'role="progressbar" aria-valuenow="{LOOP}"') in page.text
        assert (f'<span class="figures">{LOOP} / {LOOP} (100%)</span> &middot; '
                f"item {LOOP}") in page.text
        release.set()
        flowq.wait_run(engine, run_id, timeout=60)
    # A million reports, written by a few beats: at most one write per beat, none of their
    # own (the beat's statement carries them).
    assert 1 <= beats.writes <= beats.beats
    assert beats.writes < 1000
    info = get_run(engine, run_id)
    assert info.steps[0].progress is not None and info.steps[0].progress["done"] == LOOP


def test_a_step_without_progress_keeps_the_plain_beat(engine: sa.Engine, db_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    beats = Beats()
    monkeypatch.setattr(heartbeat, "progress_of", beats)
    release.clear()
    with engine.begin() as conn:
        run_id = flowq.enqueue(conn, count_up, n=0).id
    with running_worker(app, db_url, heartbeat_interval=0.1, stale_after=30):
        wait_until(lambda: beats.beats >= 3, timeout=60, message="three beats")
        release.set()
        flowq.wait_run(engine, run_id, timeout=60)
    assert beats.writes == 0
    assert get_run(engine, run_id).steps[0].progress is None
    code, out, _ = cli(db_url, "show", str(run_id))
    assert code == 0 and "progress:" not in out


def test_reports_are_taken_once_and_only_the_latest() -> None:
    ctx = Context(987654, 1, "t", "s", 1, "q")
    assert progress_of([987654]) == {}
    for i in range(10):
        ctx.progress(i)
    assert progress_of([987654]) == {987654: '{"done": 9, "total": null, "message": null}'}
    assert progress_of([987654]) == {}
    ctx.progress(2.5, 10.0, "half-ish")
    assert progress_of([987654, 1]) == {
        987654: '{"done": 2.5, "total": 10.0, "message": "half-ish"}'}


def test_a_finished_attempts_context_is_forgotten() -> None:
    import gc

    ctx = Context(555001, 1, "t", "s", 1, "q")
    ctx.progress(1)
    del ctx
    gc.collect()
    assert progress_of([555001]) == {}


@pytest.mark.parametrize("done", [math.nan, math.inf, -math.inf, -1, -0.5, True, False,
                                  "3", None, [1], 1j])
def test_hostile_done_is_refused(done: Any) -> None:
    ctx = Context(1, 1, "t", "s", 1, "q")
    with pytest.raises(flowq.InvalidArgumentsError, match="done must be a finite number"):
        ctx.progress(done)


@pytest.mark.parametrize("total", [math.nan, math.inf, -1, True, "10"])
def test_hostile_total_is_refused(total: Any) -> None:
    ctx = Context(1, 1, "t", "s", 1, "q")
    with pytest.raises(flowq.InvalidArgumentsError, match="total must be a finite number"):
        ctx.progress(1, total)


@pytest.mark.parametrize(("message", "error"), [
    ("a\x00b", "NUL"), ("\ud800", "lone surrogate"), (b"bytes", "text or None"),
    (42, "text or None")])
def test_hostile_messages_are_refused(message: Any, error: str) -> None:
    ctx = Context(1, 1, "t", "s", 1, "q")
    with pytest.raises(flowq.InvalidArgumentsError, match=error):
        ctx.progress(1, 2, message)


def test_a_long_message_is_cut() -> None:
    ctx = Context(424201, 1, "t", "s", 1, "q")
    ctx.progress(1, 2, "x" * 100_000)
    taken = progress_of([424201])[424201]
    assert f'"{"x" * PROGRESS_MESSAGE_CHARS}"' in taken
    assert "x" * (PROGRESS_MESSAGE_CHARS + 1) not in taken


def test_the_attempts_span_gets_the_latest_report(engine: sa.Engine, db_url: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import flowq.tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(flowq.tracing, "ENABLED", True)
    monkeypatch.setattr(flowq.tracing, "tracer", provider.get_tracer("flowq"))
    release.set()
    with engine.begin() as conn:
        run_id = flowq.enqueue(conn, count_up, n=1000).id
    with running_worker(app, db_url):
        flowq.wait_run(engine, run_id, timeout=60)
        wait_until(lambda: [s for s in exporter.get_finished_spans()
                            if s.name.startswith("process count_up")], message="the span")
    provider.shutdown()
    (span,) = [s for s in exporter.get_finished_spans() if s.name.startswith("process")]
    assert span.attributes is not None
    assert span.attributes["flowq.progress.done"] == 1000
    assert span.attributes["flowq.progress.total"] == 1000
    assert span.attributes["flowq.progress.message"] == "item 1000"
    assert span.attributes["flowq.progress.reports"] == 1000
