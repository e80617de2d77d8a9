"""flowq: durable jobs and pipelines on the PostgreSQL you already have.

Enqueue in your own transaction (`session.enqueue(...)`), run `flowq worker`, and get
SKIP LOCKED claims, durable tenacity retries, heartbeats and a reaper, and chained pipeline
steps whose outputs are persisted.

The public names below load on first use (PEP 562): `import flowq` costs nothing, so that
`flowq --version` and `flowq --help` start at once instead of importing SQLAlchemy, psycopg
and alembic first. `from flowq import FlowQ` and `flowq.FlowQ` work as with eager imports;
`_EXPORTS` is the one table of which module defines each name, and the `TYPE_CHECKING`
imports repeat it for type checkers and IDEs (tests/test_cli_startup.py checks they agree).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from flowq.app import FlowQ, Pipeline, Step, Task
    from flowq.context import Context
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

# Which module defines each public name (the same imports as the TYPE_CHECKING block).
_EXPORTS: Final[dict[str, tuple[str, ...]]] = {
    "flowq.app": ("FlowQ", "Pipeline", "Step", "Task"),
    "flowq.context": ("Context",),
    "flowq.errors": (
        "CancelRun", "ConfigurationError", "DatabaseUnavailableError", "EmbeddedPostgresError",
        "FlowqError", "InvalidArgumentsError", "InvalidQueueError", "RetryStep",
        "RunNotFoundError", "RunStateError", "SchemaMissingError", "SignalError",
        "SignalTimeout", "UnknownTaskError", "WorkflowError",
    ),
    "flowq.migrations": ("migrate",),
    "flowq.queues": ("Rate",),
    "flowq.retry": ("Retry",),
    "flowq.session": ("Enqueued", "Session", "SessionMixin", "enqueue", "enqueue_many",
                      "signal"),
    "flowq.worker": ("Worker", "WorkerConfig"),
    "flowq.worker.logs": ("configure_logging",),
    "flowq.workflows": ("Each", "Signalled", "each"),
}
_MODULE_OF: Final[dict[str, str]] = {
    name: module for module, names in _EXPORTS.items() for name in names
}


def __getattr__(name: str) -> Any:
    """Import the module defining the public `name` and keep the value here (PEP 562)."""
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
