"""OpenTelemetry (flowq.tracing, extra flowq[otel]): one trace from a request's span through
every attempt of every step, with the SDK's in-memory exporter and a real worker."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from tenacity import stop_after_attempt, wait_fixed

import flowq
import flowq.tracing
from flowq.testing import running_worker, wait_until

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode, Tracer

TWO_TRIES = flowq.Retry(stop=stop_after_attempt(2), wait=wait_fixed(0))


class Traces:
    """An SDK tracer provider of the test's own (the global one stays untouched), flowq's
    tracer taken from it, and what it exported."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer: Tracer = self.provider.get_tracer("test")

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, prefix: str) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name.startswith(prefix)]


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> Iterator[Traces]:
    t = Traces()
    monkeypatch.setattr(flowq.tracing, "ENABLED", True)
    monkeypatch.setattr(flowq.tracing, "tracer", t.provider.get_tracer("flowq"))
    yield t
    t.provider.shutdown()


def trace_contexts(engine: sa.Engine) -> dict[str, Any]:
    with engine.connect() as c:
        return {f"{r.step}#{r.id}": r.trace_context for r in c.execute(sa.text(
            "SELECT id, step, trace_context FROM flowq.steps ORDER BY id"))}


def finished(engine: sa.Engine, n: int) -> bool:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT count(*) FROM flowq.steps WHERE status = 'succeeded'")
                         ).scalar() == n


def attr(span: ReadableSpan, key: str) -> Any:
    assert span.attributes is not None
    return span.attributes.get(key)


def test_one_trace_from_the_request_through_every_attempt_of_a_three_step_run(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str, traces: Traces) -> None:
    orders = app.pipeline("orders")

    @orders.step()
    def reserve(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"n": n}

    @orders.step(retry=TWO_TRIES)
    def charge(ctx: flowq.Context, n: int) -> dict[str, int]:
        if ctx.attempt == 1:
            raise RuntimeError("card declined once")
        return {"n": n}

    @orders.step()
    def ship(ctx: flowq.Context, n: int) -> None:
        with traces.tracer.start_as_current_span("carrier call"):  # the handler's own span
            pass

    request_span = traces.tracer.start_as_current_span("POST /orders", kind=SpanKind.SERVER)
    with request_span as request, engine.begin() as conn:
        run = flowq.enqueue(conn, orders, n=7)
    trace_id = request.get_span_context().trace_id

    with running_worker(app, db_url):
        wait_until(lambda: finished(engine, 3) and len(traces.named("process ")) == 4)

    spans = traces.spans()
    assert {s.context.trace_id for s in spans} == {trace_id}, "one trace"
    [publish] = traces.named("publish ")
    assert publish.name == "publish orders"
    assert publish.kind is SpanKind.PRODUCER
    assert publish.parent is not None and publish.parent.span_id == request.get_span_context(
        ).span_id
    assert attr(publish, "messaging.system") == "flowq"
    assert attr(publish, "messaging.destination.name") == "default"
    assert attr(publish, "flowq.task") == "orders"
    assert attr(publish, "flowq.run_id") == run.id
    assert attr(publish, "messaging.message.id") == str(run.job_id)

    consumers = sorted(traces.named("process "), key=lambda s: s.start_time or 0)
    assert [(s.name, attr(s, "flowq.attempt"), attr(s, "flowq.outcome")) for s in consumers] == [
        ("process orders.reserve", 1, "succeeded"),
        ("process orders.charge", 1, "failed"),
        ("process orders.charge", 2, "succeeded"),
        ("process orders.ship", 1, "succeeded"),
    ]
    for s in consumers:
        assert s.kind is SpanKind.CONSUMER
        assert s.parent is not None and s.parent.span_id == publish.context.span_id
        assert attr(s, "flowq.run_id") == run.id
        assert attr(s, "messaging.destination.name") == "default"
        assert attr(s, "messaging.message.id") == str(attr(s, "flowq.job_id"))
    failed = consumers[1]
    assert failed.status.status_code is StatusCode.ERROR
    assert "card declined once" in (failed.status.description or "")
    [event] = [e for e in failed.events if e.name == "exception"]
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "RuntimeError"
    assert attr(failed, "error.type") == "RuntimeError"
    assert all(s.status.status_code is StatusCode.UNSET for s in consumers if s is not failed)

    [carrier] = traces.named("carrier call")
    assert carrier.parent is not None and carrier.parent.span_id == consumers[3].context.span_id

    # Stored with every row: the producer's context, copied from step to step.
    stored = trace_contexts(engine)
    assert len(stored) == 3
    expected = f"00-{trace_id:032x}-{publish.context.span_id:016x}-"
    for c in stored.values():
        assert list(c) == ["traceparent"] and c["traceparent"].startswith(expected), stored


