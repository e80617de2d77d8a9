"""OpenTelemetry tracing of enqueues and attempts (extra `flowq[otel]`): one trace per run.

- **Enqueue** records a PRODUCER span, `publish <task>`, around its statement, and stores
  the span's W3C trace context (`traceparent`, and `tracestate` when there is one) with the
  rows it inserts, in `flowq.jobs.trace_context` (jsonb). The span is the child of whatever
  span is current (a web request's, say); it ends with the run id (`flowq.run_id`) known.
- **The worker** starts a CONSUMER span per attempt, `process <task>.<step>`, as the child of
  the stored context, and makes it current while the handler runs: the handler's own spans
  (HTTP calls, SQLAlchemy) and the runs it enqueues nest under it. It ends with the outcome
  (`flowq.outcome`: succeeded, failed (to be retried), dead, retried, cancelled); a failure
  sets the span's status to ERROR and records the exception.
- **A pipeline's later steps continue the same trace**: a step created by a success copies
  the context of the row that created it, in the completing statement itself (SQL, no
  Python in between). So every step carries the context of the run's enqueue, and every
  attempt of every step is a child of the `publish` span: a retry is one more sibling, and a
  join carries the context of one of its parents (all the same one, within a run). A
  redriven dead run (`flowq runs retry`) reports into its original trace.

Names and attributes follow OpenTelemetry's messaging semantic conventions where they fit
(`messaging.system` = `flowq`, `messaging.operation.name`/`.type`,
`messaging.destination.name` = the queue, `messaging.message.id` = the job id), with
`flowq.task`, `flowq.step`, `flowq.run_id`, `flowq.job_id`, `flowq.attempt` besides, and,
for an attempt whose handler called `ctx.progress`, its latest report when the span ends
(`flowq.progress.done`, `.total`, `.message`, `.reports`: `follow_progress`). Only
the W3C trace context is stored, whatever propagators the application configured: baggage
(which may hold anything) never reaches the jobs table.

Without the extra installed, nothing is imported: `ENABLED` is found once, when this module is
imported (without importing opentelemetry), and enqueue and the worker test it before doing
anything else; `trace_context` is then NULL. With the API installed but no SDK configured,
the spans are OpenTelemetry's no-op spans and no context is stored (unless one came with the
current context), at a few microseconds per enqueue and attempt; an enqueue then makes no
span at all (`unconfigured()`). `FLOWQ_TRACING=0` in the
environment (or `flowq.tracing.ENABLED = False`) turns tracing off in a process.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from importlib.util import find_spec
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Final, TypeVar

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from flowq.db.rows import ClaimedJob
    from flowq.worker.model import Outcome

__all__ = ["ENABLED", "Publication", "awaited_in", "called_in", "end_attempt",
           "follow_progress", "publish", "start_attempt", "tracer", "unconfigured"]

T = TypeVar("T")

SYSTEM: Final = "flowq"
# Whether opentelemetry-api is installed (found once, without importing it) and tracing is
# not turned off with FLOWQ_TRACING=0.
ENABLED: bool = (find_spec("opentelemetry") is not None
                 and os.environ.get("FLOWQ_TRACING", "").strip() != "0")

_api: SimpleNamespace | None = None
# flowq's tracer: None until the first span fetches the global provider's (tests may set
# their own provider's, or None to have it fetched again).
tracer: Tracer | None = None


def _load() -> SimpleNamespace | None:
    """The OpenTelemetry API, imported on first use; None (and tracing off) if it cannot be."""
    global _api, ENABLED
    if _api is None:
        try:
            from opentelemetry import context, trace
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError:  # a namespace package without the API (opentelemetry-proto alone)
            ENABLED = False
            return None
        _api = SimpleNamespace(trace=trace, context=context,
                               propagator=TraceContextTextMapPropagator())
    return _api


def _get_tracer(api: SimpleNamespace) -> Tracer:
    global tracer
    if tracer is None:
        from flowq import __version__

        # A proxy until the application sets its tracer provider, then that provider's.
        tracer = api.trace.get_tracer("flowq", __version__)
    return tracer


def _unconfigured(api: SimpleNamespace) -> bool:
    """Whether a span made now would be a no-op with nothing to propagate: the application set
    no tracer provider (flowq's tracer is still the API's proxy) and no valid span is current
    (an incoming request's context would be stored)."""
    return (isinstance(_get_tracer(api), api.trace.ProxyTracer)
            and isinstance(api.trace.get_tracer_provider(), api.trace.ProxyTracerProvider)
            and not api.trace.get_current_span().get_span_context().is_valid)


def unconfigured() -> bool:
    """Whether an enqueue now would make no span and store no context (`publish` skips it):
    no tracer provider set and no span current, or no OpenTelemetry API at all."""
    api = _load()
    return api is None or _unconfigured(api)


# -- the producer: enqueue ---------------------------------------------------------------------


class Publication:
    """The PRODUCER span of one enqueue while its statement runs: `params` are the call's bind
    parameters with `trace_context` set; `done(result)` notes what was enqueued."""

    def __init__(self, span: Span, params: dict[str, Any]) -> None:
        self.span = span
        self.params = params

    def done(self, result: object) -> None:
        if not self.span.is_recording():
            return
        run_id = getattr(result, "id", None)
        if isinstance(run_id, int):  # one run (Enqueued)
            self.span.set_attribute("flowq.run_id", run_id)
            self.span.set_attribute("messaging.message.id", str(getattr(result, "job_id", "")))
            self.span.set_attribute("flowq.created", bool(getattr(result, "created", True)))


@contextmanager
def publish(params: Mapping[str, Any]) -> Iterator[Publication | None]:
    """A PRODUCER span around one enqueue (None when tracing is off): its context goes into
    the enqueue's `trace_context` parameter, so the worker's spans become its children."""
    api = _load()
    if api is None:
        yield None
        return
    task = str(params.get("task", ""))
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.name": "publish",
        "messaging.operation.type": "send",
        "messaging.destination.name": str(params.get("queue", "")),
        "flowq.task": task,
    }
    if _unconfigured(api):
        # No SDK and no incoming context: the span would be a no-op and nothing would be
        # stored, so skip making it current (tens of microseconds per enqueue).
        yield Publication(api.trace.INVALID_SPAN, {**params, "trace_context": None})
        return
    rows = params.get("args")
    if isinstance(rows, list):  # enqueue_many: one span for the batch
        attributes["messaging.batch.message_count"] = len(rows)
    with _get_tracer(api).start_as_current_span(
            f"publish {task}", kind=api.trace.SpanKind.PRODUCER,
            attributes=attributes) as span:
        carrier: dict[str, str] = {}
        api.propagator.inject(carrier)  # the current context: this span's
        context = json.dumps(carrier, separators=(",", ":")) if carrier else None
        yield Publication(span, {**params, "trace_context": context})


