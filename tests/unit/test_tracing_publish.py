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
        if tracing._unconfigured(tracing._load()):  # type: ignore[arg-type]
            assert publication.params["trace_context"] is None
        publication.done(object())  # a no-op span ignores it


def test_an_incoming_context_is_stored_without_an_sdk() -> None:
    incoming = trace.SpanContext(trace_id=0x1234, span_id=0x5678, is_remote=True,
                                 trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    with trace.use_span(trace.NonRecordingSpan(incoming)), tracing.publish(PARAMS) as publication:
        assert publication is not None
        stored = json.loads(publication.params["trace_context"])
    assert stored["traceparent"].split("-")[1] == f"{0x1234:032x}"