def test_a_workflow_keeps_its_trace_across_joins_maps_and_async_steps(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str, traces: Traces) -> None:
    flow = app.pipeline("flow")

    @flow.step()
    def start(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"n": n}

    @flow.step(parents=[start])
    def left(ctx: flowq.Context, n: int) -> flowq.Each:
        return flowq.each([{"i": i} for i in range(n)])

    @flow.step(parents=[left])
    async def square(ctx: flowq.Context, i: int) -> int:
        with traces.tracer.start_as_current_span("async work"):
            await asyncio.sleep(0)
        return i * i

    @flow.step(parents=[start])
    def right(ctx: flowq.Context, n: int) -> dict[str, int]:
        return {"v": n}

    @flow.step(parents=[square, right])
    def join(ctx: flowq.Context, square: list[int], right: dict[str, int]) -> None:
        pass

    with traces.tracer.start_as_current_span("request") as request, engine.begin() as conn:
        flowq.enqueue(conn, flow, n=3)
    # start, left, right, 3 squares, join
    with running_worker(app, db_url, concurrency=4):
        wait_until(lambda: finished(engine, 7) and len(traces.named("process ")) == 7)

    trace_id = request.get_span_context().trace_id
    assert {s.context.trace_id for s in traces.spans()} == {trace_id}
    [publish] = traces.named("publish ")
    steps = sorted(str(attr(s, "flowq.step")) for s in traces.named("process "))
    assert steps == ["join", "left", "right", "square", "square", "square", "start"]
    for s in traces.named("process "):
        assert s.parent is not None and s.parent.span_id == publish.context.span_id
    assert sorted(attr(s, "flowq.map_index") for s in traces.named("process flow.square")) == [
        0, 1, 2]
    squares = {s.context.span_id for s in traces.named("process flow.square")}
    work = traces.named("async work")
    assert len(work) == 3
    assert {w.parent.span_id for w in work if w.parent is not None} == squares
    assert len({json.dumps(c) for c in trace_contexts(engine).values()}) == 1


def test_async_enqueue_is_traced_too(db_url: str, engine: sa.Engine, app: flowq.FlowQ,
                                     traces: Traces) -> None:
    pytest.importorskip("sqlalchemy.ext.asyncio")
    from sqlalchemy.ext.asyncio import create_async_engine

    import flowq.enqueueing.aio

    @app.task()
    def noop(ctx: flowq.Context) -> None:
        pass

    async def main() -> flowq.Enqueued:
        aengine = create_async_engine(db_url)
        try:
            with traces.tracer.start_as_current_span("async request"):
                async with aengine.begin() as conn:
                    return await flowq.enqueueing.aio.enqueue(conn, noop)
        finally:
            await aengine.dispose()

    run = asyncio.run(main())
    [publish] = traces.named("publish noop")
    [request] = traces.named("async request")
    assert publish.parent is not None and publish.parent.span_id == request.context.span_id
    assert attr(publish, "flowq.run_id") == run.id
    [stored] = trace_contexts(engine).values()
    assert stored["traceparent"].split("-")[2] == f"{publish.context.span_id:016x}"


def test_enqueue_many_is_one_span_for_the_batch(app: flowq.FlowQ, engine: sa.Engine,
                                               traces: Traces) -> None:
    @app.task()
    def noop(ctx: flowq.Context, i: int) -> None:
        pass

    with engine.begin() as conn:
        flowq.enqueue_many(conn, noop, [{"i": i} for i in range(3)])
    [publish] = traces.named("publish noop")
    assert attr(publish, "messaging.batch.message_count") == 3
    assert publish.parent is None  # no current span: the enqueue starts the trace
    stored = list(trace_contexts(engine).values())
    assert len(stored) == 3 and len({json.dumps(c) for c in stored}) == 1


