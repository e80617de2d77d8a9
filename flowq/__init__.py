"""flowq: durable jobs and pipelines on the PostgreSQL you already have.

Enqueue in your own transaction (`session.enqueue(...)`), run `flowq worker`, and get
SKIP LOCKED claims, durable tenacity retries, heartbeats and a reaper, and chained pipeline
steps whose outputs are persisted.
"""

from __future__ import annotations

from flowq.app import FlowQ, Pipeline, Step, Task
from flowq.context import Context
from flowq.db.migrations import migrate
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
from flowq.queues import Rate
from flowq.retry import Retry
from flowq.session import Enqueued, Session, SessionMixin, enqueue, enqueue_many, signal
from flowq.worker import Worker, WorkerConfig
from flowq.worker.logs import configure_logging
from flowq.workflows import Each, Signalled, each

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
