"""flowq: durable jobs and pipelines on the PostgreSQL you already have.

Enqueue in your own transaction (`session.enqueue(...)`), run `flowq worker`, and get
SKIP LOCKED claims, durable tenacity retries, heartbeats and a reaper, and chained pipeline
steps whose outputs are persisted.

The public names below load on first use (PEP 562): `import flowq` costs nothing, so that
`flowq --version` and `flowq --help` start at once instead of importing SQLAlchemy, psycopg
and alembic first. `from flowq import FlowQ` and `flowq.FlowQ` work as with eager imports;
`_EXPORTS` is the one table of which module defines each name, and the `TYPE_CHECKING`
imports repeat it for type checkers and IDEs (tests/unit/test_cli_startup.py checks they agree).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from flowq.db.migrations import migrate
    from flowq.define.app import FlowQ
    from flowq.define.pipeline import Pipeline, Task
    from flowq.define.queues import Rate
    from flowq.define.retry import Retry
    from flowq.define.step import Step
    from flowq.define.workflows import Each, each
    from flowq.durable.context import Context
    from flowq.enqueueing.prepare import Enqueued
    from flowq.enqueueing.signals import Signalled
    from flowq.enqueueing.sync import Session, SessionMixin, enqueue, enqueue_many, signal
    from flowq.errors import (
        CancelRun,
        CheckpointError,
        ChildFailed,
        ConfigurationError,
        ContextError,
        DatabaseUnavailableError,
        DatabaseURLError,
        DeadlineExceeded,
        DemoError,
        EmbeddedPostgresError,
        EnqueueConflictError,
        FlowqError,
        InvalidArgumentsError,
        InvalidQueueError,
        MigrationBlockedError,
        NaiveDatetimeError,
        RetryStep,
        RunNotFoundError,
        RunStateError,
        SchemaMissingError,
        SignalError,
        SignalTimeout,
        Snooze,
        UnknownTaskError,
        WorkerStopError,
        WorkflowError,
    )
    from flowq.ops.results import await_run, get_result, wait_run
    from flowq.worker import Worker, WorkerConfig
    from flowq.worker.logs import configure_logging

__all__ = [
    "CancelRun",
    "CheckpointError",
    "ChildFailed",
    "ConfigurationError",
    "Context",
    "ContextError",
    "DatabaseURLError",
    "DatabaseUnavailableError",
    "DeadlineExceeded",
    "DemoError",
    "Each",
    "EmbeddedPostgresError",
    "EnqueueConflictError",
    "Enqueued",
    "FlowQ",
    "FlowqError",
    "InvalidArgumentsError",
    "InvalidQueueError",
    "MigrationBlockedError",
    "NaiveDatetimeError",
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
    "Snooze",
    "Step",
    "Task",
    "UnknownTaskError",
    "Worker",
    "WorkerConfig",
    "WorkerStopError",
    "WorkflowError",
    "await_run",
    "configure_logging",
    "each",
    "enqueue",
    "enqueue_many",
    "get_result",
    "migrate",
    "signal",
    "wait_run",
]

__version__ = "0.1.0"

# Which module defines each public name (the same imports as the TYPE_CHECKING block).
_EXPORTS: Final[dict[str, tuple[str, ...]]] = {
    "flowq.define.app": ("FlowQ",),
    "flowq.define.pipeline": ("Pipeline", "Task"),
    "flowq.define.step": ("Step",),
    "flowq.define.queues": ("Rate",),
    "flowq.define.retry": ("Retry",),
    "flowq.define.workflows": ("Each", "each"),
    "flowq.enqueueing.prepare": ("Enqueued",),
    "flowq.enqueueing.signals": ("Signalled",),
    "flowq.enqueueing.sync": ("Session", "SessionMixin", "enqueue", "enqueue_many", "signal"),
    "flowq.durable.context": ("Context",),
    "flowq.errors": (
        "CancelRun", "ConfigurationError", "DatabaseUnavailableError", "DeadlineExceeded",
        "EmbeddedPostgresError",
        "FlowqError", "InvalidArgumentsError", "InvalidQueueError", "RetryStep",
        "RunNotFoundError", "RunStateError", "SchemaMissingError", "SignalError",
        "SignalTimeout", "UnknownTaskError", "WorkflowError", "CheckpointError", "Snooze",
        "ChildFailed", "ContextError", "DatabaseURLError", "DemoError", "EnqueueConflictError",
        "NaiveDatetimeError", "WorkerStopError", "MigrationBlockedError",
    ),
    "flowq.db.migrations": ("migrate",),
    "flowq.ops.results": ("await_run", "get_result", "wait_run"),
    "flowq.worker": ("Worker", "WorkerConfig"),
    "flowq.worker.logs": ("configure_logging",),
}
# Modules users reach as attributes of the package by their old public names (`flowq.runs`
# then `.get_run(engine, run_id)`, `flowq.runs.fork`; `flowq.aio` then `.AsyncSession`), now
# modules of define/, enqueueing/, ops/ and durable/; imported on first use (the async one needs
# greenlet), without a warning: the attribute is the module itself. Importing an old path
# (`import flowq.runs`, `from flowq.queues import Rate`) goes through its shim module
# (flowq/deprecated.py), which warns for one release.
_MODULES: Final[dict[str, str]] = {
    "aio": "flowq.enqueueing.aio",
    "children": "flowq.durable.children",
    "doctor": "flowq.ops.doctor",
    "durable": "flowq.durable",
    "queues": "flowq.ops.queues",
    "runs": "flowq.ops.runs",
    "schedules": "flowq.ops.schedules",
    "status": "flowq.ops.status",
    "workflows": "flowq.define.workflows",
}
_MODULE_OF: Final[dict[str, str]] = {
    name: module for module, names in _EXPORTS.items() for name in names
}


def __getattr__(name: str) -> Any:
    """Import the module defining the public `name` and keep the value here (PEP 562)."""
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    module = _MODULE_OF.get(name)
    if module is None:
        # Not a public name: AttributeError, which also lets `from flowq import tracing`
        # fall back to importing the submodule.
        raise AttributeError(f"module 'flowq' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