def test_without_a_configured_tracer_nothing_breaks_and_nothing_is_stored(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The API without an SDK (the global provider is OpenTelemetry's no-op): spans are
    no-ops, no context is stored, the run completes."""
    monkeypatch.setattr(flowq.tracing, "ENABLED", True)
    monkeypatch.setattr(flowq.tracing, "tracer", None)
    pipe = app.pipeline("plain")

    @pipe.step(retry=TWO_TRIES)
    def one(ctx: flowq.Context) -> None:
        if ctx.attempt == 1:
            raise RuntimeError("once")

    @pipe.step()
    def two(ctx: flowq.Context) -> None:
        pass

    with engine.begin() as conn:
        flowq.enqueue(conn, pipe)
    with running_worker(app, db_url):
        wait_until(lambda: finished(engine, 2))
    assert list(trace_contexts(engine).values()) == [None, None]


def test_tracing_turned_off_records_nothing(app: flowq.FlowQ, engine: sa.Engine, db_url: str,
                                            traces: Traces,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flowq.tracing, "ENABLED", False)

    @app.task()
    def noop(ctx: flowq.Context) -> None:
        pass

    with traces.tracer.start_as_current_span("request"), engine.begin() as conn:
        flowq.enqueue(conn, noop)
    with running_worker(app, db_url):
        wait_until(lambda: finished(engine, 1))
    assert [s.name for s in traces.spans()] == ["request"]
    assert list(trace_contexts(engine).values()) == [None]


def test_a_stored_context_that_is_not_a_trace_context_starts_a_new_trace(
        app: flowq.FlowQ, engine: sa.Engine, db_url: str, traces: Traces) -> None:
    @app.task()
    def noop(ctx: flowq.Context) -> None:
        pass

    with engine.begin() as conn:
        flowq.enqueue(conn, noop)
        conn.execute(sa.text("""UPDATE flowq.jobs SET trace_context = '["nonsense"]'"""))
    with running_worker(app, db_url):
        wait_until(lambda: finished(engine, 1) and len(traces.named("process ")) == 1)
    [span] = traces.named("process ")
    assert span.parent is None


def _python(code: str, db_url: str) -> None:
    env = {**os.environ, "FLOWQ_TEST_URL": db_url}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr


def test_importing_flowq_does_not_import_opentelemetry(db_url: str) -> None:
    _python("import sys, flowq, flowq.worker\n"
            "assert flowq.tracing.ENABLED\n"
            "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'eager'\n",
            db_url)


def test_without_the_extra_flowq_runs_and_never_imports_opentelemetry(db_url: str) -> None:
    """The extra missing (simulated: `sys.modules['opentelemetry'] = None` makes it
    unimportable): tracing is off, an enqueue and a worker run as always."""
    _python("""
import os, sys
sys.modules["opentelemetry"] = None
import sqlalchemy as sa
import flowq
from flowq.testing import run_until_idle

assert flowq.tracing.ENABLED is False
app = flowq.FlowQ()

@app.task()
def noop(ctx):
    pass

engine = sa.create_engine(os.environ["FLOWQ_TEST_URL"])
with engine.begin() as conn:
    flowq.enqueue(conn, noop)
run_until_idle(app, os.environ["FLOWQ_TEST_URL"])
with engine.connect() as conn:
    assert list(conn.execute(sa.text("SELECT status, trace_context FROM flowq.steps"))) == [
        ("succeeded", None)]
loaded = [m for m, v in sys.modules.items() if m.startswith("opentelemetry") and v is not None]
assert not loaded, loaded
""", db_url)


def test_flowq_tracing_0_turns_tracing_off(db_url: str) -> None:
    code = ("import flowq.tracing as t\n"
            "assert not t.ENABLED\n")
    env = {**os.environ, "FLOWQ_TRACING": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