# -- the consumer: one span per attempt -------------------------------------------------------


def _parent(api: SimpleNamespace, stored: str | None) -> Any:
    """The context a job was enqueued under (empty: a new trace; never the worker thread's
    own current context)."""
    empty = api.context.Context()
    if not stored:
        return empty
    try:
        carrier = json.loads(stored)
    except ValueError:
        return empty
    if not isinstance(carrier, dict):
        return empty
    return api.propagator.extract(carrier, context=empty)


def start_attempt(job: ClaimedJob, step: str) -> Span | None:
    """The CONSUMER span of one attempt of `job` (its step resolved as `step`), started now
    as the child of the context stored with the job; None when tracing is off."""
    api = _load()
    if api is None:
        return None
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.destination.name": job.queue,
        "messaging.message.id": str(job.id),
        "flowq.task": job.task,
        "flowq.step": step,
        "flowq.run_id": job.run_id,
        "flowq.job_id": job.id,
        "flowq.attempt": job.attempts,
    }
    if job.map_index is not None:
        attributes["flowq.map_index"] = job.map_index
    name = f"process {job.task}.{step}" if step else f"process {job.task}"
    span: Span = _get_tracer(api).start_span(
        name, context=_parent(api, job.trace_context), kind=api.trace.SpanKind.CONSUMER,
        attributes=attributes)
    return span


