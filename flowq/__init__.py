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
from flowq.enqueue.prepare import Enqueued
from flowq.enqueue.signals import Signalled
from flowq.enqueue.sync import Session, SessionMixin, enqueue, enqueue_many, signal
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
