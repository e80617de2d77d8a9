"""`flowq.tracing.publish` without a configured SDK: no span is made current, and yet an
incoming trace context (a request's, propagated by a framework) is still stored."""

from __future__ import annotations

import json

import pytest

from flowq import tracing

trace = pytest.importorskip("opentelemetry.trace")

PARAMS = {"task": "t", "queue": "q", "args": {}}


def test_nothing_current_stores_no_context() -> None:
    with tracing.publish(PARAMS) as publication:
        assert publication is not None
        if tracing.unconfigured():
            assert publication.params["trace_context"] is None
        publication.done(object())  # a no-op span ignores it


def test_an_incoming_context_is_stored_without_an_sdk() -> None:
    incoming = trace.SpanContext(trace_id=0x1234, span_id=0x5678, is_remote=True,
                                 trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    with trace.use_span(trace.NonRecordingSpan(incoming)), tracing.publish(PARAMS) as publication:
        assert publication is not None
        stored = json.loads(publication.params["trace_context"])
    assert stored["traceparent"].split("-")[1] == f"{0x1234:032x}"


def test_a_provider_configured_after_the_first_enqueue_is_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """flowq's tracer is fetched (a proxy) by the first enqueue, before the application set
    its provider: the fast path must not outlive the configuration."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.util._once import Once

    monkeypatch.setattr(trace, "_TRACER_PROVIDER_SET_ONCE", Once())  # a fresh process's
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    monkeypatch.setattr(tracing, "tracer", None)
    with tracing.publish(PARAMS) as publication:
        assert publication is not None and publication.params["trace_context"] is None
    assert isinstance(tracing.tracer, trace.ProxyTracer)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    with tracing.publish(PARAMS) as publication:
        assert publication is not None
        stored = json.loads(publication.params["trace_context"])
        publication.done(object())
    [span] = exporter.get_finished_spans()
    assert span.name == "publish t" and span.kind is trace.SpanKind.PRODUCER
    assert stored["traceparent"].split("-")[1] == f"{span.context.trace_id:032x}"


def test_an_incoming_context_attached_by_a_framework_is_stored_until_detached() -> None:
    """A framework extracts the request's headers and attaches the context (no span object
    of its own): the enqueue stores it; after the request, nothing is stored."""
    from opentelemetry import context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    header = "00-0000000000000000000000000000abcd-00000000000000ef-01"
    token = context.attach(TraceContextTextMapPropagator().extract({"traceparent": header}))
    try:
        with tracing.publish(PARAMS) as publication:
            assert publication is not None
            stored = json.loads(publication.params["trace_context"])
    finally:
        context.detach(token)
    assert stored["traceparent"].split("-")[1] == "0000000000000000000000000000abcd"
    test_nothing_current_stores_no_context()
