"""flowq: durable jobs and pipelines on the PostgreSQL you already have.

Enqueue in your own transaction (`session.enqueue(...)`), run `flowq worker`, and get
SKIP LOCKED claims, durable tenacity retries, heartbeats and a reaper, and chained pipeline
steps whose outputs are persisted.
"""

from __future__ import annotations

from flowq.context import Context
from flowq.define.app import FlowQ
from flowq.define.pipeline import Pipeline, Task
from flowq.define.queues import Rate
from flowq.define.retry import Retry
from flowq.define.step import Step
from flowq.define.workflows import Each, each
from flowq.enqueueing.prepare import Enqueued
from flowq.enqueueing.signals import Signalled
from flowq.enqueueing.sync import Session, SessionMixin, enqueue, enqueue_many, signal
from flowq.errors import (
    CancelRun,
    ConfigurationError,
    DatabaseUnavailableError,
    EmbeddedPostgresError,
    FlowqError,
    InvalidArgumentsError,
    InvalidQueueError,
    RetryStep,
    RunNotFoundError,
    RunStateError,
    SchemaMissingError,
    SignalError,
    SignalTimeout,
    UnknownTaskError,
    WorkflowError,
)
from flowq.migrations import migrate
from flowq.worker import Worker, WorkerConfig
from flowq.worker.logs import configure_logging

__all__ = [
    "CancelRun",
    "ConfigurationError",
    "Context",
    "DatabaseUnavailableError",
    "Each",
    "EmbeddedPostgresError",
    "Enqueued",
    "FlowQ",
    "FlowqError",
    "InvalidArgumentsError",
    "InvalidQueueError",
    "Pipeline",
    "Rate",
    "Retry",
    "RetryStep",
    "RunNotFoundError",
    "RunStateError",
    "SchemaMissingError",
    "Session",
    "SessionMixin",
    "SignalError",
    "SignalTimeout",
    "Signalled",
    "Step",
    "Task",
    "UnknownTaskError",
    "Worker",
    "WorkerConfig",
    "WorkflowError",
    "configure_logging",
    "each",
    "enqueue",
    "enqueue_many",
    "migrate",
    "signal",
]

__version__ = "0.1.0"

# Modules users reach as attributes of the package, by their old public names (`flowq.runs`
# then `.get_run(engine, run_id)`; `flowq.aio` then `.AsyncSession`), now modules of define/,
# enqueueing/ and ops/; imported on first use (the async one needs greenlet).
_MODULES = {
    "aio": "flowq.enqueueing.aio",
    "doctor": "flowq.ops.doctor",
    "queues": "flowq.ops.queues",
    "runs": "flowq.ops.runs",
    "schedules": "flowq.ops.schedules",
    "status": "flowq.ops.status",
    "workflows": "flowq.define.workflows",
}


def __getattr__(name: str) -> object:
    if name in _MODULES:
        import importlib

        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'flowq' has no attribute {name!r}")