def _current(span: Span) -> Any:
    """Make `span` current (for the handler's own spans) without it judging the handler's
    exceptions: `end_attempt` does, from the outcome (a RetryStep is no error)."""
    assert _api is not None
    return _api.trace.use_span(span, end_on_exit=False, record_exception=False,
                               set_status_on_exception=False)


def called_in(span: Span, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` with `span` current (positional-only: a handler may well have an
    argument named `span` or `fn`)."""
    with _current(span):
        return fn(*args, **kwargs)


async def awaited_in(span: Span, awaitable: Awaitable[T]) -> T:
    """`await awaitable` with `span` current (in the awaiting task's context only)."""
    with _current(span):
        return await awaitable


def end_attempt(span: Span, outcome: Outcome | None, error: BaseException | None = None) -> None:
    """End an attempt's span with its outcome (None: it never ran)."""
    from flowq.worker.model import Cancelled, Failed, Retried, Succeeded, Suspended

    assert _api is not None
    if span.is_recording():
        if _FOLLOWED:
            _record_progress(span)
        status = _api.trace.StatusCode
        if isinstance(outcome, Failed):
            span.set_attribute("flowq.outcome", "dead" if outcome.retry_in is None else "failed")
            if outcome.retry_in is not None:
                span.set_attribute("flowq.retry_in_s", outcome.retry_in)
            if error is not None:
                span.record_exception(error)
                span.set_attribute("error.type", type(error).__qualname__)
            span.set_status(_api.trace.Status(status.ERROR, outcome.summary or None))
        elif isinstance(outcome, Succeeded):
            span.set_attribute("flowq.outcome", "succeeded")
        elif isinstance(outcome, Retried):
            span.set_attribute("flowq.outcome", "retried")
            span.set_attribute("flowq.retry_in_s", outcome.delay)
        elif isinstance(outcome, Cancelled):
            span.set_attribute("flowq.outcome", "cancelled")
        elif isinstance(outcome, Suspended):
            span.set_attribute("flowq.outcome", "suspended")
    span.end()


# -- progress: `ctx.progress` on the attempt's span ---------------------------------------------

# The contexts that report progress under a recording span, by span, both held weakly: the
# span is given their latest report when `end_attempt` ends it (an attribute set before the
# end is exported no sooner), so a report costs nothing per call.
_FOLLOWED: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def follow_progress(ctx: Any) -> None:
    """Remember `ctx` (a `flowq.Context` at its first `ctx.progress`) under the span current
    in its handler, if tracing is on and that span records: the attempt's span, unless the
    handler opened its own (which then gets nothing)."""
    if not ENABLED:
        return
    api = _load()
    if api is None:
        return
    span = api.trace.get_current_span()
    if span.is_recording():
        _FOLLOWED[span] = weakref.ref(ctx)


def _record_progress(span: Span) -> None:
    """Set the latest progress of the context following `span`: `flowq.progress.done`,
    `.total`, `.message` and `.reports` (how many reports the attempt made)."""
    ref = _FOLLOWED.pop(span, None)
    ctx = None if ref is None else ref()
    latest = None if ctx is None else ctx.latest_progress
    if latest is None:
        return
    reports, done, total, message = latest
    span.set_attribute("flowq.progress.done", done)
    span.set_attribute("flowq.progress.reports", reports)
    if total is not None:
        span.set_attribute("flowq.progress.total", total)
    if message is not None:
        span.set_attribute("flowq.progress.message", message)
